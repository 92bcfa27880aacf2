#include "common/model_layout.h"

#include <fnmatch.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lockstep {

std::vector<TensorSize> ModelTensors(const v1::ModelSpec& model, int64_t features, int64_t classes) {
  std::vector<TensorSize> t;
  if (model.type() == "gpt") {
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
  std::vector<int64_t> dims = {features};
  for (int w : model.hidden_widths()) dims.push_back(w);
  dims.push_back(classes);
  for (size_t l = dims.size() - 1; l >= 1; --l) {  // the last layer first
    t.push_back({absl::StrCat("fc", l, ".weight"), dims[l - 1] * dims[l]});
    t.push_back({absl::StrCat("fc", l, ".bias"), dims[l]});
  }
  return t;
}

absl::StatusOr<std::vector<bool>> MatchFrozen(const std::vector<TensorSize>& tensors,
                                              const std::vector<std::string>& patterns) {
  std::vector<bool> frozen(tensors.size(), false);
  for (size_t p = 0; p < patterns.size(); ++p) {
    bool matched = false;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (fnmatch(patterns[p].c_str(), tensors[i].name.c_str(), 0) == 0) {
        frozen[i] = true;
        matched = true;
      }
    }
    if (!matched) {
      std::vector<std::string> names;
      for (size_t i = 0; i < tensors.size() && i < 8; ++i) names.push_back(tensors[i].name);
      return absl::InvalidArgumentError(absl::StrCat(
          "model.frozen_parameters[", p, "]: \"", patterns[p], "\" matches no tensor (tensors: ",
          absl::StrJoin(names, ", "), tensors.size() > 8 ? ", ..." : "", ")"));
    }
  }
  if (!tensors.empty() && std::all_of(frozen.begin(), frozen.end(), [](bool f) { return f; })) {
    return absl::InvalidArgumentError(
        "model.frozen_parameters: every tensor is frozen; nothing would train");
  }
  return frozen;
}

}  // namespace lockstep
