// The MLP classifier: hidden layers of hidden_widths with one activation, on features.
#include "absl/strings/str_cat.h"
#include "common/model_family.h"

namespace lockstep {
namespace {

void MlpDefaults(v1::ModelSpec& model) {
  if (model.activation().empty()) model.set_activation("relu");
}

absl::Status ValidateMlp(const v1::ModelSpec& model) {
  for (int i = 0; i < model.hidden_widths_size(); ++i) {
    if (model.hidden_widths(i) <= 0 || model.hidden_widths(i) > (1 << 20)) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.hidden_widths[", i, "]: must be in [1, 1048576], got ",
                       model.hidden_widths(i)));
    }
  }
  if (model.activation() != "relu" && model.activation() != "gelu") {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.activation: unknown activation \"", model.activation(), "\" (relu, gelu)"));
  }
  return absl::OkStatus();
}

// fcL.weight and fcL.bias per layer, the last layer first (an MLP's names do not depend on
// its input and output widths).
std::vector<TensorSize> MlpTensors(const v1::ModelSpec& model, int64_t features,
                                   int64_t classes) {
  std::vector<TensorSize> t;
  std::vector<int64_t> dims = {features};
  for (int w : model.hidden_widths()) dims.push_back(w);
  dims.push_back(classes);
  for (size_t l = dims.size() - 1; l >= 1; --l) {
    t.push_back({absl::StrCat("fc", l, ".weight"), dims[l - 1] * dims[l]});
    t.push_back({absl::StrCat("fc", l, ".bias"), dims[l]});
  }
  return t;
}

}  // namespace

// name, language_model, apply_defaults, validate, tensors
const ModelFamily kMlpFamily = {"mlp", false, MlpDefaults, ValidateMlp, MlpTensors};

}  // namespace lockstep
