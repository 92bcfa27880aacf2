// What the worker trains, whatever the model: parameters in one flat buffer of named tensors
// (the names are the export names), forward and backward over a micro-batch that reports
// gradient "ready points" in backward order (so gradient buckets can be summed while backward
// goes on), the loss and the evaluation metrics. The trainer, the step engines and the
// communicators see only this interface; a family's host model is added in CreateModel's table
// (worker/model/model.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_layout.h"
#include "lockstep/v1/job.pb.h"
#include "lockstep/v1/model.pb.h"

namespace lockstep::worker {

// One named tensor of the flat parameter buffer.
struct Tensor {
  std::string name;            // export name, e.g. "fc1.weight"
  std::vector<int64_t> shape;  // row-major
  size_t offset = 0;           // in floats
  size_t count = 0;
  // Weight decay applies to it (the model's convention: the MLP decays every tensor, as
  // PyTorch's AdamW over model.parameters() does; the GPT its matrices, and its embeddings
  // only with optimizer.decay_embeddings).
  bool decay = true;
  bool embedding = false;
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
//
// Gradients: the gradient buffer holds the trainable tensors only (model.frozen_parameters
// take no room in it), in buffer order, followed by one slot for the loss; offsets into it
// are "gradient offsets". Without frozen tensors they equal parameter offsets.
class Model {
 public:
  virtual ~Model() = default;

  virtual size_t num_params() const = 0;
  // Every parameter in exactly one tensor, in buffer order.
  virtual const std::vector<Tensor>& tensors() const = 0;
  virtual float* params() = 0;
  virtual const float* params() const = 0;

  // Freezes the tensors whose names match any of `patterns` (globs: * any run, ? one
  // character): they get no gradient and no optimizer state. INVALID_ARGUMENT naming a pattern
  // that matches no tensor, or when nothing would be left to train. Before training.
  absl::Status Freeze(const std::vector<std::string>& patterns);
  bool frozen(size_t tensor) const { return frozen_[tensor]; }
  size_t num_frozen_params() const { return num_params() - num_grads_; }
  // The gradient buffer: num_grads() values, then the loss slot (reduced with the last bucket).
  size_t num_grads() const { return num_grads_; }
  float* grads() { return grads_.data(); }
  float& loss_slot() { return grads_[num_grads_]; }
  // The trainable ranges (consecutive trainable tensors of the same kind merged): where they
  // sit in the parameters and in the gradient buffer, which is also where their optimizer
  // state sits.
  struct Segment {
    size_t param_offset = 0;
    size_t grad_offset = 0;
    size_t count = 0;
    bool decay = true;
    bool embedding = false;
  };
  const std::vector<Segment>& segments() const { return segments_; }

  // Deterministic from the seed.
  virtual void Initialize(uint64_t seed) = 0;
  // Forward and backward on `batch`: writes grad_scale * d(sum of sample losses)/d(params)
  // into grads() (overwriting, or with `accumulate` adding: gradient accumulation) and returns
  // the sum of the sample losses. on_loss(loss_sum) runs after the forward pass. The gradient
  // is produced as a growing prefix of grads(); after each piece on_ready(end) reports that
  // grads()[0, end) is final. The sequence of `end` values is ReadyPoints(chunk_floats): pieces
  // of about chunk_floats values where the model can cut them.
  virtual double ForwardBackward(const Batch& batch, float grad_scale, size_t chunk_floats,
                                 const std::function<void(double)>& on_loss,
                                 const std::function<void(size_t)>& on_ready,
                                 bool accumulate = false) = 0;
  // In gradient offsets, ascending, the last one num_grads().
  std::vector<size_t> ReadyPoints(size_t chunk_floats) const;
  // Forward only: returns the loss sum and adds the number of correct predictions.
  virtual double Evaluate(const Batch& batch, int64_t* correct) = 0;
  // Language models: the logits of the token after `tokens` (the last context_length of them
  // are read); UNIMPLEMENTED for models that do not generate.
  virtual absl::StatusOr<std::vector<float>> NextTokenLogits(const std::vector<int32_t>& tokens);

  // The architecture and its shapes ("mlp/relu/784/512/10"): what a checkpoint of this model
  // must match.
  virtual std::string Describe() const = 0;
  // The model's configuration as the config.json of an export (the GPT: Hugging Face's GPT-2
  // configuration).
  virtual std::string ConfigJson() const = 0;

 protected:
  // The models' side of the layout. A subclass calls LayOutGradients once its tensors exist.
  void LayOutGradients();
  // The ready points in parameter offsets (each the end of a piece of backward).
  virtual std::vector<size_t> ParamReadyPoints(size_t chunk_floats) const = 0;
  // Where the gradient of the tensor starting at `param_offset` lives; nullptr when frozen.
  float* GradFor(size_t param_offset);
  // The gradient offset matching parameter offset `param_offset` (a frozen tensor's values
  // map to where the next trainable one starts).
  size_t GradOffset(size_t param_offset) const;
  // Reports the end of a backward piece, given in parameter offsets, as a gradient offset;
  // pieces that add nothing (frozen) are not reported.
  class ReadyReporter {
   public:
    ReadyReporter(const Model& model, const std::function<void(size_t)>& on_ready)
        : model_(model), on_ready_(on_ready) {}
    void operator()(size_t param_end);

   private:
    const Model& model_;
    const std::function<void(size_t)>& on_ready_;
    size_t last_ = 0;
  };

 private:
  std::vector<bool> frozen_;
  std::vector<size_t> grad_offsets_;  // per tensor (frozen: where the next trainable starts)
  std::vector<Segment> segments_;
  size_t num_grads_ = 0;
  std::vector<float> grads_;
};

// A family's layout (common/model_layout.h: ModelTensors) as a model's tensors, each at its
// offset in the flat buffer, in order; sets *num_params. The one place a host model's buffer is
// laid out.
std::vector<Tensor> LayOutTensors(const std::vector<TensorSize>& layout, size_t* num_params);

// What an export or a checkpoint records of `model`: its architecture, tensors and config.
v1::ModelManifest Manifest(const Model& model);

// The shape of a job's data, as the model needs it.
struct DataShape {
  int32_t features = 0;  // classifiers: values per sample
  int32_t classes = 0;
};

// The model `spec` names, for data of `shape`, with spec.frozen_parameters frozen.
// INVALID_ARGUMENT naming the field.
absl::StatusOr<std::unique_ptr<Model>> CreateModel(const v1::ModelSpec& spec,
                                                   const DataShape& shape);

// A family's host model for a spec its family validated (common/model_family.h).
using HostModelFactory = absl::StatusOr<std::unique_ptr<Model>> (*)(const v1::ModelSpec& spec,
                                                                     const DataShape& shape);
// The families' host models (worker/model/mlp.cc, gpt.cc).
absl::StatusOr<std::unique_ptr<Model>> CreateMlp(const v1::ModelSpec& spec,
                                                 const DataShape& shape);
absl::StatusOr<std::unique_ptr<Model>> CreateGpt(const v1::ModelSpec& spec,
                                                 const DataShape& shape);

}  // namespace lockstep::worker
