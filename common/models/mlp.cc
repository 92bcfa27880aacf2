// The MLP classifier: hidden layers of hidden_widths with one activation, on features.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model_family.h"

namespace lockstep {
namespace {

void MlpDefaults(v1::ModelSpec& spec) {
  v1::MlpSpec& model = *spec.mutable_mlp();
  if (model.activation().empty()) model.set_activation("relu");
}

absl::Status ValidateMlp(const v1::ModelSpec& spec) {
  const v1::MlpSpec& model = spec.mlp();
  for (int i = 0; i < model.hidden_widths_size(); ++i) {
    if (model.hidden_widths(i) <= 0 || model.hidden_widths(i) > (1 << 20)) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.mlp.hidden_widths[", i, "]: must be in [1, 1048576], got ",
                       model.hidden_widths(i)));
    }
  }
  if (model.activation() != "relu" && model.activation() != "gelu") {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.mlp.activation: unknown activation \"", model.activation(), "\" (relu, gelu)"));
  }
  return absl::OkStatus();
}

// fcL.weight (out x in) and fcL.bias per layer, the last layer first, so that backward fills
// a growing prefix of the gradient (an MLP's names do not depend on its input and output
// widths). Every tensor decays (PyTorch's AdamW over model.parameters()); the model cuts its
// own pieces, in row blocks of the bucket size.
std::vector<TensorSize> MlpTensors(const v1::ModelSpec& model, int64_t features,
                                   int64_t classes) {
  std::vector<TensorSize> t;
  std::vector<int64_t> dims = {features};
  for (int w : model.mlp().hidden_widths()) dims.push_back(w);
  dims.push_back(classes);
  for (size_t l = dims.size() - 1; l >= 1; --l) {
    t.push_back({absl::StrCat("fc", l, ".weight"), dims[l - 1] * dims[l], {dims[l], dims[l - 1]}});
    t.push_back({absl::StrCat("fc", l, ".bias"), dims[l], {dims[l]}});
  }
  return t;
}

// The layers' widths, input first: the data set's features and classes (Fashion-MNIST's when
// not synthetic) around the hidden widths.
std::vector<int64_t> LayerWidths(const v1::JobSpec& spec) {
  std::vector<int64_t> dims;
  const bool synthetic = spec.dataset().type() == "synthetic";
  dims.push_back(synthetic ? spec.dataset().synthetic().input_dim() : 28 * 28);
  for (int width : spec.model().mlp().hidden_widths()) dims.push_back(width);
  dims.push_back(synthetic ? spec.dataset().synthetic().num_classes() : 10);
  return dims;
}

ModelMemoryTerms MlpMemory(const v1::JobSpec& spec, int64_t micro_batch) {
  ModelMemoryTerms m;
  const std::vector<int64_t> dims = LayerWidths(spec);
  int64_t widest = 0;
  m.per_sample = dims.front();  // the input row
  m.input = dims.front() + 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) {
    m.params += dims[i] * dims[i + 1] + dims[i + 1];
    widest = std::max(widest, dims[i + 1]);
    m.per_sample += 2 * dims[i + 1];  // pre-activation and activation (logits and their gradient)
  }
  m.per_sample += 2 * widest;  // backward's two temporaries (upstream and local gradient)
  m.trainable = m.params;
  // bf16 on a GPU: a product's two operands rounded into two scratch slots; either slot may
  // hold the largest activation or the largest weight (a sum, not a max, so the estimate stays
  // a line ChooseMicroBatch can solve).
  int64_t widest_rows = 0, largest_weight = 0;
  for (size_t i = 0; i + 1 < dims.size(); ++i) {
    widest_rows = std::max(widest_rows, micro_batch * std::max(dims[i], dims[i + 1]));
    largest_weight = std::max(largest_weight, dims[i] * dims[i + 1]);
  }
  m.gpu_bf16_bytes = 2 * 2 * (widest_rows + largest_weight);
  return m;
}

}  // namespace

// name, language_model, apply_defaults, validate, tensors, memory, validate_on_device
const ModelFamily kMlpFamily = {"mlp", false, MlpDefaults, ValidateMlp, MlpTensors, MlpMemory,
                                nullptr};

}  // namespace lockstep
