#include "common/model_family.h"

#include "absl/strings/str_join.h"

namespace lockstep {

const std::vector<const ModelFamily*>& ModelFamilies() {
  static const std::vector<const ModelFamily*> families = {&kMlpFamily, &kGptFamily};
  return families;
}

const ModelFamily* FindModelFamily(absl::string_view name) {
  for (const ModelFamily* family : ModelFamilies()) {
    if (name == family->name) return family;
  }
  return nullptr;
}

std::string ModelFamilyNames() {
  return absl::StrJoin(ModelFamilies(), ", ", [](std::string* out, const ModelFamily* f) {
    out->append(f->name);
  });
}

bool IsLanguageModel(const v1::ModelSpec& model) {
  const ModelFamily* family = FindModelFamily(model.type());
  return family != nullptr && family->language_model;
}

}  // namespace lockstep
