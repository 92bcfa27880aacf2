#include "common/model_family.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/message.h"

namespace lockstep {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

const google::protobuf::OneofDescriptor& FamilyOneof() {
  return *v1::ModelSpec::descriptor()->FindOneofByName("family");
}

// The fields of the form before the family messages: ModelSpec's deprecated ones.
const std::vector<const FieldDescriptor*>& OldFormFields() {
  static const std::vector<const FieldDescriptor*> fields = [] {
    std::vector<const FieldDescriptor*> out;
    const google::protobuf::Descriptor* d = v1::ModelSpec::descriptor();
    for (int i = 0; i < d->field_count(); ++i) {
      if (d->field(i)->options().deprecated()) out.push_back(d->field(i));
    }
    return out;
  }();
  return fields;
}

bool IsSet(const Message& m, const FieldDescriptor* f) {
  const Reflection* r = m.GetReflection();
  return f->is_repeated() ? r->FieldSize(m, f) > 0 : r->HasField(m, f);
}

// The family message's field that old-form field `old` becomes (the same name and type);
// null when the family has none.
const FieldDescriptor* NewFormField(const FieldDescriptor* family, const FieldDescriptor* old) {
  const FieldDescriptor* f = family->message_type()->FindFieldByName(old->name());
  if (f == nullptr || f->cpp_type() != old->cpp_type() || f->is_repeated() != old->is_repeated()) {
    return nullptr;
  }
  return f;
}

// Moves `from` of `model` into `to` of `into` (int32 and string fields: the old form's kinds).
void MoveField(v1::ModelSpec& model, const FieldDescriptor* from, Message& into,
               const FieldDescriptor* to) {
  const Reflection* r = model.GetReflection();
  const Reflection* t = into.GetReflection();
  if (from->is_repeated()) {
    for (int i = 0; i < r->FieldSize(model, from); ++i) {
      if (from->cpp_type() == FieldDescriptor::CPPTYPE_INT32) {
        t->AddInt32(&into, to, r->GetRepeatedInt32(model, from, i));
      } else if (from->cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
        t->AddString(&into, to, r->GetRepeatedString(model, from, i));
      } else {
        return;  // another kind: left for ValidateModelForm to name
      }
    }
  } else if (from->cpp_type() == FieldDescriptor::CPPTYPE_INT32) {
    t->SetInt32(&into, to, r->GetInt32(model, from));
  } else if (from->cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
    t->SetString(&into, to, r->GetString(model, from));
  } else {
    return;
  }
  r->ClearField(&model, from);
}

}  // namespace

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

TokenShape TokenShapeOf(const v1::ModelSpec& model) {
  const ModelFamily* family = FindModelFamily(model.type());
  if (family == nullptr || family->tokens_of == nullptr) return {};
  return family->tokens_of(model);
}

void NormalizeModelSpec(v1::ModelSpec& model) {
  const Reflection* r = model.GetReflection();
  if (const FieldDescriptor* set = r->GetOneofFieldDescriptor(model, &FamilyOneof())) {
    if (model.type().empty()) model.set_type(set->name());
    return;
  }
  const FieldDescriptor* family = v1::ModelSpec::descriptor()->FindFieldByName(model.type());
  if (family == nullptr || family->containing_oneof() != &FamilyOneof()) return;
  Message* into = r->MutableMessage(&model, family);  // set, even with no field of its own
  for (const FieldDescriptor* old : OldFormFields()) {
    if (!IsSet(model, old)) continue;
    if (const FieldDescriptor* to = NewFormField(family, old); to != nullptr) {
      MoveField(model, old, *into, to);
    }
  }
}

absl::Status ValidateModelForm(const v1::ModelSpec& model) {
  const FieldDescriptor* set = model.GetReflection()->GetOneofFieldDescriptor(model, &FamilyOneof());
  if (set != nullptr && model.type() != set->name()) {
    return absl::InvalidArgumentError(absl::StrCat("model.type: \"", model.type(),
                                                   "\", but the model's fields are in model.",
                                                   set->name()));
  }
  if (set == nullptr) return absl::OkStatus();  // no family: the caller names the type
  for (const FieldDescriptor* old : OldFormFields()) {
    if (!IsSet(model, old)) continue;
    return absl::InvalidArgumentError(
        NewFormField(set, old) != nullptr
            ? absl::StrCat("model.", old->name(), ": set it in model.", set->name(),
                           " (with a family's message, its fields are all there)")
            : absl::StrCat("model.", old->name(), ": not a field of the ", set->name(),
                           " family"));
  }
  return absl::OkStatus();
}

}  // namespace lockstep
