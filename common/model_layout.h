// The tensors a model spec implies (names, shapes and sizes, in buffer order), computed from
// the spec alone by its family (common/model_family.h): the one layout of a family's flat
// parameter buffer. The coordinator checks frozen_parameters against it and sizes memory with
// it; the worker's host models lay out their buffers from it (worker/model/model.h,
// LayOutTensors), and the device models take the host's layout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lockstep/v1/job.pb.h"

namespace lockstep {

struct TensorSize {
  std::string name;  // the export name, e.g. "h.0.attn.c_attn.weight"
  int64_t count = 0;
  std::vector<int64_t> shape;  // row-major; its product is count
  // Weight decay applies to it (the family's convention); it is an embedding table.
  bool decay = true;
  bool embedding = false;
  // Backward finishes a piece of the gradient with it: a ready point after it (a family whose
  // pieces depend on the bucket size, the MLP, sets none and cuts its own).
  bool ends_piece = false;
};

// `features` and `classes`: an MLP's input and output widths (unused for the GPT). Empty for a
// model.type no family has.
std::vector<TensorSize> ModelTensors(const v1::ModelSpec& model, int64_t features, int64_t classes);

// The tensors matching any of `patterns` (globs: * any run, ? one character), and
// INVALID_ARGUMENT naming the first pattern that matches none (or when all would be frozen).
absl::StatusOr<std::vector<bool>> MatchFrozen(const std::vector<TensorSize>& tensors,
                                              const std::vector<std::string>& patterns);

}  // namespace lockstep
