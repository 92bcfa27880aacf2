// GPT-2: token and learned position embeddings, n_layer pre-LayerNorm blocks of causal
// attention (n_head heads of d_model / n_head channels) and a 4x GELU MLP, a final LayerNorm,
// and the LM head tied to the token embedding.
#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/gpu_limits.h"
#include "common/model_family.h"

namespace lockstep {
namespace {

absl::Status ValidateGpt(const v1::ModelSpec& spec) {
  const v1::GptSpec& model = spec.gpt();
  for (const auto& [field, value, limit] :
       {std::tuple<const char*, int32_t, int32_t>{"vocab_size", model.vocab_size(), 1 << 20},
        {"context_length", model.context_length(), 1 << 16},
        {"n_layer", model.n_layer(), 1024},
        {"n_head", model.n_head(), 1024},
        {"d_model", model.d_model(), 1 << 16}}) {
    if (value <= 0 || value > limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.gpt.", field, ": must be in [1, ", limit, "], got ", value));
    }
  }
  if (model.d_model() % model.n_head() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.gpt.d_model: ", model.d_model(), " is not divisible by n_head ", model.n_head()));
  }
  return absl::OkStatus();
}

// In buffer order: the final LayerNorm, the blocks from the last to the first, then the
// position and token embeddings. GPT-2's conventions: decay on the matrices only (the
// embeddings unless optimizer.decay_embeddings); backward finishes a piece with each tensor
// pair (a LayerNorm's, a product's weight and bias) and with each embedding.
std::vector<TensorSize> GptTensors(const v1::ModelSpec& spec, int64_t /*features*/,
                                   int64_t /*classes*/) {
  const v1::GptSpec& model = spec.gpt();
  std::vector<TensorSize> t;
  const int64_t C = model.d_model(), L = model.n_layer();
  auto add = [&](std::string name, std::vector<int64_t> shape, bool ends_piece,
                 bool embedding = false) {
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    const bool decay = shape.size() >= 2 && !embedding;
    t.push_back({std::move(name), count, std::move(shape), decay, embedding, ends_piece});
  };
  add("ln_f.weight", {C}, false);
  add("ln_f.bias", {C}, true);
  for (int64_t l = L - 1; l >= 0; --l) {
    const std::string p = absl::StrCat("h.", l, ".");
    add(p + "mlp.c_proj.weight", {4 * C, C}, false);
    add(p + "mlp.c_proj.bias", {C}, true);
    add(p + "mlp.c_fc.weight", {C, 4 * C}, false);
    add(p + "mlp.c_fc.bias", {4 * C}, true);
    add(p + "ln_2.weight", {C}, false);
    add(p + "ln_2.bias", {C}, true);
    add(p + "attn.c_proj.weight", {C, C}, false);
    add(p + "attn.c_proj.bias", {C}, true);
    add(p + "attn.c_attn.weight", {C, 3 * C}, false);
    add(p + "attn.c_attn.bias", {3 * C}, true);
    add(p + "ln_1.weight", {C}, false);
    add(p + "ln_1.bias", {C}, true);
  }
  add("wpe.weight", {int64_t{model.context_length()}, C}, true, /*embedding=*/true);
  add("wte.weight", {int64_t{model.vocab_size()}, C}, true, /*embedding=*/true);
  return t;
}

ModelMemoryTerms GptMemory(const v1::JobSpec& spec, int64_t micro_batch) {
  const v1::GptSpec& model = spec.model().gpt();
  ModelMemoryTerms m;
  const std::vector<TensorSize> tensors = GptTensors(spec.model(), 0, 0);
  const std::vector<std::string> patterns(spec.model().frozen_parameters().begin(),
                                          spec.model().frozen_parameters().end());
  absl::StatusOr<std::vector<bool>> frozen = MatchFrozen(tensors, patterns);
  for (size_t i = 0; i < tensors.size(); ++i) {
    m.params += tensors[i].count;
    if (!frozen.ok() || !(*frozen)[i]) m.trainable += tensors[i].count;
  }
  // Per token: each block keeps its input, both LayerNorms' outputs and statistics, q/k/v,
  // the attention output and its log-sum-exps, the stream after attention, and the MLP's
  // pre- and post-GELU activations (16 C + heads + 4); then the final LayerNorm and backward's
  // temporaries (about 13 C). Attention keeps O(T) per row, never T x T.
  const int64_t C = model.d_model(), T = model.context_length(), L = model.n_layer();
  m.per_sample = T * (L * (16 * C + model.n_head() + 4) + 13 * C + 3) + T + 1;
  // All but the residual stream and the statistics: per block q/k/v, the attention output,
  // both LayerNorms' outputs, the MLP's pre-activation and the GELU's output (14 C); the
  // final LayerNorm's output (C).
  m.bf16_values = T * (L * 14 * C + C);
  m.input = T + 1;
  // The LM head's logits, one chunk of rows at a time (at most 4 Mi values).
  m.fixed = std::min<int64_t>(int64_t{1} << 22, T * std::max(1, model.vocab_size()));
  // A GPU's head runs in larger chunks, up to kGpuHeadChunkValues (a line through 0 up to the
  // bound, an over-count after it: ChooseMicroBatch solves a line).
  m.gpu_head_values = std::min<int64_t>(
      kGpuHeadChunkValues, T * std::max<int64_t>(1, model.vocab_size()) * micro_batch);
  // bf16 (2 bytes a value): the parameters' bf16 copy, and a linear layer's output gradient
  // (at most 4 C a row) and a chunk of logit gradients, each rounded once for its two
  // products; its products never round an operand of their own.
  m.gpu_bf16_bytes = 2 * (m.params + micro_batch * T * 4 * C + m.gpu_head_values);
  return m;
}

// GPU workers' attention takes heads of up to kMaxGpuAttentionHead channels.
absl::Status ValidateGptOnDevice(const v1::JobSpec& spec) {
  const v1::GptSpec& model = spec.model().gpt();
  if (spec.device() == "cuda" && model.n_head() > 0 &&
      model.d_model() / model.n_head() > kMaxGpuAttentionHead) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.gpt.n_head: heads of ", model.d_model() / model.n_head(),
                     " channels (d_model / n_head); GPU workers take up to ",
                     kMaxGpuAttentionHead, ": use more heads"));
  }
  return absl::OkStatus();
}

TokenShape GptTokens(const v1::ModelSpec& model) {
  return {model.gpt().vocab_size(), model.gpt().context_length()};
}

}  // namespace

// name, language_model, apply_defaults, validate, tensors, memory, validate_on_device, tokens_of
const ModelFamily kGptFamily = {"gpt",     true,      nullptr,
                                ValidateGpt, GptTensors, GptMemory,
                                ValidateGptOnDevice,  GptTokens};

}  // namespace lockstep
