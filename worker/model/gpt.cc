// GPT forward and backward through the CPU kernels (kernels/cpu_transformer.h) and OpenBLAS.
#include "worker/model/gpt.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu_kernels.h"
#include "kernels/cpu_transformer.h"
#include "common/random.h"

namespace lockstep::worker {
namespace {

constexpr float kLayerNormEps = 1e-5f;
// The LM head runs over this many logits at a time (16 MiB), whatever the vocabulary: a large
// vocabulary's logits for the whole batch never exist at once.
constexpr size_t kHeadChunkValues = size_t{1} << 22;

void Add(const float* a, float* b, size_t n) {
  for (size_t i = 0; i < n; ++i) b[i] += a[i];
}

// out = residual + bias in every row (no residual: the bias), for a product to add onto.
void StartWith(const float* residual, const float* bias, int rows, int cols, float* out) {
  for (int r = 0; r < rows; ++r) {
    float* o = out + static_cast<size_t>(r) * cols;
    if (residual == nullptr) {
      std::copy(bias, bias + cols, o);
    } else {
      const float* x = residual + static_cast<size_t>(r) * cols;
      for (int j = 0; j < cols; ++j) o[j] = x[j] + bias[j];
    }
  }
}

// A weight's gradient dW (beta 1: added) = a^T . d over `rows`, unless the weight is frozen
// (dw null).
void WeightGradient(const float* a, int in, const float* d, int out, int rows, float beta,
                    float* dw) {
  if (dw != nullptr) kernels::Gemm(true, false, in, out, rows, 1.0f, a, in, d, out, beta, dw, out);
}

void BiasGrad(const float* d, int rows, int cols, float* db, bool accumulate) {
  if (db != nullptr) kernels::ColumnSums(d, rows, cols, db, accumulate);
}

}  // namespace

Gpt::Gpt(const GptConfig& config) : config_(config) {
  // The family's layout (common/models/gpt.cc), and where each of its tensors sits.
  v1::ModelSpec spec;
  spec.set_type("gpt");
  v1::GptSpec* g = spec.mutable_gpt();
  g->set_vocab_size(config.vocab);
  g->set_context_length(config.context);
  g->set_n_layer(config.layers);
  g->set_n_head(config.heads);
  g->set_d_model(config.d_model);
  const std::vector<TensorSize> layout = ModelTensors(spec, 0, 0);
  tensors_ = LayOutTensors(layout, &num_params_);
  absl::flat_hash_map<std::string, size_t> at;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    at[tensors_[i].name] = tensors_[i].offset;
    if (layout[i].ends_piece) ready_points_.push_back(tensors_[i].offset + tensors_[i].count);
  }
  lnf_w_ = at.at("ln_f.weight");
  lnf_b_ = at.at("ln_f.bias");
  blocks_.resize(config.layers);
  // Each block's tensors by their names within the block.
  static constexpr std::pair<size_t Block::*, const char*> kBlockTensors[] = {
      {&Block::fcproj_w, "mlp.c_proj.weight"}, {&Block::fcproj_b, "mlp.c_proj.bias"},
      {&Block::fc_w, "mlp.c_fc.weight"},       {&Block::fc_b, "mlp.c_fc.bias"},
      {&Block::ln2_w, "ln_2.weight"},          {&Block::ln2_b, "ln_2.bias"},
      {&Block::proj_w, "attn.c_proj.weight"},  {&Block::proj_b, "attn.c_proj.bias"},
      {&Block::attn_w, "attn.c_attn.weight"},  {&Block::attn_b, "attn.c_attn.bias"},
      {&Block::ln1_w, "ln_1.weight"},          {&Block::ln1_b, "ln_1.bias"}};
  for (int l = 0; l < config.layers; ++l) {
    for (const auto& [member, name] : kBlockTensors) {
      blocks_[l].*member = at.at(absl::StrCat("h.", l, ".", name));
    }
  }
  wpe_ = at.at("wpe.weight");
  wte_ = at.at("wte.weight");
  params_.assign(num_params_, 0.0f);
  LayOutGradients();
  const size_t L = static_cast<size_t>(config.layers);
  resid_.resize(L + 1);
  for (auto* v : {&ln1_, &ln1_mean_, &ln1_rstd_, &qkv_, &atty_, &lse_, &mid_, &ln2_, &ln2_mean_,
                  &ln2_rstd_, &fch_, &fch_gelu_}) {
    v->resize(L);
  }
}

std::string Gpt::Describe() const {
  return absl::StrCat("gpt/", config_.vocab, "/", config_.context, "/", config_.layers, "/",
                      config_.heads, "/", config_.d_model);
}

std::string Gpt::ConfigJson() const {
  return absl::StrCat(
      "{\n  \"architectures\": [\"GPT2LMHeadModel\"],\n  \"model_type\": \"gpt2\",\n"
      "  \"vocab_size\": ", config_.vocab, ",\n  \"n_positions\": ", config_.context,
      ",\n  \"n_ctx\": ", config_.context, ",\n  \"n_embd\": ", config_.d_model,
      ",\n  \"n_layer\": ", config_.layers, ",\n  \"n_head\": ", config_.heads,
      ",\n  \"n_inner\": null,\n  \"activation_function\": \"gelu_new\",\n"
      "  \"layer_norm_epsilon\": 1e-05,\n  \"initializer_range\": 0.02,\n"
      "  \"resid_pdrop\": 0.0,\n  \"embd_pdrop\": 0.0,\n  \"attn_pdrop\": 0.0,\n"
      "  \"tie_word_embeddings\": true,\n  \"torch_dtype\": \"float32\"\n}");
}

void Gpt::Initialize(uint64_t seed) {
  const double residual_std = 0.02 / std::sqrt(2.0 * config_.layers);
  for (size_t t = 0; t < tensors_.size(); ++t) {
    const Tensor& x = tensors_[t];
    float* p = params_.data() + x.offset;
    const bool layer_norm = x.name.find("ln_") != std::string::npos;
    const bool bias = x.name.size() > 5 && x.name.compare(x.name.size() - 5, 5, ".bias") == 0;
    if (bias) {
      std::fill(p, p + x.count, 0.0f);
    } else if (layer_norm) {
      std::fill(p, p + x.count, 1.0f);
    } else {
      const bool residual = x.name.find("c_proj.weight") != std::string::npos;
      const double std = residual ? residual_std : 0.02;
      SplitMix64 rng(MixSeed(seed, t + 1));
      for (size_t i = 0; i < x.count; ++i) p[i] = static_cast<float>(rng.Normal() * std);
    }
  }
}

void Gpt::Reserve(int rows, int n) {
  if (rows <= capacity_rows_ && n <= capacity_n_) return;
  capacity_rows_ = std::max(rows, capacity_rows_);
  capacity_n_ = std::max(n, capacity_n_);
  const size_t R = static_cast<size_t>(capacity_rows_), C = config_.d_model;
  for (auto& v : resid_) v.resize(R * C);
  for (int l = 0; l < config_.layers; ++l) {
    ln1_[l].resize(R * C);
    ln1_mean_[l].resize(R);
    ln1_rstd_[l].resize(R);
    qkv_[l].resize(R * 3 * C);
    atty_[l].resize(R * C);
    lse_[l].resize(R * config_.heads);
    mid_[l].resize(R * C);
    ln2_[l].resize(R * C);
    ln2_mean_[l].resize(R);
    ln2_rstd_[l].resize(R);
    fch_[l].resize(R * 4 * C);
    fch_gelu_[l].resize(R * 4 * C);
  }
  lnf_.resize(R * C);
  lnf_mean_.resize(R);
  lnf_rstd_.resize(R);
  scratch_.resize(R * C);
  scratch4_.resize(R * 4 * C);
  dresid_.resize(R * C);
  dmid_.resize(R * C);
  dqkv_.resize(R * 3 * C);
  dlnf_.resize(R * C);
  targets_.resize(R);
}

void Gpt::Forward(const int32_t* tokens, int token_stride, int n, int t) {
  const int rows = n * t;
  const int C = config_.d_model;
  Reserve(rows, n);
  const float* P = params_.data();
  // The residual stream starts as token embedding + position embedding.
  float* x0 = resid_[0].data();
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < t; ++j) {
      const int32_t token = tokens[static_cast<size_t>(i) * token_stride + j];
      float* x = x0 + (static_cast<size_t>(i) * t + j) * C;
      const float* e = P + wte_ + static_cast<size_t>(token) * C;
      const float* pos = P + wpe_ + static_cast<size_t>(j) * C;
      for (int k = 0; k < C; ++k) x[k] = e[k] + pos[k];
    }
  }
  for (int l = 0; l < config_.layers; ++l) {
    const Block& b = blocks_[l];
    kernels::LayerNormForward(resid_[l].data(), P + b.ln1_w, P + b.ln1_b, rows, C, kLayerNormEps,
                              ln1_[l].data(), ln1_mean_[l].data(), ln1_rstd_[l].data());
    // Each product adds onto its bias (and residual) already in place: no separate passes.
    StartWith(nullptr, P + b.attn_b, rows, 3 * C, qkv_[l].data());
    kernels::Gemm(false, false, rows, 3 * C, C, 1.0f, ln1_[l].data(), C, P + b.attn_w, 3 * C, 1.0f,
                  qkv_[l].data(), 3 * C);
    kernels::CausalAttentionForward(qkv_[l].data(), n, t, C, config_.heads, atty_[l].data(),
                                    lse_[l].data());
    StartWith(resid_[l].data(), P + b.proj_b, rows, C, mid_[l].data());
    kernels::Gemm(false, false, rows, C, C, 1.0f, atty_[l].data(), C, P + b.proj_w, C, 1.0f,
                  mid_[l].data(), C);
    kernels::LayerNormForward(mid_[l].data(), P + b.ln2_w, P + b.ln2_b, rows, C, kLayerNormEps,
                              ln2_[l].data(), ln2_mean_[l].data(), ln2_rstd_[l].data());
    kernels::Gemm(false, false, rows, 4 * C, C, 1.0f, ln2_[l].data(), C, P + b.fc_w, 4 * C, 0.0f,
                  fch_[l].data(), 4 * C);
    kernels::BiasGeluTanhForward(P + b.fc_b, rows, 4 * C, fch_[l].data(), fch_gelu_[l].data());
    float* out = resid_[l + 1].data();
    StartWith(mid_[l].data(), P + b.fcproj_b, rows, C, out);
    kernels::Gemm(false, false, rows, C, 4 * C, 1.0f, fch_gelu_[l].data(), 4 * C, P + b.fcproj_w,
                  C, 1.0f, out, C);
  }
  kernels::LayerNormForward(resid_[config_.layers].data(), P + lnf_w_, P + lnf_b_, rows, C,
                            kLayerNormEps, lnf_.data(), lnf_mean_.data(), lnf_rstd_.data());
}

double Gpt::Head(const int32_t* tokens, int token_stride, int n, int t, float scale,
                 bool backward, int64_t* correct) {
  const int rows = n * t;
  const int C = config_.d_model, V = config_.vocab;
  const float* P = params_.data();
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < t; ++j) {
      targets_[static_cast<size_t>(i) * t + j] = tokens[static_cast<size_t>(i) * token_stride + j + 1];
    }
  }
  const int chunk = static_cast<int>(std::max<size_t>(1, kHeadChunkValues / V));
  logits_.resize(static_cast<size_t>(std::min(chunk, rows)) * V);
  double loss = 0;
  for (int r0 = 0; r0 < rows; r0 += chunk) {
    const int m = std::min(chunk, rows - r0);
    const float* in = lnf_.data() + static_cast<size_t>(r0) * C;
    kernels::Gemm(false, true, m, V, C, 1.0f, in, C, P + wte_, C, 0.0f, logits_.data(), V);
    loss += kernels::SoftmaxCrossEntropyInPlace(logits_.data(), targets_.data() + r0, m, V, scale,
                                                correct);
    if (!backward) continue;
    // logits_ now holds the loss's gradient for these rows: through the tied head into lnf's
    // output and into wte (added: the caller zeroed or kept wte's gradient before).
    kernels::Gemm(false, false, m, C, V, 1.0f, logits_.data(), V, P + wte_, C, 0.0f,
                  dlnf_.data() + static_cast<size_t>(r0) * C, C);
    if (float* dwte = GradFor(wte_); dwte != nullptr) {
      kernels::Gemm(true, false, V, C, m, 1.0f, logits_.data(), V, in, C, 1.0f, dwte, C);
    }
  }
  return loss;
}

double Gpt::ForwardBackward(const Batch& batch, float grad_scale, size_t chunk_floats,
                            const std::function<void(double)>& on_loss,
                            const std::function<void(size_t)>& on_ready, bool accumulate) {
  const int n = batch.n, t = config_.context, C = config_.d_model;
  const int rows = n * t;
  const size_t RC = static_cast<size_t>(rows) * C;
  const float* P = params_.data();
  const float beta = accumulate ? 1.0f : 0.0f;
  ReadyReporter report(*this, on_ready);
  size_t next_ready = 0;
  auto ready = [&] { report(ready_points_[next_ready++]); };
  // Without accumulation every gradient is overwritten; the ones only ever added to start at 0.
  if (!accumulate) std::fill(grads(), grads() + num_grads(), 0.0f);
  Forward(batch.tokens, batch.token_stride, n, t);
  // A sample's loss is the mean over its t predictions.
  const double loss =
      Head(batch.tokens, batch.token_stride, n, t, grad_scale / t, /*backward=*/true, nullptr) / t;
  if (on_loss) on_loss(loss);
  std::fill(dresid_.begin(), dresid_.begin() + RC, 0.0f);
  kernels::LayerNormBackward(dlnf_.data(), resid_[config_.layers].data(), P + lnf_w_,
                             lnf_mean_.data(), lnf_rstd_.data(), rows, C, dresid_.data(),
                             GradFor(lnf_w_), GradFor(lnf_b_));
  ready();
  for (int l = config_.layers - 1; l >= 0; --l) {
    const Block& b = blocks_[l];
    // mlp.c_proj: out = fch_gelu . W + b (+ the residual, whose gradient passes through).
    WeightGradient(fch_gelu_[l].data(), 4 * C, dresid_.data(), C, rows, beta, GradFor(b.fcproj_w));
    BiasGrad(dresid_.data(), rows, C, GradFor(b.fcproj_b), accumulate);
    kernels::Gemm(false, true, rows, 4 * C, C, 1.0f, dresid_.data(), C, P + b.fcproj_w, C, 0.0f,
                  scratch4_.data(), 4 * C);
    ready();
    // GELU, then mlp.c_fc.
    kernels::GeluTanhBackwardBiasGrad(fch_[l].data(), scratch4_.data(), rows, 4 * C,
                                      scratch4_.data(), GradFor(b.fc_b), accumulate);
    WeightGradient(ln2_[l].data(), C, scratch4_.data(), 4 * C, rows, beta, GradFor(b.fc_w));
    kernels::Gemm(false, true, rows, C, 4 * C, 1.0f, scratch4_.data(), 4 * C, P + b.fc_w, 4 * C,
                  0.0f, scratch_.data(), C);
    ready();
    // ln_2: into the gradient of the stream after attention, which also gets the residual's.
    std::copy(dresid_.begin(), dresid_.begin() + RC, dmid_.begin());
    kernels::LayerNormBackward(scratch_.data(), mid_[l].data(), P + b.ln2_w, ln2_mean_[l].data(),
                               ln2_rstd_[l].data(), rows, C, dmid_.data(), GradFor(b.ln2_w),
                               GradFor(b.ln2_b));
    ready();
    // attn.c_proj.
    WeightGradient(atty_[l].data(), C, dmid_.data(), C, rows, beta, GradFor(b.proj_w));
    BiasGrad(dmid_.data(), rows, C, GradFor(b.proj_b), accumulate);
    kernels::Gemm(false, true, rows, C, C, 1.0f, dmid_.data(), C, P + b.proj_w, C, 0.0f,
                  scratch_.data(), C);
    ready();
    // Attention, then attn.c_attn.
    kernels::CausalAttentionBackward(scratch_.data(), qkv_[l].data(), atty_[l].data(),
                                     lse_[l].data(), n, t, C, config_.heads, dqkv_.data());
    WeightGradient(ln1_[l].data(), C, dqkv_.data(), 3 * C, rows, beta, GradFor(b.attn_w));
    BiasGrad(dqkv_.data(), rows, 3 * C, GradFor(b.attn_b), accumulate);
    kernels::Gemm(false, true, rows, C, 3 * C, 1.0f, dqkv_.data(), 3 * C, P + b.attn_w, 3 * C,
                  0.0f, scratch_.data(), C);
    ready();
    // ln_1: into the gradient of the stream entering the block.
    std::copy(dmid_.begin(), dmid_.begin() + RC, dresid_.begin());
    kernels::LayerNormBackward(scratch_.data(), resid_[l].data(), P + b.ln1_w,
                               ln1_mean_[l].data(), ln1_rstd_[l].data(), rows, C, dresid_.data(),
                               GradFor(b.ln1_w), GradFor(b.ln1_b));
    ready();
  }
  // The embeddings, in row order (deterministic): positions, then tokens (wte's gradient also
  // holds the LM head's share by now).
  if (float* dwpe = GradFor(wpe_); dwpe != nullptr) {
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < t; ++j) {
        Add(dresid_.data() + (static_cast<size_t>(i) * t + j) * C, dwpe + static_cast<size_t>(j) * C,
            C);
      }
    }
  }
  ready();
  if (float* dwte = GradFor(wte_); dwte != nullptr) {
    for (int i = 0; i < n; ++i) {
      kernels::EmbeddingBackward(batch.tokens + static_cast<size_t>(i) * batch.token_stride,
                                 dresid_.data() + static_cast<size_t>(i) * t * C, t, C, dwte);
    }
  }
  ready();
  return loss;
}

double Gpt::Evaluate(const Batch& batch, int64_t* correct) {
  const int t = config_.context;
  Forward(batch.tokens, batch.token_stride, batch.n, t);
  return Head(batch.tokens, batch.token_stride, batch.n, t, 0.0f, /*backward=*/false, correct) / t;
}

absl::StatusOr<std::vector<float>> Gpt::NextTokenLogits(const std::vector<int32_t>& tokens) {
  if (tokens.empty()) return absl::InvalidArgumentError("NextTokenLogits: no tokens");
  for (int32_t token : tokens) {
    if (token < 0 || token >= config_.vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("token ", token, " is outside the vocabulary [0, ", config_.vocab, ")"));
    }
  }
  const int t = static_cast<int>(std::min<size_t>(tokens.size(), config_.context));
  const int32_t* window = tokens.data() + tokens.size() - t;
  Forward(window, t, 1, t);
  const int C = config_.d_model, V = config_.vocab;
  std::vector<float> logits(V);
  kernels::Gemm(false, true, 1, V, C, 1.0f, lnf_.data() + static_cast<size_t>(t - 1) * C, C,
                params_.data() + wte_, C, 0.0f, logits.data(), V);
  return logits;
}

absl::StatusOr<std::unique_ptr<Model>> CreateGpt(const v1::ModelSpec& model,
                                                 const DataShape& /*shape*/) {
  const v1::GptSpec& spec = model.gpt();
  return std::unique_ptr<Model>(new Gpt(
      {spec.vocab_size(), spec.context_length(), spec.n_layer(), spec.n_head(), spec.d_model()}));
}

}  // namespace lockstep::worker
