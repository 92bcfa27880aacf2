// The models a job can name. A new model is one more branch here.
#include "worker/train/model.h"

#include "absl/strings/str_cat.h"
#include "kernels/cpu_kernels.h"
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
  return absl::InvalidArgumentError(absl::StrCat("model.type: unknown model \"", spec.type(), "\""));
}

}  // namespace lockstep::worker
