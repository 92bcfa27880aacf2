// What the worker trains, whatever the model: parameters in one flat buffer of named tensors
// (the names are the export names), forward and backward over a micro-batch that reports
// gradient "ready points" in backward order (so gradient buckets can be summed while backward
// goes on), the loss and the evaluation metrics. The trainer, the step engines and the
// communicators see only this interface; a model is added in CreateModel.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lockstep/v1/job.pb.h"

namespace lockstep::worker {

// One named tensor of the flat parameter buffer (and of the gradient buffer, at the same
// offset).
struct Tensor {
  std::string name;            // export name, e.g. "fc1.weight"
  std::vector<int64_t> shape;  // row-major
  size_t offset = 0;           // in floats
  size_t count = 0;
};

// A micro-batch in host memory. A model reads the fields of its kind of input: a classifier
// `features` (n rows of `feature_stride` floats) and `labels`; a language model `tokens` (n rows
// of `token_stride` token ids).
struct Batch {
  int n = 0;
  const float* features = nullptr;
  int feature_stride = 0;
  const int32_t* labels = nullptr;
  const int32_t* tokens = nullptr;
  int token_stride = 0;
  // Samples [first, first + count) of this batch.
  Batch Slice(int first, int count) const {
    Batch b = *this;
    b.n = count;
    if (features != nullptr) b.features += static_cast<size_t>(first) * feature_stride;
    if (labels != nullptr) b.labels += first;
    if (tokens != nullptr) b.tokens += static_cast<size_t>(first) * token_stride;
    return b;
  }
};

// Not thread-safe.
class Model {
 public:
  virtual ~Model() = default;

  virtual size_t num_params() const = 0;
  // Every parameter in exactly one tensor, in buffer order.
  virtual const std::vector<Tensor>& tensors() const = 0;
  virtual float* params() = 0;
  virtual const float* params() const = 0;
  // num_params() + 1 floats: the slot after the gradients carries the loss so that it is
  // reduced together with the last bucket.
  virtual float* grads() = 0;
  float& loss_slot() { return grads()[num_params()]; }

  // Deterministic from the seed.
  virtual void Initialize(uint64_t seed) = 0;
  // Forward and backward on `batch`: writes grad_scale * d(sum of sample losses)/d(params) into
  // grads() (overwriting, or with `accumulate` adding: gradient accumulation) and returns the
  // sum of the sample losses. on_loss(loss_sum) runs after the forward pass. The gradient is
  // produced as a growing prefix of grads(); after each piece on_ready(end) reports that
  // grads()[0, end) is final. The sequence of `end` values is ReadyPoints(chunk_floats): pieces
  // of about chunk_floats values where the model can cut them.
  virtual double ForwardBackward(const Batch& batch, float grad_scale, size_t chunk_floats,
                                 const std::function<void(double)>& on_loss,
                                 const std::function<void(size_t)>& on_ready,
                                 bool accumulate = false) = 0;
  virtual std::vector<size_t> ReadyPoints(size_t chunk_floats) const = 0;
  // Forward only: returns the loss sum and adds the number of correct predictions.
  virtual double Evaluate(const Batch& batch, int64_t* correct) = 0;

  // The architecture and its shapes ("mlp/relu/784/512/10"): what a checkpoint of this model
  // must match.
  virtual std::string Describe() const = 0;
};

// The shape of a job's data, as the model needs it.
struct DataShape {
  int32_t features = 0;  // classifiers: values per sample
  int32_t classes = 0;
};

// The model `spec` names, for data of `shape`. INVALID_ARGUMENT naming the field.
absl::StatusOr<std::unique_ptr<Model>> CreateModel(const v1::ModelSpec& spec,
                                                   const DataShape& shape);

}  // namespace lockstep::worker
