#include "worker/model/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "common/random.h"

namespace lockstep::worker {
namespace {

// Draws a token from `logits` at `temperature`, among the `top_k` largest (0: all; ties go to
// the lower id), in double, so the draw is the same on every platform.
int32_t Draw(const std::vector<float>& logits, double temperature, int top_k, SplitMix64& rng) {
  const int v = static_cast<int>(logits.size());
  std::vector<int32_t> order(v);
  std::iota(order.begin(), order.end(), 0);
  const int k = top_k > 0 ? std::min(top_k, v) : v;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  std::vector<double> p(k);
  const double top = logits[order[0]];
  double sum = 0;
  for (int i = 0; i < k; ++i) {
    p[i] = std::exp((logits[order[i]] - top) / temperature);
    sum += p[i];
  }
  double u = rng.Uniform() * sum;
  for (int i = 0; i < k; ++i) {
    if (u < p[i]) return order[i];
    u -= p[i];
  }
  return order[k - 1];
}

}  // namespace

absl::StatusOr<v1::Sample> GenerateSample(Model& model, const v1::SampleSpec& spec, bool text) {
  std::vector<int32_t> tokens;
  if (text) {
    const std::string prompt = spec.prompt().empty() ? std::string("\n") : spec.prompt();
    for (unsigned char c : prompt) tokens.push_back(c);
  } else {
    tokens.assign(spec.prompt_tokens().begin(), spec.prompt_tokens().end());
    if (tokens.empty()) tokens.push_back(0);
  }
  const double temperature = spec.temperature() > 0 ? spec.temperature() : 1.0;
  SplitMix64 rng(MixSeed(spec.seed(), 0x5a3b1e));
  v1::Sample sample;
  for (int i = 0; i < spec.max_tokens(); ++i) {
    absl::StatusOr<std::vector<float>> logits = model.NextTokenLogits(tokens);
    if (!logits.ok()) return logits.status();
    const int32_t next = Draw(*logits, temperature, spec.top_k(), rng);
    tokens.push_back(next);
    sample.add_tokens(next);
  }
  if (text) {
    // The prompt and its continuation. A token above 255 (a vocabulary larger than the bytes)
    // is no byte: it shows as U+FFFD, like a byte sequence that is not UTF-8.
    std::string bytes;
    for (int32_t token : tokens) {
      bytes.push_back(token < 256 ? static_cast<char>(token) : '\xff');
    }
    sample.set_text(ToValidUtf8(bytes));
  }
  return sample;
}

}  // namespace lockstep::worker
