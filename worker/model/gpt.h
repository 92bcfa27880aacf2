// A GPT-2-style decoder on the CPU: token and learned position embeddings, n_layer pre-LayerNorm
// blocks (causal multi-head self-attention, a 4x MLP with the tanh GELU), a final LayerNorm and
// an LM head tied to the token embedding. A sample is a window of context + 1 tokens: the model
// reads the first `context` and predicts each next one; a sample's loss is the mean
// cross-entropy over its `context` predictions.
//
// Tensors carry GPT-2's (Hugging Face GPT2Model) names and layouts, e.g. "h.0.attn.c_attn.weight"
// of shape [d_model, 3 d_model] (Conv1D: [in, out]), so an export loads as it is. The flat buffer
// holds them in backward order (ln_f, the blocks from the last to the first, wpe, then wte,
// whose gradient is final only after the embedding's share at the very end), so the gradient
// backward fills is a growing prefix.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "worker/model/model.h"

namespace lockstep::worker {

struct GptConfig {
  int vocab = 0;
  int context = 0;  // tokens a sample reads (its window holds context + 1)
  int layers = 0;
  int heads = 0;
  int d_model = 0;
};

// Not thread-safe.
class Gpt final : public Model {
 public:
  explicit Gpt(const GptConfig& config);

  const GptConfig& config() const { return config_; }
  size_t num_params() const override { return num_params_; }
  const std::vector<Tensor>& tensors() const override { return tensors_; }
  float* params() override { return params_.data(); }
  const float* params() const override { return params_.data(); }

  // GPT-2's initialisation: weights ~ N(0, 0.02), the residual projections (attn.c_proj, mlp.c_proj)
  // ~ N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm weights 1.
  void Initialize(uint64_t seed) override;
  double ForwardBackward(const Batch& batch, float grad_scale, size_t chunk_floats,
                         const std::function<void(double)>& on_loss,
                         const std::function<void(size_t)>& on_ready,
                         bool accumulate = false) override;
  // The loss sum over samples (each the mean over its predictions); *correct counts the
  // predicted tokens that were the next token.
  double Evaluate(const Batch& batch, int64_t* correct) override;
  std::string Describe() const override;
  // Hugging Face's GPT2Config for this model (gelu_new is the tanh GELU).
  std::string ConfigJson() const override;

  // The logits of the next token after the last `context` of `tokens` (at least one).
  absl::StatusOr<std::vector<float>> NextTokenLogits(const std::vector<int32_t>& tokens) override;

  // Where the tensors start in the flat buffer (floats), for the device twin (GpuGpt), and the
  // ends of the pieces backward finishes, in order.
  struct Block {  // offsets (floats) of one block's tensors
    size_t ln1_w, ln1_b, attn_w, attn_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, fcproj_w,
        fcproj_b;
  };
  struct Layout {
    size_t lnf_w, lnf_b, wpe, wte;
    std::vector<Block> blocks;  // by layer
  };
  Layout layout() const { return {lnf_w_, lnf_b_, wpe_, wte_, blocks_}; }
  const std::vector<size_t>& ready_points() const { return ready_points_; }

 protected:
  std::vector<size_t> ParamReadyPoints(size_t) const override { return ready_points_; }

 private:
  // Runs the forward pass over n samples of the batch (its first `context` tokens read,
  // `t` positions each), keeping what backward needs; returns lnf's output rows in lnf_.
  void Forward(const int32_t* tokens, int token_stride, int n, int t);
  // The LM head over the rows of lnf_: logits, then in place the loss's gradient scaled by
  // `scale` (0: loss only); returns the loss sum over all rows. With `dlnf`, also the head's
  // backward: dlnf_ = dlogits . wte, and wte's gradient += dlogits^T . lnf.
  double Head(const int32_t* tokens, int token_stride, int n, int t, float scale, bool backward,
              int64_t* correct);
  void Reserve(int rows, int n);

  GptConfig config_;
  std::vector<Tensor> tensors_;
  size_t num_params_ = 0;
  size_t lnf_w_ = 0, lnf_b_ = 0, wpe_ = 0, wte_ = 0;
  std::vector<Block> blocks_;
  std::vector<size_t> ready_points_;
  std::vector<float> params_;

  // Activations for backward, sized for `capacity_rows_` rows (n * t).
  int capacity_rows_ = 0;
  int capacity_n_ = 0;
  std::vector<std::vector<float>> resid_;  // layers + 1: the residual stream entering each block
  std::vector<std::vector<float>> ln1_, ln1_mean_, ln1_rstd_, qkv_, atty_, lse_, mid_, ln2_,
      ln2_mean_, ln2_rstd_, fch_, fch_gelu_;
  std::vector<float> lnf_, lnf_mean_, lnf_rstd_;
  std::vector<float> logits_;  // one chunk of rows of the LM head
  std::vector<float> scratch_, scratch4_, dresid_, dmid_, dqkv_, dlnf_;
  std::vector<int32_t> targets_;
};

}  // namespace lockstep::worker
