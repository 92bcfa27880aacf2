#include "common/job_memory.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace lockstep {
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

int64_t MicroShardSize(const v1::JobSpec& spec) {
  return spec.global_batch_size() / std::max(1, spec.micro_shards());
}

}  // namespace

int64_t ShareSamples(const v1::JobSpec& spec, int world) {
  const int64_t shards = std::max(1, spec.micro_shards());
  return MicroShardSize(spec) * ((shards + std::max(1, world) - 1) / std::max(1, world));
}

int64_t MinMicroBatch(const v1::JobSpec& spec) {
  if (spec.deterministic() || spec.micro_batch_size() <= 0) return MicroShardSize(spec);
  return spec.micro_batch_size();
}

int64_t ChooseMicroBatch(const v1::JobSpec& spec, int world, int64_t budget) {
  const int64_t share = ShareSamples(spec, world);
  const int64_t shard = MicroShardSize(spec);
  if (spec.deterministic()) return shard;
  if (spec.micro_batch_size() > 0) return std::min<int64_t>(spec.micro_batch_size(), share);
  if (budget <= 0 || shard <= 0 || EstimateWorkerMemory(spec, share).total() <= budget) {
    return share;
  }
  // The estimate grows linearly with the micro-batch: solve for the largest whole number of
  // micro-shards under the budget.
  const MemoryEstimate fixed = EstimateWorkerMemory(spec, 0);
  const int64_t per_shard = EstimateWorkerMemory(spec, shard).total() - fixed.total();
  const int64_t shards = per_shard > 0 ? (budget - fixed.total()) / per_shard : share / shard;
  return shard * std::clamp<int64_t>(shards, 1, share / shard);
}

MemoryEstimate EstimateWorkerMemory(const v1::JobSpec& spec, int64_t micro_batch) {
  MemoryEstimate e;
  const std::vector<int64_t> dims = LayerWidths(spec);
  int64_t params = 0, widest = 0, per_sample = dims.front();  // the input row
  for (size_t i = 0; i + 1 < dims.size(); ++i) {
    params += dims[i] * dims[i + 1] + dims[i + 1];
    widest = std::max(widest, dims[i + 1]);
    per_sample += 2 * dims[i + 1];  // pre-activation and activation (logits and their gradient)
  }
  per_sample += 2 * widest;  // backward's two temporaries (upstream and local gradient)
  e.micro_batch = micro_batch;
  e.parameters = 4 * params;
  e.gradients = 4 * params;
  e.optimizer = (spec.optimizer().type() == "adamw" ? 8 : 4) * params;
  e.activations = 4 * per_sample * micro_batch;
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

}  // namespace lockstep
