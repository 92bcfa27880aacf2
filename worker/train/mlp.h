// A multilayer perceptron classifier with explicit forward and backward passes over flat
// parameter and gradient buffers, so gradient buckets are plain contiguous ranges.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/cpu_kernels.h"

namespace lockstep::worker {

// Not thread-safe.
class Mlp {
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
  int num_layers() const { return static_cast<int>(layers_.size()); }
  const LayerSlice& layer(int l) const { return layers_[l]; }
  size_t num_params() const { return num_params_; }
  const std::vector<int>& dims() const { return dims_; }
  kernels::Activation activation() const { return activation_; }

  float* params() { return params_.data(); }
  const float* params() const { return params_.data(); }
  // num_params() + 1 floats: the extra slot after the gradients carries the loss so that it
  // is reduced together with the last bucket.
  float* grads() { return grads_.data(); }
  float& loss_slot() { return grads_[num_params_]; }

  // PyTorch's nn.Linear default: weights and biases ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  void Initialize(uint64_t seed);

  // Forward and backward on n samples. Writes grad_scale * d(sum of sample losses)/d(params)
  // into grads() (overwriting, or with `accumulate` adding to what is there: gradient
  // accumulation over micro-batches) and returns the sum of the sample losses. on_loss(loss_sum) is
  // called after the forward pass. Gradients are produced as a growing prefix of grads(): a
  // layer's weight rows in chunks of about `chunk_floats` values, then its bias, last layer
  // first; after each piece on_ready(end) reports that grads()[0, end) is final. The sequence
  // of `end` values is ReadyPoints(chunk_floats).
  double ForwardBackward(const float* x, const int32_t* y, int n, float grad_scale,
                         size_t chunk_floats, const std::function<void(double)>& on_loss,
                         const std::function<void(size_t)>& on_ready, bool accumulate = false);
  std::vector<size_t> ReadyPoints(size_t chunk_floats) const;

  // Forward only: returns the loss sum and adds the number of correct predictions.
  double Evaluate(const float* x, const int32_t* y, int n, int64_t* correct);

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
  size_t num_params_ = 0;
  std::vector<float> params_;
  std::vector<float> grads_;
  int capacity_ = 0;
  std::vector<std::vector<float>> z_;  // per layer: n x out, pre-activation
  std::vector<std::vector<float>> a_;  // per hidden layer: n x out, activation
  std::vector<float> dz_, da_;         // scratch: n x max width
};

}  // namespace lockstep::worker
