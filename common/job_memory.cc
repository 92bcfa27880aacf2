#include "coordinator/core/memory.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace lockstep::coordinator {
namespace {

// The model's layer widths, input first. IDX data sets are read by the workers, so their
// image size is not known here: MNIST's 28 x 28 is assumed (what the format is used for).
std::vector<int64_t> LayerWidths(const v1::JobSpec& spec) {
  std::vector<int64_t> dims;
  const bool synthetic = spec.dataset().type() == "synthetic";
  dims.push_back(synthetic ? spec.dataset().synthetic().input_dim() : 28 * 28);
  for (int width : spec.model().hidden_widths()) dims.push_back(width);
  dims.push_back(synthetic ? spec.dataset().synthetic().num_classes() : 10);
  return dims;
}

}  // namespace

MemoryEstimate EstimateWorkerMemory(const v1::JobSpec& spec, int world) {
  MemoryEstimate e;
  const std::vector<int64_t> dims = LayerWidths(spec);
  int64_t params = 0, widest = 0, per_sample = dims.front();  // the input row
  for (size_t i = 0; i + 1 < dims.size(); ++i) {
    params += dims[i] * dims[i + 1] + dims[i + 1];
    widest = std::max(widest, dims[i + 1]);
    per_sample += 2 * dims[i + 1];  // pre-activation and activation (logits and their gradient)
  }
  per_sample += 2 * widest;  // backward's two temporaries (upstream and local gradient)
  const int64_t shards = std::max<int64_t>(1, spec.micro_shards());
  const int64_t shard_size = spec.global_batch_size() / shards;
  const int64_t shards_per_worker = (shards + std::max(1, world) - 1) / std::max(1, world);
  // Deterministic mode runs one micro-shard at a time; the default mode a worker's whole share.
  e.micro_batch = spec.deterministic() ? shard_size : shard_size * shards_per_worker;
  e.parameters = 4 * params;
  e.gradients = 4 * params;
  e.optimizer = (spec.optimizer().type() == "adamw" ? 8 : 4) * params;
  e.activations = 4 * per_sample * e.micro_batch;
  // Default: the reducer's bucket copies, about one gradient. Deterministic: the int64 sum,
  // and as much again in the communicator.
  e.communication = spec.deterministic() ? 16 * (params + 2) : 4 * params;
  return e;
}

std::string HumanBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) return absl::StrFormat("%.1f GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return absl::StrFormat("%.0f MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return absl::StrFormat("%.0f KiB", b / 1024.0);
  return absl::StrCat(bytes, " B");
}

std::string MemoryEstimate::ToString() const {
  return absl::StrCat(HumanBytes(total()), " (parameters ", HumanBytes(parameters), ", gradients ",
                      HumanBytes(gradients), ", optimizer ", HumanBytes(optimizer),
                      ", activations ", HumanBytes(activations), " for ", micro_batch,
                      " samples at once, communication ", HumanBytes(communication), ")");
}

}  // namespace lockstep::coordinator
