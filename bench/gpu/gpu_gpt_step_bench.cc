// GPU training-step benchmark of the GPT on one GPU: the worker's engine (GpuStep over GpuGpt,
// worker/cuda/gpu_step.h) at GPT-2 124M's shape by default, AdamW with global-norm clipping,
// on synthetic tokens copied from pinned host memory each step as in training. Prints a table
// and writes JSON: tokens/s, step time, model FLOP/s, MFU against the H200's dense bf16 peak
// and against a cuBLAS GEMM rate measured in the same run in the same precision.
// bench/torch/gpu_gpt_step.py is the PyTorch twin; tests/gpu/check.sh puts them side by side.
//   gpu_gpt_step_bench [--layers=12 --heads=12 --d_model=768 --context=1024 --vocab=50257]
//                  [--batch=16] [--micro_batch=N] [--steps=10] [--precision=fp32|tf32|bf16]
//                  [--deterministic --micro_shards=8] [--phases] [--json=F]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstring>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/gpu/bench_step.h"
#include "bench/gpu/gemm_rate.h"
#include "common/status_macros.h"
#include "kernels/gpu_check.h"
#include "kernels/phase_timer.h"
#include "worker/model/gpt.h"
#include "worker/cuda/gpu_step.h"
#include "worker/step/optimizer.h"

ABSL_FLAG(int, layers, 12, "transformer blocks");
ABSL_FLAG(int, heads, 12, "attention heads");
ABSL_FLAG(int, d_model, 768, "width");
ABSL_FLAG(int, context, 1024, "context length");
ABSL_FLAG(int, vocab, 50257, "vocabulary");
ABSL_FLAG(int, batch, 16, "sequences per step");
ABSL_FLAG(int, micro_batch, 0, "sequences per forward/backward (gradient accumulation); 0: all");
ABSL_FLAG(int, steps, 10, "timed steps (after 2 warm-up steps)");
ABSL_FLAG(std::string, precision, "bf16", "fp32, tf32 or bf16 (the products' arithmetic)");
ABSL_FLAG(bool, deterministic, false, "deterministic mode (fixed-point sums per micro-shard)");
ABSL_FLAG(int, micro_shards, 8, "micro-shards of the batch (deterministic mode)");
ABSL_FLAG(std::string, json, "", "write the results here as JSON");
ABSL_FLAG(bool, phases, false,
          "also time each phase of the step on the device (events between phases; a separate "
          "run after the timed one) and print where the time goes");

namespace {

using lockstep::worker::GpuStep;

// H200 SXM (and H100 SXM): dense bf16 tensor-core peak, the MFU denominator the field uses.
constexpr double kH200Bf16PeakTflops = 989.4;

// Prints where a step's time goes (the phases' table); returns the phases as JSON members.
std::string PrintPhases(const std::vector<std::pair<std::string, double>>& phases,
                        const std::string& precision, double step_ms) {
  std::string phases_json;
  if (phases.empty()) return phases_json;
  double marked = 0;
  for (const auto& [name, ms] : phases) marked += ms;
  std::printf("\n| phase (%s) | ms per step | share of the marked time |\n|---|---|---|\n",
              precision.c_str());
  for (const auto& [name, ms] : phases) {
    std::printf("| %s | %.2f | %.1f%% |\n", name.c_str(), ms, 100 * ms / marked);
    phases_json += absl::StrCat(phases_json.empty() ? "" : ", ", "\"", name, "\": ", ms);
  }
  std::printf("| (all marked) | %.2f | of a %.2f ms step |\n", marked, step_ms);
  return phases_json;
}

// The benchmark's job: GPT-2's AdamW settings on a batch of n windows.
lockstep::v1::JobSpec BenchSpec(int n, int shards, bool deterministic,
                                const std::string& precision) {
  lockstep::v1::JobSpec spec;
  spec.mutable_model()->set_type("gpt");
  lockstep::v1::OptimizerSpec* o = spec.mutable_optimizer();
  o->set_type("adamw");
  o->set_learning_rate(6e-4);
  o->set_beta1(0.9);
  o->set_beta2(0.95);
  o->set_epsilon(1e-8);
  o->set_weight_decay(0.1);
  o->set_grad_clip_norm(1.0);
  spec.set_global_batch_size(n);
  spec.set_micro_shards(shards);
  spec.set_deterministic(deterministic);
  spec.set_precision(precision);

  return spec;
}

absl::Status Run() {
  const std::string precision = absl::GetFlag(FLAGS_precision);
  if (precision != "fp32" && precision != "tf32" && precision != "bf16") {
    return absl::InvalidArgumentError(
        absl::StrCat("--precision: fp32, tf32 or bf16, got ", precision));
  }
  lockstep::worker::GptConfig config;
  config.layers = absl::GetFlag(FLAGS_layers);
  config.heads = absl::GetFlag(FLAGS_heads);
  config.d_model = absl::GetFlag(FLAGS_d_model);
  config.context = absl::GetFlag(FLAGS_context);
  config.vocab = absl::GetFlag(FLAGS_vocab);
  const int n = absl::GetFlag(FLAGS_batch), steps = absl::GetFlag(FLAGS_steps);
  const bool deterministic = absl::GetFlag(FLAGS_deterministic);
  const int shards = absl::GetFlag(FLAGS_micro_shards);
  const int micro_batch =
      absl::GetFlag(FLAGS_micro_batch) > 0 ? absl::GetFlag(FLAGS_micro_batch) : n;
  if (n <= 0 || (deterministic && (shards <= 0 || n % shards != 0))) {
    return absl::InvalidArgumentError("--batch > 0, and --micro_shards must divide it");
  }
  const lockstep::v1::JobSpec spec = BenchSpec(n, shards, deterministic, precision);
  lockstep::worker::Gpt model(config);
  model.Initialize(1);
  lockstep::worker::Optimizer optimizer(spec.optimizer(), model.segments(), 2 * steps + 2);
  auto step = GpuStep::Create(spec, lockstep::worker::SampleLayout{0, config.context + 1}, &model,
                              &optimizer);
  if (!step.ok()) return step.status();
  LOCKSTEP_RETURN_IF_ERROR((*step)->Begin({}));
  auto batch = (*step)->HostBuffers(n);
  if (!batch.ok()) return batch.status();
  std::mt19937 rng(2);
  for (size_t i = 0; i < static_cast<size_t>(n) * batch->token_stride; ++i) {
    batch->tokens[i] = static_cast<int32_t>(rng() % config.vocab);
  }
  lockstep::worker::StepArgs args =
      lockstep::bench::BenchStepArgs(n, micro_batch, deterministic, shards);
  double loss = 0;
  auto one_step = [&](int64_t k) -> absl::Status {
    args.step = k;
    args.lr = static_cast<float>(optimizer.LearningRate(k));
    auto r = (*step)->TakeStep(args);
    if (!r.ok()) return r.status();
    if (r->rejected != 0) return absl::OutOfRangeError("fixed-point range exceeded");
    loss = r->loss;
    return absl::OkStatus();
  };
  LOCKSTEP_RETURN_IF_ERROR(one_step(1));
  const double first_loss = loss;
  LOCKSTEP_RETURN_IF_ERROR(one_step(2));
  // Each step ends with the loss read back (the worker reports it), so wall time is GPU time.
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) LOCKSTEP_RETURN_IF_ERROR(one_step(3 + i));
  const double step_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
      steps;
  const double last_loss = loss;  // of the timed steps
  // Where the time goes: the same steps again with events between the phases (not in the
  // timed run above, so the events cost it nothing).
  lockstep::kernels::cuda::PhaseTimer timer((*step)->compute_stream());
  std::vector<std::pair<std::string, double>> phases;
  if (absl::GetFlag(FLAGS_phases)) {
    (*step)->set_phase_timer(&timer);
    for (int i = 0; i < steps; ++i) {
      LOCKSTEP_RETURN_IF_ERROR(one_step(3 + steps + i));
      LOCKSTEP_RETURN_IF_ERROR(timer.Collect());
    }
    (*step)->set_phase_timer(nullptr);
    phases = timer.totals_ms();
    for (auto& [name, ms] : phases) ms /= steps;
  }
  LOCKSTEP_RETURN_IF_ERROR((*step)->End());

  // Model FLOPs per token: 6 per parameter (forward and backward of every product, the tied
  // head included) and the attention's scores and weighted values, 12 L C T (as PaLM's
  // appendix and nanoGPT's MFU estimate count them, causal masking not discounted).
  const double tokens = static_cast<double>(n) * config.context;
  const double flops_per_token =
      6.0 * static_cast<double>(model.num_params()) +
      12.0 * config.layers * static_cast<double>(config.d_model) * config.context;
  const double tflops = flops_per_token * tokens / (step_ms * 1e-3) / 1e12;
  absl::StatusOr<double> gemm = lockstep::bench::GemmTflops(precision);
  if (!gemm.ok()) return gemm.status();

  cudaDeviceProp props{};
  cudaGetDeviceProperties(&props, 0);
  size_t free_bytes = 0, total_bytes = 0;
  cudaMemGetInfo(&free_bytes, &total_bytes);
  const char* mode = deterministic ? "deterministic" : micro_batch < n ? "accumulate" : "default";
  std::printf(
      "| GPU | model | precision | mode | batch | step ms | tokens/s | model TFLOP/s | MFU (bf16 "
      "peak) | cuBLAS GEMM TFLOP/s | fraction of GEMM |\n|---|---|---|---|---|---|---|---|---|---|"
      "---|\n");
  std::printf("| %s | %s | %s | %s | %d x %d | %.1f | %.0f | %.1f | %.3f | %.1f | %.3f |\n",
              props.name, model.Describe().c_str(), precision.c_str(), mode, n, config.context,
              step_ms, tokens / (step_ms * 1e-3), tflops, tflops / kH200Bf16PeakTflops, *gemm,
              tflops / *gemm);
  std::printf("loss %.4f after the first step, %.4f after the last; %.0f MiB of device memory "
              "in use; batch in %s host memory\n",
              first_loss, last_loss, (total_bytes - free_bytes) / 1048576.0,
              (*step)->pinned() ? "pinned" : "ordinary");
  const std::string phases_json = PrintPhases(phases, precision, step_ms);
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream(path) << "{\"gpu\": \"" << props.name << "\", \"model\": \"" << model.Describe()
                        << "\", \"params\": " << model.num_params() << ", \"precision\": \""
                        << precision << "\", \"mode\": \"" << mode << "\", \"batch\": " << n
                        << ", \"micro_batch\": " << micro_batch
                        << ", \"context\": " << config.context << ", \"step_ms\": " << step_ms
                        << ", \"tokens_per_second\": " << tokens / (step_ms * 1e-3)
                        << ", \"model_tflops\": " << tflops
                        << ", \"mfu\": " << tflops / kH200Bf16PeakTflops
                        << ", \"gemm_tflops\": " << *gemm << ", \"first_loss\": " << first_loss
                        << ", \"last_loss\": " << last_loss << ", \"phases_ms\": {" << phases_json
                        << "}}\n";
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = Run(); !s.ok()) {
    std::fprintf(stderr, "gpu_gpt_step_bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
