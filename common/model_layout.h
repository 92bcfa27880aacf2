// The tensors a model spec implies (names and sizes, in buffer order), computed from the spec
// alone by its family (common/model_family.h): what the coordinator checks frozen_parameters
// against and sizes memory with. The worker's models lay out the same tensors
// (tests/unit/model_test.cc holds them to it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lockstep/v1/job.pb.h"

namespace lockstep {

struct TensorSize {
  std::string name;
  int64_t count = 0;
};

// `features` and `classes`: an MLP's input and output widths (unused for the GPT). Empty for a
// model.type no family has.
std::vector<TensorSize> ModelTensors(const v1::ModelSpec& model, int64_t features, int64_t classes);

// The tensors matching any of `patterns` (globs: * any run, ? one character), and
// INVALID_ARGUMENT naming the first pattern that matches none (or when all would be frozen).
absl::StatusOr<std::vector<bool>> MatchFrozen(const std::vector<TensorSize>& tensors,
                                              const std::vector<std::string>& patterns);

}  // namespace lockstep
