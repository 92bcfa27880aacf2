// GPU training-step benchmark of Lockstep's GPU model (worker/train/gpu_mlp.h): one GPU, the
// MLP family of the reference workload at a size that fills an H200, SGD with momentum. Prints
// a table and writes JSON; bench/torch/gpu_mlp_step.py measures PyTorch eager on the same model
// and tests/gpu/check.sh puts the two side by side.
//   mlp_step_bench [--dims=784,8192,8192,10] [--batch=8192] [--steps=50] [--tf32] [--json=F]
#include <cuda_runtime.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/gpu_check.h"
#include "worker/train/gpu_mlp.h"

ABSL_FLAG(std::string, dims, "784,8192,8192,10", "layer widths, input first");
ABSL_FLAG(int, batch, 8192, "samples per step");
ABSL_FLAG(int, steps, 50, "timed steps (after 5 warm-up steps)");
ABSL_FLAG(bool, tf32, false, "TF32 tensor cores for the FP32 products");
ABSL_FLAG(std::string, json, "", "write the results here as JSON");

namespace {

using lockstep::worker::GpuMlp;
namespace cuda = lockstep::kernels::cuda;

absl::Status Run() {
  std::vector<int> dims;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_dims), ',')) {
    int d = 0;
    if (!absl::SimpleAtoi(part, &d) || d <= 0) return absl::InvalidArgumentError("--dims");
    dims.push_back(d);
  }
  const int n = absl::GetFlag(FLAGS_batch), steps = absl::GetFlag(FLAGS_steps);
  const bool tf32 = absl::GetFlag(FLAGS_tf32);
  cudaStream_t stream;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamCreate(&stream));
  auto mlp = GpuMlp::Create(dims, lockstep::kernels::Activation::kRelu, stream);
  if (!mlp.ok()) return mlp.status();
  if (absl::Status s = (*mlp)->blas().SetTf32(tf32); !s.ok()) return s;
  {
    lockstep::worker::Mlp init(dims, lockstep::kernels::Activation::kRelu);
    init.Initialize(1);
    if (absl::Status s = (*mlp)->UploadParams(init.params()); !s.ok()) return s;
  }
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(n) * dims.front());
  for (float& v : x) v = normal(rng);
  std::vector<int32_t> y(n);
  for (int i = 0; i < n; ++i) y[i] = static_cast<int32_t>(rng() % dims.back());
  float *dx, *momentum;
  int32_t* dy;
  const size_t params = (*mlp)->num_params();
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&dx, x.size() * sizeof(float)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&dy, y.size() * sizeof(int32_t)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&momentum, params * sizeof(float)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemset(momentum, 0, params * sizeof(float)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      cudaMemcpy(dy, y.data(), y.size() * sizeof(int32_t), cudaMemcpyHostToDevice));

  auto step = [&]() -> absl::Status {
    if (absl::Status s = (*mlp)->ForwardBackward(dx, dy, n, 1.0f / n, size_t{1} << 30, nullptr, false);
        !s.ok()) {
      return s;
    }
    return cuda::SgdMomentumUpdate((*mlp)->params(), (*mlp)->grads(), momentum, params, 0.01f, 0.9f,
                                   0.0f, stream);
  };
  for (int i = 0; i < 5; ++i) {
    if (absl::Status s = step(); !s.ok()) return s;
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventRecord(start, stream));
  for (int i = 0; i < steps; ++i) {
    if (absl::Status s = step(); !s.ok()) return s;
  }
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventSynchronize(stop));
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  const double step_ms = ms / steps;
  auto loss = (*mlp)->LossSum();
  if (!loss.ok()) return loss.status();

  // FLOPs of a step: forward, weight gradient and input gradient (none for the first layer).
  double flops = 0;
  for (size_t l = 0; l + 1 < dims.size(); ++l) {
    const double mnk = 2.0 * n * dims[l] * dims[l + 1];
    flops += (l == 0 ? 2 : 3) * mnk;
  }
  // The GEMM rate this GPU reaches on one large product of the same precision.
  const int g = 8192;
  float *a, *b, *c;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&a, size_t{g} * g * sizeof(float)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&b, size_t{g} * g * sizeof(float)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&c, size_t{g} * g * sizeof(float)));
  // Random operands: all-zero matrices draw less power and would run faster than real ones.
  {
    std::vector<float> host(size_t{g} * g);
    for (float& v : host) v = normal(rng);
    LOCKSTEP_GPU_RETURN_IF_ERROR(
        cudaMemcpy(a, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
    LOCKSTEP_GPU_RETURN_IF_ERROR(
        cudaMemcpy(b, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  for (int i = 0; i < 3; ++i) {
    if (absl::Status s = (*mlp)->blas().Gemm(false, false, g, g, g, 1, a, g, b, g, 0, c, g);
        !s.ok()) {
      return s;
    }
  }
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventRecord(start, stream));
  for (int i = 0; i < 10; ++i) {
    if (absl::Status s = (*mlp)->blas().Gemm(false, false, g, g, g, 1, a, g, b, g, 0, c, g);
        !s.ok()) {
      return s;
    }
  }
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventSynchronize(stop));
  float gemm_ms = 0;
  cudaEventElapsedTime(&gemm_ms, start, stop);
  const double gemm_tflops = 2.0 * g * g * g / (gemm_ms / 10 * 1e-3) / 1e12;
  const double step_tflops = flops / (step_ms * 1e-3) / 1e12;

  cudaDeviceProp props{};
  cudaGetDeviceProperties(&props, 0);
  std::printf(
      "| GPU | precision | step ms | samples/s | model TFLOP/s | cuBLAS GEMM TFLOP/s | "
      "fraction |\n|---|---|---|---|---|---|---|\n");
  std::printf("| %s | %s | %.2f | %.0f | %.1f | %.1f | %.2f |\n", props.name,
              tf32 ? "tf32" : "fp32", step_ms, n / (step_ms * 1e-3), step_tflops, gemm_tflops,
              step_tflops / gemm_tflops);
  std::printf("final loss %.4f\n", *loss / n);
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream(path) << "{\"gpu\": \"" << props.name << "\", \"precision\": \""
                        << (tf32 ? "tf32" : "fp32") << "\", \"dims\": \""
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
