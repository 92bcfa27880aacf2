#include "common/job_memory.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/gpu_limits.h"
#include "common/model_layout.h"

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
  const v1::ModelSpec& model = spec.model();
  const bool gpt = model.type() == "gpt";
  int64_t per_sample = 0;  // floats of activations and backward temporaries per sample
  int64_t fixed = 0;       // floats of working memory whatever the micro-batch
  int64_t params = 0, trainable = 0;
  int64_t input = 0;  // values of one sample's input (features and label, or its tokens)
  // Of per_sample, the activations a GPU keeps in bfloat16 under precision "bf16".
  int64_t bf16_values = 0;
  if (gpt) {
    const std::vector<TensorSize> tensors = ModelTensors(model, 0, 0);
    const std::vector<std::string> patterns(model.frozen_parameters().begin(),
                                            model.frozen_parameters().end());
    absl::StatusOr<std::vector<bool>> frozen = MatchFrozen(tensors, patterns);
    for (size_t i = 0; i < tensors.size(); ++i) {
      params += tensors[i].count;
      if (!frozen.ok() || !(*frozen)[i]) trainable += tensors[i].count;
    }
    // Per token: each block keeps its input, both LayerNorms' outputs and statistics, q/k/v,
    // the attention output and its log-sum-exps, the stream after attention, and the MLP's
    // pre- and post-GELU activations (16 C + heads + 4); then the final LayerNorm and backward's
    // temporaries (about 13 C). Attention keeps O(T) per row, never T x T.
    const int64_t C = model.d_model(), T = model.context_length(), L = model.n_layer();
    per_sample = T * (L * (16 * C + model.n_head() + 4) + 13 * C + 3) + T + 1;
    // All but the residual stream and the statistics: per block q/k/v, the attention output,
    // both LayerNorms' outputs, the MLP's pre-activation and the GELU's output (14 C); the
    // final LayerNorm's output (C).
    bf16_values = T * (L * 14 * C + C);
    input = T + 1;
    // The LM head's logits, one chunk of rows at a time (at most 4 Mi values).
    fixed = std::min<int64_t>(int64_t{1} << 22, T * std::max(1, model.vocab_size()));
  } else {
    const std::vector<int64_t> dims = LayerWidths(spec);
    int64_t widest = 0;
    per_sample = dims.front();  // the input row
    input = dims.front() + 1;
    for (size_t i = 0; i + 1 < dims.size(); ++i) {
      params += dims[i] * dims[i + 1] + dims[i + 1];
      widest = std::max(widest, dims[i + 1]);
      per_sample += 2 * dims[i + 1];  // pre-activation and activation (logits and their gradient)
    }
    per_sample += 2 * widest;  // backward's two temporaries (upstream and local gradient)
    trainable = params;
  }
  e.micro_batch = micro_batch;
  e.parameters = 4 * params;
  // Frozen tensors have no gradient and no optimizer state.
  e.gradients = 4 * trainable;
  e.optimizer = (spec.optimizer().type() == "adamw" ? 8 : 4) * trainable;
  // A GPU's head runs in larger chunks, counted with its buffers below instead.
  const bool gpu = spec.device() == "cuda";
  e.activations = 4 * (per_sample * micro_batch + (gpu ? 0 : fixed));
  if (gpu && spec.precision() == "bf16") e.activations -= 2 * bf16_values * micro_batch;
  // Default: the reducer's bucket copies, about one gradient. Deterministic: the int64 sum,
  // and as much again in the communicator.
  e.communication = spec.deterministic() ? 16 * (trainable + 2) : 4 * trainable;
  if (gpu) {
    // A second upload slot (the next micro-batch's copy overlaps this one's compute); the
    // workspaces; NCCL's buffers when the job may run on a group; the GPT's logits in chunks of
    // up to kGpuHeadChunkValues (a line through 0 up to the bound, an over-count after it:
    // ChooseMicroBatch solves a line).
    e.device = 4 * input * micro_batch + 2 * kGpuBlasWorkspaceBytes +
               (spec.max_workers() != 1 ? kGpuNcclBufferBytes : 0);
    const int64_t head_values =
        gpt ? std::min<int64_t>(kGpuHeadChunkValues,
                                int64_t{model.context_length()} *
                                    std::max<int64_t>(1, model.vocab_size()) * micro_batch)
            : 0;
    e.device += 4 * head_values;
    // bf16 (2 bytes a value). The GPT: the parameters' bf16 copy, and a linear layer's output
    // gradient (at most 4 C a row) and a chunk of logit gradients, each rounded once for its
    // two products; its products never round an operand of their own. The MLP: a product's
    // two operands rounded into two scratch slots; either slot may hold the largest
    // activation or the largest weight (a sum, not a max, so the estimate stays a line
    // ChooseMicroBatch can solve).
    if (spec.precision() == "bf16" && gpt) {
      e.device += 2 * (params + micro_batch * model.context_length() * 4 * model.d_model() +
                       head_values);
    } else if (spec.precision() == "bf16") {
      int64_t widest_rows = 0, largest_weight = 0;
      const std::vector<int64_t> dims = LayerWidths(spec);
      for (size_t i = 0; i + 1 < dims.size(); ++i) {
        widest_rows = std::max(widest_rows, micro_batch * std::max(dims[i], dims[i + 1]));
        largest_weight = std::max(largest_weight, dims[i] * dims[i + 1]);
      }
      e.device += 2 * 2 * (widest_rows + largest_weight);
    }
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
