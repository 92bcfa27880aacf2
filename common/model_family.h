// Model families: what every part of the system knows about one kind of model (the MLP, the
// GPT), in one place per family (common/models/NAME.cc), looked up by the spec's model.type.
// The coordinator validates and sizes a spec through it, the CLI asks whether a job is a
// language model, the worker's models lay out their buffers from its tensors.
//
// Adding a family: its fields in proto/lockstep/v1/job.proto, a common/models/ file defining
// its ModelFamily (defaults, validation, tensor layout), one line in ModelFamilies(), its
// memory terms in common/job_memory.cc, a host model in worker/model/ (registered in
// worker/model/model.cc), and for GPU workers a device model in worker/cuda/ with its kernels
// (docs/architecture.md, "Adding a model").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/model_layout.h"
#include "lockstep/v1/job.pb.h"

namespace lockstep {

struct ModelFamily {
  const char* name;  // model.type
  // Trains on token data (text, tokens) and can write a sample of text.
  bool language_model = false;
  // Fills the family's defaults into the spec's model (before validation).
  void (*apply_defaults)(v1::ModelSpec& model) = nullptr;
  // The family's own fields: INVALID_ARGUMENT naming the field ("model.n_head: ...").
  absl::Status (*validate)(const v1::ModelSpec& model) = nullptr;
  // The tensors, names and sizes in buffer order. `features`, `classes`: a classifier's input
  // and output widths (unused by language models).
  std::vector<TensorSize> (*tensors)(const v1::ModelSpec& model, int64_t features,
                                     int64_t classes) = nullptr;
};

// Every family this build knows, in the order error messages list them.
const std::vector<const ModelFamily*>& ModelFamilies();
// The family of model.type `name`; null when there is none.
const ModelFamily* FindModelFamily(absl::string_view name);
// "mlp, gpt": for error messages.
std::string ModelFamilyNames();
// Whether `model` is of a language-model family (false for an unknown type).
bool IsLanguageModel(const v1::ModelSpec& model);

// The families (common/models/*.cc).
extern const ModelFamily kMlpFamily;
extern const ModelFamily kGptFamily;

}  // namespace lockstep
