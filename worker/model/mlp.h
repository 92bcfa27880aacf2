// A multilayer perceptron classifier with explicit forward and backward passes over flat
// parameter and gradient buffers, so gradient buckets are plain contiguous ranges.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/cpu_kernels.h"
#include "worker/model/model.h"

namespace lockstep::worker {

// Not thread-safe. Tensors are named as PyTorch names a stack of nn.Linear layers fc1, fc2, ...
// ("fc1.weight" of shape [out, in], "fc1.bias"), so an export loads into such a module.
class Mlp final : public Model {
 public:
  // dims = {input, hidden..., classes}; at least {input, classes}.
  Mlp(std::vector<int> dims, kernels::Activation activation);

  // Where layer l's weights (out x in, row-major) and bias live in the flat buffers. Layers are
  // stored last layer first, so the gradient filled by backward is a growing prefix.
  struct LayerSlice {
    size_t offset = 0;  // of the weights; the bias follows them
    size_t count = 0;   // weights + bias
    int in = 0;
    int out = 0;
  };
  // The layout for `dims` (shared with the GPU model, so parameters move between them as is);
  // sets *num_params.
  static std::vector<LayerSlice> Layout(const std::vector<int>& dims, size_t* num_params);
  // The sizes of ForwardBackward's gradient pieces, in order (see ForwardBackward).
  static int RowsPerChunk(const LayerSlice& layer, size_t chunk_floats);
  // ReadyPoints of a model with this layout (the GPU model shares it).
  static std::vector<size_t> LayoutReadyPoints(const std::vector<LayerSlice>& layers,
                                               size_t chunk_floats);
  int num_layers() const { return static_cast<int>(layers_.size()); }
  const LayerSlice& layer(int l) const { return layers_[l]; }
  size_t num_params() const override { return num_params_; }
  const std::vector<Tensor>& tensors() const override { return tensors_; }
  const std::vector<int>& dims() const { return dims_; }
  kernels::Activation activation() const { return activation_; }

  float* params() override { return params_.data(); }
  const float* params() const override { return params_.data(); }

  // PyTorch's nn.Linear default: weights and biases ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  void Initialize(uint64_t seed) override;

  // Forward and backward on n samples. Writes grad_scale * d(sum of sample losses)/d(params)
  // into grads() (overwriting, or with `accumulate` adding to what is there: gradient
  // accumulation over micro-batches) and returns the sum of the sample losses. on_loss(loss_sum) is
  // called after the forward pass. Gradients are produced as a growing prefix of grads(): a
  // layer's weight rows in chunks of about `chunk_floats` values, then its bias, last layer
  // first; after each piece on_ready(end) reports that grads()[0, end) is final (frozen tensors
  // are skipped). The sequence of `end` values is ReadyPoints(chunk_floats).
  double ForwardBackward(const float* x, const int32_t* y, int n, float grad_scale,
                         size_t chunk_floats, const std::function<void(double)>& on_loss,
                         const std::function<void(size_t)>& on_ready, bool accumulate = false);

  // Forward only: returns the loss sum and adds the number of correct predictions.
  double Evaluate(const float* x, const int32_t* y, int n, int64_t* correct);

  // Model, over a batch of features and labels.
  double ForwardBackward(const Batch& batch, float grad_scale, size_t chunk_floats,
                         const std::function<void(double)>& on_loss,
                         const std::function<void(size_t)>& on_ready,
                         bool accumulate = false) override {
    return ForwardBackward(batch.features, batch.labels, batch.n, grad_scale, chunk_floats, on_loss,
                           on_ready, accumulate);
  }
  double Evaluate(const Batch& batch, int64_t* correct) override {
    return Evaluate(batch.features, batch.labels, batch.n, correct);
  }
  std::string Describe() const override;
  std::string ConfigJson() const override;

 protected:
  std::vector<size_t> ParamReadyPoints(size_t chunk_floats) const override {
    return LayoutReadyPoints(layers_, chunk_floats);
  }

 private:
  // Runs the forward pass, leaving pre-activations in z_ and activations in a_.
  void Forward(const float* x, int n);
  void Reserve(int n);
  int RowsPerChunk(int l, size_t chunk_floats) const {
    return RowsPerChunk(layers_[l], chunk_floats);
  }

  std::vector<int> dims_;
  kernels::Activation activation_;
  std::vector<LayerSlice> layers_;
  std::vector<Tensor> tensors_;
  size_t num_params_ = 0;
  std::vector<float> params_;
  int capacity_ = 0;
  std::vector<std::vector<float>> z_;  // per layer: n x out, pre-activation
  std::vector<std::vector<float>> a_;  // per hidden layer: n x out, activation
  std::vector<float> dz_, da_;         // scratch: n x max width
};

}  // namespace lockstep::worker
