// The GPT's forward and backward on one core, against this machine's single-core SGEMM rate:
// prints a table (and --json) with ms per step, tokens/s, the step's matrix-product FLOP rate
// and its fraction of the SGEMM peak. No communication: what one worker's compute reaches.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "kernels/cpu_kernels.h"
#include "worker/model/gpt.h"
#include "common/random.h"

ABSL_FLAG(int, vocab, 256, "vocabulary");
ABSL_FLAG(int, context, 128, "context_length");
ABSL_FLAG(int, layers, 4, "n_layer");
ABSL_FLAG(int, heads, 4, "n_head");
ABSL_FLAG(int, d_model, 128, "d_model");
ABSL_FLAG(int, batch, 64, "sequences per step");
ABSL_FLAG(int, steps, 5, "timed steps (after one warm-up)");
ABSL_FLAG(std::string, json, "", "write the results here");

namespace {

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// SGEMM rate of one core on square products of size n.
double SgemmGflops(int n) {
  std::vector<float> a(static_cast<size_t>(n) * n, 0.5f), b(a), c(a.size());
  lockstep::kernels::Gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  const auto t0 = std::chrono::steady_clock::now();
  const int reps = 5;
  for (int i = 0; i < reps; ++i) {
    lockstep::kernels::Gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(),
                            n);
  }
  const double s = Seconds(t0, std::chrono::steady_clock::now());
  return 2.0 * n * n * static_cast<double>(n) * reps / s / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  lockstep::kernels::SetBlasThreads(1);
  const lockstep::worker::GptConfig config{absl::GetFlag(FLAGS_vocab), absl::GetFlag(FLAGS_context),
                                           absl::GetFlag(FLAGS_layers), absl::GetFlag(FLAGS_heads),
                                           absl::GetFlag(FLAGS_d_model)};
  lockstep::worker::Gpt gpt(config);
  gpt.Initialize(1);
  const int B = absl::GetFlag(FLAGS_batch), T = config.context;
  std::vector<int32_t> tokens(static_cast<size_t>(B) * (T + 1));
  lockstep::SplitMix64 rng(3);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng.Below(config.vocab));
  lockstep::worker::Batch batch{B, nullptr, 0, nullptr, tokens.data(), T + 1};
  gpt.ForwardBackward(batch, 1.0f / B, 1 << 16, nullptr, nullptr);
  const int steps = absl::GetFlag(FLAGS_steps);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) gpt.ForwardBackward(batch, 1.0f / B, 1 << 16, nullptr, nullptr);
  const double per_step = Seconds(t0, std::chrono::steady_clock::now()) / steps;
  // Matrix-product FLOPs of one step: forward 2 * rows * (12 C^2 per layer + V C for the head),
  // backward twice that; attention's q.k and p.v add 2 * 2 * B * T^2 * C / 2 per layer forward
  // (causal: half), backward twice that.
  const double rows = static_cast<double>(B) * T, C = config.d_model, L = config.layers;
  const double dense = 6.0 * rows * (12.0 * C * C * L + config.vocab * C);
  const double attention = 3.0 * 2.0 * B * static_cast<double>(T) * T * C * L;
  const double gflops = (dense + attention) / per_step / 1e9;
  const double peak = SgemmGflops(1024);
  std::printf("%-28s %12s\n", "metric", "value");
  std::printf("%-28s %12.1f\n", "ms per step", per_step * 1e3);
  std::printf("%-28s %12.0f\n", "tokens/s (one core)", rows / per_step);
  std::printf("%-28s %12.2f\n", "step GFLOP/s", gflops);
  std::printf("%-28s %12.2f\n", "SGEMM GFLOP/s (1024^3)", peak);
  std::printf("%-28s %12.2f\n", "fraction of SGEMM", gflops / peak);
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream(path) << absl::StrFormat(
        "{\"ms_per_step\": %.3f, \"tokens_per_second\": %.1f, \"step_gflops\": %.3f, "
        "\"sgemm_gflops\": %.3f, \"fraction_of_sgemm\": %.4f}\n",
        per_step * 1e3, rows / per_step, gflops, peak, gflops / peak);
  }
  return 0;
}
