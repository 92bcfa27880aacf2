// The models a job can name. A new model is one more branch here.
#include "worker/train/model.h"

#include "absl/strings/str_cat.h"
#include "kernels/cpu_kernels.h"
#include "worker/train/gpt.h"
#include "worker/train/mlp.h"

namespace lockstep::worker {

absl::StatusOr<std::unique_ptr<Model>> CreateModel(const v1::ModelSpec& spec,
                                                   const DataShape& shape) {
  if (spec.type() == "mlp") {
    kernels::Activation activation;
    if (!kernels::ParseActivation(spec.activation(), &activation)) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.activation: unknown \"", spec.activation(), "\""));
    }
    std::vector<int> dims = {shape.features};
    for (int w : spec.hidden_widths()) dims.push_back(w);
    dims.push_back(shape.classes);
    return std::unique_ptr<Model>(new Mlp(std::move(dims), activation));
  }
  if (spec.type() == "gpt") {
    const std::pair<const char*, int> sizes[] = {{"vocab_size", spec.vocab_size()},
                                                 {"context_length", spec.context_length()},
                                                 {"n_layer", spec.n_layer()},
                                                 {"n_head", spec.n_head()},
                                                 {"d_model", spec.d_model()}};
    for (const auto& [field, value] : sizes) {
      if (value <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("model.", field, ": must be > 0, got ", value));
      }
    }
    if (spec.d_model() % spec.n_head() != 0) {
      return absl::InvalidArgumentError(absl::StrCat("model.d_model: ", spec.d_model(),
                                                     " is not divisible by n_head ",
                                                     spec.n_head()));
    }
    return std::unique_ptr<Model>(new Gpt({spec.vocab_size(), spec.context_length(),
                                           spec.n_layer(), spec.n_head(), spec.d_model()}));
  }
  return absl::InvalidArgumentError(absl::StrCat("model.type: unknown model \"", spec.type(), "\""));
}

}  // namespace lockstep::worker
