// Model families: what every part of the system knows about one kind of model (the MLP, the
// GPT), in one place per family (common/models/NAME.cc), looked up by the spec's model.type.
// A spec's model is one family's message (ModelSpec's `family` oneof, model.mlp or model.gpt)
// and model.type its name, which NormalizeModelSpec fills in.
// The coordinator validates and sizes a spec through it, the CLI asks whether a job is a
// language model, the worker's models lay out their buffers from its tensors.
//
// Adding a family: its message in proto/lockstep/v1/job.proto (a case of ModelSpec's `family`
// named as the family), a common/models/ file defining
// its ModelFamily (defaults, validation, tensor layout, memory terms), one line in
// ModelFamilies(), a host model in worker/model/ (registered in
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

// A family's terms of the per-worker memory estimate (common/job_memory.cc adds them up with
// the optimizer's, the communication's and the GPU's own), in float32 values unless said.
struct ModelMemoryTerms {
  int64_t params = 0;
  int64_t trainable = 0;   // params less the frozen tensors'
  int64_t per_sample = 0;  // activations and backward temporaries per sample
  int64_t fixed = 0;       // a CPU worker's working memory whatever the micro-batch
  int64_t input = 0;       // one sample's input (features and label, or its tokens)
  int64_t bf16_values = 0;  // of per_sample, what a GPU keeps in bfloat16 under "bf16"
  // GPU workers: the LM head's chunk of logits for the micro-batch (values), and the bytes of
  // the bfloat16 copies the products need under "bf16".
  int64_t gpu_head_values = 0;
  int64_t gpu_bf16_bytes = 0;
};

// What a language model's samples are: token ids in [0, vocab), windows of context tokens.
struct TokenShape {
  int32_t vocab = 0;
  int32_t context = 0;
};

struct ModelFamily {
  const char* name;  // model.type, and the name of its case of ModelSpec's `family`
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
  // Its memory for `spec` (after ApplyJobSpecDefaults) with `micro_batch` samples at once.
  ModelMemoryTerms (*memory)(const v1::JobSpec& spec, int64_t micro_batch) = nullptr;
  // What the spec's device cannot train of a valid model (null: it trains all of it):
  // INVALID_ARGUMENT naming the field.
  absl::Status (*validate_on_device)(const v1::JobSpec& spec) = nullptr;
  // Language models: their token shape.
  TokenShape (*tokens_of)(const v1::ModelSpec& model) = nullptr;
};

// Every family this build knows, in the order error messages list them.
const std::vector<const ModelFamily*>& ModelFamilies();
// The family of model.type `name`; null when there is none.
const ModelFamily* FindModelFamily(absl::string_view name);
// "mlp, gpt": for error messages.
std::string ModelFamilyNames();
// Whether `model` is of a language-model family (false for an unknown type).
bool IsLanguageModel(const v1::ModelSpec& model);
// A language model's token shape (zeros for other models).
TokenShape TokenShapeOf(const v1::ModelSpec& model);

// The canonical form of a model: the family's message set, and model.type its name. A spec of
// the form before the family messages (model.type naming the family, its fields at the top of
// ModelSpec: saved jobs and old JSON) gets its fields moved into the family's message; a spec
// with only the family's message gets model.type. What cannot be told is left as it is for
// ValidateModelForm to name. Idempotent.
void NormalizeModelSpec(v1::ModelSpec& model);
// After NormalizeModelSpec: INVALID_ARGUMENT naming the field when model.type and the family's
// message disagree, or a field of the old form is left (set beside a family's message, or not
// a field of the family). OK for an unknown or empty type (the caller names that).
absl::Status ValidateModelForm(const v1::ModelSpec& model);

// The families (common/models/*.cc).
extern const ModelFamily kMlpFamily;
extern const ModelFamily kGptFamily;

}  // namespace lockstep
