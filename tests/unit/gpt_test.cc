// The GPT model on the CPU: GPT-2's tensor names, shapes and initialisation; gradients against
// central finite differences of the whole model on a tiny configuration; ready points in
// backward order; gradient accumulation; evaluation consistent with training.
#include "worker/model/gpt.h"

#include <cmath>
#include <map>
#include <random>

#include "gtest/gtest.h"

namespace lockstep::worker {
namespace {

GptConfig Tiny() { return {/*vocab=*/11, /*context=*/5, /*layers=*/2, /*heads=*/2, /*d_model=*/8}; }

// n windows of context + 1 random tokens.
std::vector<int32_t> Windows(const GptConfig& c, int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> tokens(static_cast<size_t>(n) * (c.context + 1));
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % c.vocab);
  return tokens;
}

Batch Of(const std::vector<int32_t>& tokens, const GptConfig& c, int n) {
  Batch b;
  b.n = n;
  b.tokens = tokens.data();
  b.token_stride = c.context + 1;
  return b;
}

TEST(GptTest, TensorsHaveGpt2NamesShapesAndBackwardOrder) {
  const GptConfig c = Tiny();
  Gpt gpt(c);
  std::map<std::string, std::vector<int64_t>> shapes;
  size_t next = 0;
  for (const Tensor& t : gpt.tensors()) {
    EXPECT_EQ(t.offset, next) << t.name;
    next += t.count;
    shapes[t.name] = t.shape;
  }
  EXPECT_EQ(next, gpt.num_params());
  EXPECT_EQ(gpt.num_params(),
            static_cast<size_t>(c.vocab * 8 + c.context * 8 + 2 * 8 + 2 * (12 * 64 + 13 * 8)));
  EXPECT_EQ(shapes["wte.weight"], (std::vector<int64_t>{11, 8}));
  EXPECT_EQ(shapes["wpe.weight"], (std::vector<int64_t>{5, 8}));
  EXPECT_EQ(shapes["h.0.attn.c_attn.weight"], (std::vector<int64_t>{8, 24}));
  EXPECT_EQ(shapes["h.1.attn.c_proj.weight"], (std::vector<int64_t>{8, 8}));
  EXPECT_EQ(shapes["h.0.mlp.c_fc.weight"], (std::vector<int64_t>{8, 32}));
  EXPECT_EQ(shapes["h.0.mlp.c_proj.weight"], (std::vector<int64_t>{32, 8}));
  EXPECT_EQ(shapes["ln_f.bias"], (std::vector<int64_t>{8}));
  EXPECT_EQ(gpt.tensors().front().name, "ln_f.weight");
  EXPECT_EQ(gpt.tensors().back().name, "wte.weight") << "its gradient is final last";
  EXPECT_EQ(gpt.tensors()[2].name, "h.1.mlp.c_proj.weight") << "the last block comes first";
}

TEST(GptTest, InitialisationIsGpt2s) {
  const GptConfig c{64, 16, 4, 4, 64};
  Gpt gpt(c);
  gpt.Initialize(3);
  auto stats = [&](const std::string& name) {
    for (const Tensor& t : gpt.tensors()) {
      if (t.name != name) continue;
      double sum = 0, sq = 0;
      for (size_t i = 0; i < t.count; ++i) {
        sum += gpt.params()[t.offset + i];
        sq += double{gpt.params()[t.offset + i]} * gpt.params()[t.offset + i];
      }
      const double mean = sum / t.count;
      return std::pair<double, double>{mean, std::sqrt(sq / t.count - mean * mean)};
    }
    ADD_FAILURE() << name;
    return std::pair<double, double>{};
  };
  EXPECT_NEAR(stats("h.0.attn.c_attn.weight").second, 0.02, 0.002);
  EXPECT_NEAR(stats("wte.weight").second, 0.02, 0.002);
  EXPECT_NEAR(stats("h.2.mlp.c_proj.weight").second, 0.02 / std::sqrt(8.0), 0.001);
  EXPECT_EQ(stats("h.1.ln_1.weight"), (std::pair<double, double>{1.0, 0.0}));
  EXPECT_EQ(stats("h.3.mlp.c_fc.bias"), (std::pair<double, double>{0.0, 0.0}));
  Gpt again(c);
  again.Initialize(3);
  EXPECT_TRUE(std::equal(gpt.params(), gpt.params() + gpt.num_params(), again.params()));
}

// The whole model's gradient against finite differences: Richardson-extrapolated central
// differences in float at h = 1e-2 and 5e-3 (the h^2 terms cancel; float rounding of a loss near
// log(11) ~ 2.4 leaves well under 1e-2 relative). Weights 5x GPT-2's so that every path carries
// a gradient well above rounding.
TEST(GptTest, GradientMatchesFiniteDifferences) {
  const GptConfig c = Tiny();
  Gpt gpt(c);
  gpt.Initialize(5);
  for (size_t i = 0; i < gpt.num_params(); ++i) gpt.params()[i] *= 5.0f;
  const int n = 3;
  const std::vector<int32_t> tokens = Windows(c, n, 7);
  std::vector<size_t> ready;
  const double loss = gpt.ForwardBackward(Of(tokens, c, n), 1.0f, 0, nullptr,
                                          [&](size_t end) { ready.push_back(end); });
  EXPECT_EQ(ready, gpt.ReadyPoints(0));
  std::vector<float> analytic(gpt.grads(), gpt.grads() + gpt.num_params());
  int64_t unused = 0;
  EXPECT_NEAR(gpt.Evaluate(Of(tokens, c, n), &unused), loss, 1e-5 * loss);
  double err = 0, norm = 0;
  std::map<std::string, std::pair<double, double>> per_tensor;
  for (const Tensor& t : gpt.tensors()) {
    for (size_t i = t.offset; i < t.offset + t.count; ++i) {
      const float saved = gpt.params()[i];
      auto central = [&](float h) {
        gpt.params()[i] = saved + h;
        const double up = gpt.Evaluate(Of(tokens, c, n), &unused);
        gpt.params()[i] = saved - h;
        const double down = gpt.Evaluate(Of(tokens, c, n), &unused);
        gpt.params()[i] = saved;
        return (up - down) / (2.0 * h);
      };
      // Richardson's extrapolation of two central differences cancels the h^2 term.
      const double numeric = (4.0 * central(5e-3f) - central(1e-2f)) / 3.0;
      err += (numeric - analytic[i]) * (numeric - analytic[i]);
      norm += numeric * numeric;
      per_tensor[t.name].first += (numeric - analytic[i]) * (numeric - analytic[i]);
      per_tensor[t.name].second += numeric * numeric;
    }
  }
  EXPECT_LT(std::sqrt(err / norm), 5e-3);
  for (const auto& [name, e] : per_tensor) {
    EXPECT_LT(std::sqrt(e.first / std::max(e.second, 1e-30)), 3e-2) << name;
    EXPECT_GT(e.second, 0) << name << " gets no gradient";
  }
}

TEST(GptTest, AccumulatedMicroBatchesMatchOneBatch) {
  const GptConfig c = Tiny();
  const int n = 4;
  const std::vector<int32_t> tokens = Windows(c, n, 9);
  Gpt whole(c), parts(c);
  whole.Initialize(2);
  parts.Initialize(2);
  const double all = whole.ForwardBackward(Of(tokens, c, n), 0.25f, 0, nullptr, nullptr);
  const Batch batch = Of(tokens, c, n);
  double split = parts.ForwardBackward(batch.Slice(0, 1), 0.25f, 0, nullptr, nullptr);
  split += parts.ForwardBackward(batch.Slice(1, 3), 0.25f, 0, nullptr, nullptr,
                                 /*accumulate=*/true);
  EXPECT_NEAR(split, all, 1e-5 * all);
  double err = 0, norm = 0;
  for (size_t i = 0; i < whole.num_params(); ++i) {
    err += (double{whole.grads()[i]} - parts.grads()[i]) * (double{whole.grads()[i]} - parts.grads()[i]);
    norm += double{whole.grads()[i]} * whole.grads()[i];
  }
  EXPECT_LT(std::sqrt(err / norm), 1e-5);
}

// Next-token logits at the end of a prefix equal the head's prediction inside a full window.
TEST(GptTest, NextTokenLogitsArePredictionsAtThePrefixEnd) {
  const GptConfig c = Tiny();
  Gpt gpt(c);
  gpt.Initialize(4);
  const std::vector<int32_t> tokens = {3, 1, 4, 1, 5};
  std::vector<float> logits = gpt.NextTokenLogits(tokens).value();
  ASSERT_EQ(logits.size(), 11u);
  // Causal: what follows a prefix does not change the prediction after it.
  std::vector<float> prefix = gpt.NextTokenLogits({3, 1, 4}).value();
  std::vector<float> prefix_again = gpt.NextTokenLogits({3, 1, 4}).value();
  EXPECT_EQ(prefix, prefix_again);
  EXPECT_NE(prefix, logits);
}

}  // namespace
}  // namespace lockstep::worker
