// Text from a trained language model: the prompt continued one token at a time, each drawn
// from the model's next-token distribution (temperature, top-k) with a seeded generator, so
// the same model, prompt and seed give the same sample everywhere.
#pragma once

#include "absl/status/statusor.h"
#include "lockstep/v1/job.pb.h"
#include "worker/model/model.h"

namespace lockstep::worker {

// `text`: the tokens are bytes of UTF-8 text (the prompt is spec.prompt; the result has text).
// Otherwise the prompt is spec.prompt_tokens. INVALID_ARGUMENT for a prompt token outside the
// vocabulary; UNIMPLEMENTED for a model that does not generate.
absl::StatusOr<v1::Sample> GenerateSample(Model& model, const v1::SampleSpec& spec, bool text);

}  // namespace lockstep::worker
