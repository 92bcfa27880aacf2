// GPU training-step benchmark of the GPU worker's step (worker/cuda/gpu_step.h): one GPU, the
// MLP family of the reference workload at a size that fills an H200, SGD with momentum; each
// step copies its batch from pinned host memory, as in training. Modes: the default step, or
// deterministic mode (fixed-point sums per micro-shard). Prints a table and writes JSON;
// bench/torch/gpu_mlp_step.py measures PyTorch eager on the same model and tests/gpu/check.sh
// puts the two side by side.
//   mlp_step_bench [--dims=784,8192,8192,10] [--batch=8192] [--steps=50] [--tf32]
//                  [--deterministic --micro_shards=8] [--micro_batch=N] [--json=F]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/gpu/bench_step.h"
#include "bench/gpu/gemm_rate.h"
#include "common/status_macros.h"
#include "kernels/gpu_check.h"
#include "worker/cuda/gpu_step.h"
#include "worker/model/mlp.h"
#include "worker/step/optimizer.h"

ABSL_FLAG(std::string, dims, "784,8192,8192,10", "layer widths, input first");
ABSL_FLAG(int, batch, 8192, "samples per step");
ABSL_FLAG(int, steps, 50, "timed steps (after 5 warm-up steps)");
ABSL_FLAG(bool, tf32, false, "TF32 tensor cores for the FP32 products");
ABSL_FLAG(bool, deterministic, false, "deterministic mode (fixed-point sums per micro-shard)");
ABSL_FLAG(int, micro_shards, 8, "micro-shards of the batch (deterministic mode)");
ABSL_FLAG(int, micro_batch, 0, "samples per forward/backward (gradient accumulation); 0: all");
ABSL_FLAG(std::string, json, "", "write the results here as JSON");

namespace {

using lockstep::worker::GpuStep;

absl::Status Run() {
  std::vector<int> dims;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_dims), ',')) {
    int d = 0;
    if (!absl::SimpleAtoi(part, &d) || d <= 0) return absl::InvalidArgumentError("--dims");
    dims.push_back(d);
  }
  const int n = absl::GetFlag(FLAGS_batch), steps = absl::GetFlag(FLAGS_steps);
  const bool tf32 = absl::GetFlag(FLAGS_tf32);
  const bool deterministic = absl::GetFlag(FLAGS_deterministic);
  const int shards = absl::GetFlag(FLAGS_micro_shards);
  const int micro_batch =
      absl::GetFlag(FLAGS_micro_batch) > 0 ? absl::GetFlag(FLAGS_micro_batch) : n;
  if (deterministic && (shards <= 0 || n % shards != 0)) {
    return absl::InvalidArgumentError("--micro_shards must divide --batch");
  }
  lockstep::v1::JobSpec spec;
  spec.mutable_model()->set_type("mlp");
  spec.mutable_optimizer()->set_type("sgd");
  spec.mutable_optimizer()->set_learning_rate(0.01);
  spec.mutable_optimizer()->set_momentum(0.9);
  spec.set_global_batch_size(n);
  spec.set_micro_shards(shards);
  spec.set_deterministic(deterministic);
  spec.set_precision(tf32 ? "tf32" : "fp32");
  // The worker's engine over a host model and optimizer, as a GPU worker runs it.
  lockstep::worker::Mlp model(dims, lockstep::kernels::Activation::kRelu);
  model.Initialize(1);
  lockstep::worker::Optimizer optimizer(spec.optimizer(), model.segments(), steps + 6);
  auto step = GpuStep::Create(spec, lockstep::worker::SampleLayout{dims.front(), 0}, &model,
                              &optimizer);
  if (!step.ok()) return step.status();
  LOCKSTEP_RETURN_IF_ERROR((*step)->Begin({}));
  auto batch = (*step)->HostBuffers(n);
  if (!batch.ok()) return batch.status();
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < static_cast<size_t>(n) * dims.front(); ++i) batch->features[i] = normal(rng);
  for (int i = 0; i < n; ++i) batch->labels[i] = static_cast<int32_t>(rng() % dims.back());

  lockstep::worker::StepArgs args =
      lockstep::bench::BenchStepArgs(n, micro_batch, deterministic, shards);
  args.lr = 0.01f;
  double loss = 0;
  auto one_step = [&]() -> absl::Status {
    ++args.step;
    auto r = (*step)->TakeStep(args);
    if (!r.ok()) return r.status();
    if (r->rejected != 0) return absl::OutOfRangeError("fixed-point range exceeded");
    loss = r->loss;
    return absl::OkStatus();
  };
  for (int i = 0; i < 5; ++i) {
    LOCKSTEP_RETURN_IF_ERROR(one_step());
  }
  // Each step ends with the loss read back (the worker reports it), so wall time is GPU time.
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    LOCKSTEP_RETURN_IF_ERROR(one_step());
  }
  const double step_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
      steps;
  LOCKSTEP_RETURN_IF_ERROR((*step)->End());

  // FLOPs of a step: forward, weight gradient and input gradient (none for the first layer).
  double flops = 0;
  for (size_t l = 0; l + 1 < dims.size(); ++l) {
    const double mnk = 2.0 * n * dims[l] * dims[l + 1];
    flops += (l == 0 ? 2 : 3) * mnk;
  }
  // The GEMM rate this GPU reaches on one large product of the same precision.
  absl::StatusOr<double> gemm = lockstep::bench::GemmTflops(tf32 ? "tf32" : "fp32");
  if (!gemm.ok()) return gemm.status();
  const double gemm_tflops = *gemm;
  const double step_tflops = flops / (step_ms * 1e-3) / 1e12;

  cudaDeviceProp props{};
  cudaGetDeviceProperties(&props, 0);
  const char* mode = deterministic ? "deterministic" : micro_batch < n ? "accumulate" : "default";
  std::printf(
      "| GPU | precision | mode | step ms | samples/s | model TFLOP/s | cuBLAS GEMM TFLOP/s | "
      "fraction |\n|---|---|---|---|---|---|---|---|\n");
  std::printf("| %s | %s | %s | %.2f | %.0f | %.1f | %.1f | %.2f |\n", props.name,
              tf32 ? "tf32" : "fp32", mode, step_ms, n / (step_ms * 1e-3), step_tflops, gemm_tflops,
              step_tflops / gemm_tflops);
  std::printf("final loss %.4f, batch in %s host memory\n", loss,
              (*step)->pinned() ? "pinned" : "ordinary");
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream(path) << "{\"gpu\": \"" << props.name << "\", \"precision\": \""
                        << (tf32 ? "tf32" : "fp32") << "\", \"mode\": \"" << mode
                        << "\", \"micro_batch\": " << micro_batch << ", \"dims\": \""
                        << absl::GetFlag(FLAGS_dims) << "\", \"batch\": " << n
                        << ", \"step_ms\": " << step_ms
                        << ", \"samples_per_second\": " << n / (step_ms * 1e-3)
                        << ", \"model_tflops\": " << step_tflops
                        << ", \"gemm_tflops\": " << gemm_tflops << "}\n";
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = Run(); !s.ok()) {
    std::fprintf(stderr, "mlp_step_bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
