#include "common/job_memory.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/gpu_limits.h"
#include "common/model_family.h"
#include "common/model_layout.h"

namespace lockstep {
namespace {

// The model's layer widths, input first. IDX data sets are read by the workers, so their
// image size is not known here: MNIST's 28 x 28 is assumed (what the format is used for).
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
  const ModelFamily* family = FindModelFamily(spec.model().type());
  if (family == nullptr) return e;  // a spec validation refuses
  const ModelMemoryTerms m = family->memory(spec, micro_batch);
  e.micro_batch = micro_batch;
  e.parameters = 4 * m.params;
  const bool gpu = spec.device() == "cuda";
  // Frozen tensors have no optimizer state, and on a CPU no gradient; a GPU's gradient buffer
  // (and deterministic mode's fixed-point sum) is laid out as the parameters, frozen tensors
  // included (kept zero).
  const int64_t gradient_values = gpu ? m.params : m.trainable;
  e.gradients = 4 * gradient_values;
  e.optimizer = (spec.optimizer().type() == "adamw" ? 8 : 4) * m.trainable;
  // A GPU's head runs in larger chunks, counted with its buffers below instead.
  e.activations = 4 * (m.per_sample * micro_batch + (gpu ? 0 : m.fixed));
  if (gpu && spec.precision() == "bf16") e.activations -= 2 * m.bf16_values * micro_batch;
  // Default: the reducer's bucket copies, about one gradient. Deterministic: the int64 sum,
  // and as much again in the communicator.
  e.communication =
      spec.deterministic() ? 16 * (gradient_values + 2) : 4 * gradient_values;
  if (gpu) {
    // A second upload slot (the next micro-batch's copy overlaps this one's compute); the
    // workspaces; NCCL's buffers when the job may run on a group; the LM head's logits in
    // chunks; bf16 copies.
    e.device = 4 * m.input * micro_batch + 2 * kGpuBlasWorkspaceBytes +
               (spec.max_workers() != 1 ? kGpuNcclBufferBytes : 0) + 4 * m.gpu_head_values;
    if (spec.precision() == "bf16") e.device += m.gpu_bf16_bytes;
  }
  return e;
}

std::string MemoryEstimate::ToString() const {
  return absl::StrCat(HumanBytes(total()), " (parameters ", HumanBytes(parameters), ", gradients ",
                      HumanBytes(gradients), ", optimizer ", HumanBytes(optimizer),
                      ", activations ", HumanBytes(activations), " for ", micro_batch,
                      " samples at once, communication ", HumanBytes(communication),
                      device > 0 ? absl::StrCat(", GPU buffers ", HumanBytes(device)) : "",
                      ")");
}

}  // namespace lockstep
