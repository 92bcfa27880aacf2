#include "common/model_layout.h"

#include <fnmatch.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/model_family.h"

namespace lockstep {

std::vector<TensorSize> ModelTensors(const v1::ModelSpec& model, int64_t features, int64_t classes) {
  const ModelFamily* family = FindModelFamily(model.type());
  return family != nullptr ? family->tensors(model, features, classes) : std::vector<TensorSize>{};
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
