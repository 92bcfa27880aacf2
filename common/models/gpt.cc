// GPT-2: token and learned position embeddings, n_layer pre-LayerNorm blocks of causal
// attention (n_head heads of d_model / n_head channels) and a 4x GELU MLP, a final LayerNorm,
// and the LM head tied to the token embedding.
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/model_family.h"

namespace lockstep {
namespace {

absl::Status ValidateGpt(const v1::ModelSpec& model) {
  for (const auto& [field, value, limit] :
       {std::tuple<const char*, int32_t, int32_t>{"vocab_size", model.vocab_size(), 1 << 20},
        {"context_length", model.context_length(), 1 << 16},
        {"n_layer", model.n_layer(), 1024},
        {"n_head", model.n_head(), 1024},
        {"d_model", model.d_model(), 1 << 16}}) {
    if (value <= 0 || value > limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.", field, ": must be in [1, ", limit, "], got ", value));
    }
  }
  if (model.d_model() % model.n_head() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.d_model: ", model.d_model(), " is not divisible by n_head ", model.n_head()));
  }
  if (!model.hidden_widths().empty()) {
    return absl::InvalidArgumentError(
        "model.hidden_widths: is an MLP field; the GPT's width is d_model");
  }
  return absl::OkStatus();
}

// In buffer order: the final LayerNorm, the blocks from the last to the first, then the
// position and token embeddings (the worker's Gpt lays out the same, tests/unit/model_test.cc).
std::vector<TensorSize> GptTensors(const v1::ModelSpec& model, int64_t /*features*/,
                                   int64_t /*classes*/) {
  std::vector<TensorSize> t;
  const int64_t C = model.d_model(), L = model.n_layer();
  t.push_back({"ln_f.weight", C});
  t.push_back({"ln_f.bias", C});
  for (int64_t l = L - 1; l >= 0; --l) {
    const std::string p = absl::StrCat("h.", l, ".");
    t.push_back({p + "mlp.c_proj.weight", 4 * C * C});
    t.push_back({p + "mlp.c_proj.bias", C});
    t.push_back({p + "mlp.c_fc.weight", 4 * C * C});
    t.push_back({p + "mlp.c_fc.bias", 4 * C});
    t.push_back({p + "ln_2.weight", C});
    t.push_back({p + "ln_2.bias", C});
    t.push_back({p + "attn.c_proj.weight", C * C});
    t.push_back({p + "attn.c_proj.bias", C});
    t.push_back({p + "attn.c_attn.weight", 3 * C * C});
    t.push_back({p + "attn.c_attn.bias", 3 * C});
    t.push_back({p + "ln_1.weight", C});
    t.push_back({p + "ln_1.bias", C});
  }
  t.push_back({"wpe.weight", int64_t{model.context_length()} * C});
  t.push_back({"wte.weight", int64_t{model.vocab_size()} * C});
  return t;
}

}  // namespace

// name, language_model, apply_defaults, validate, tensors
const ModelFamily kGptFamily = {"gpt", true, nullptr, ValidateGpt, GptTensors};

}  // namespace lockstep
