// CPU kernels of a GPT-style transformer, beside the matrix products (kernels::Gemm, OpenBLAS):
// LayerNorm, the tanh GELU, causal multi-head attention, the embedding gradient and the fused
// LM-head softmax cross-entropy. Row-major throughout; "rows" are token positions (B*T).
// Each has a float64 reference test (tests/unit/transformer_kernels_test.cc). Single-threaded,
// and deterministic: the same inputs give the same bits.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lockstep::kernels {

// LayerNorm of each row of x (rows x c): out = (x - mean) * rstd * w + b, with
// rstd = 1 / sqrt(var + eps) and the biased variance (PyTorch's nn.LayerNorm). Saves mean and
// rstd per row for the backward pass. Statistics are summed in double, so a row of thousands of
// values loses nothing to cancellation.
void LayerNormForward(const float* x, const float* w, const float* b, int rows, int c, float eps,
                      float* out, float* mean, float* rstd);
// Given dout, ADDS to dx (rows x c, a residual stream's gradient), dw and db (c each; null when
// that gradient is not wanted).
void LayerNormBackward(const float* dout, const float* x, const float* w, const float* mean,
                       const float* rstd, int rows, int c, float* dx, float* dw, float* db);

// GELU with the tanh approximation (GPT-2's, PyTorch's approximate="tanh"):
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void GeluTanhForward(const float* x, size_t n, float* out);
// dx = dout * gelu'(x) (overwrites dx; dx may alias dout).
void GeluTanhBackward(const float* x, const float* dout, size_t n, float* dx);
// The MLP's bias and activation in one pass over rows x cols: pre += bias (per column), then
// out = GELU(pre).
void BiasGeluTanhForward(const float* bias, int rows, int cols, float* pre, float* out);
// GeluTanhBackward over rows x cols, and (db not null) the bias gradient: db = (accumulate:
// db +) the column sums of dx in row order, the same sums as ColumnSums.
void GeluTanhBackwardBiasGrad(const float* x, const float* dout, int rows, int cols, float* dx,
                              float* db, bool accumulate);

// Causal self-attention. qkv holds, per row (token t of sequence b, row b*T + t), the query,
// key and value vectors of all heads: [q (c) | k (c) | v (c)], head h at offset h*hs of each,
// hs = c / heads. out (rows x c): head h's attention output at offset h*hs. Scores are
// q.k / sqrt(hs) over keys j <= t; the softmax is taken with its maximum subtracted, and only
// the log-sum-exp of each (b, h, t) is kept (lse, b*heads*T + h*T + t): memory O(T) per row,
// never the T x T probabilities, which the backward pass recomputes (as flash attention does).
void CausalAttentionForward(const float* qkv, int batch, int T, int c, int heads, float* out,
                            float* lse);
// Given dout (rows x c) and the forward's qkv, out and lse, writes dqkv (rows x 3c; overwrites).
void CausalAttentionBackward(const float* dout, const float* qkv, const float* out,
                             const float* lse, int batch, int T, int c, int heads, float* dqkv);

// The embedding's gradient: dtable[ids[i]] += dx[i] (rows of c), in index order, so the result
// is the same bits on every run (no racing additions).
void EmbeddingBackward(const int32_t* ids, const float* dx, int rows, int c, float* dtable);

// out (cols) = (or += with `accumulate`) the column sums of d (rows x cols), row by row in
// float: a bias's gradient, as PyTorch sums it (in float), at the memory rate.
void ColumnSums(const float* d, int rows, int cols, float* out, bool accumulate);

// Fused softmax cross-entropy in place over `rows` rows of `v` logits: returns the sum over rows
// of -log softmax(row)[target] (in double) and leaves grad_scale * (softmax - onehot(target)) in
// the row, so the full-vocabulary gradient exists once, where the logits were. Adds to *correct
// (if given) the rows whose first maximum is the target. Targets must be in [0, v).
double SoftmaxCrossEntropyInPlace(float* logits, const int32_t* targets, int rows, int v,
                                  float grad_scale, int64_t* correct);

}  // namespace lockstep::kernels
