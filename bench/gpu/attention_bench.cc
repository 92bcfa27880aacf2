// Causal attention alone, at the GPT step benchmark's shape by default (16 sequences of 1024
// tokens, 12 heads of 64): the worker's kernels (kernels/cuda_transformer.h) on bf16 q/k/v
// (the tensor-core flash kernels of precision bf16) and on FP32 q/k/v (the CUDA-core ones),
// forward and forward + backward. Prints a table and writes JSON: milliseconds and TFLOP/s,
// counted as FlashAttention's benchmark counts them (forward 4 B H T^2 hs / 2 for the causal
// half, backward 2.5 times the forward). bench/torch/gpu_attention.py is PyTorch's
// scaled_dot_product_attention at the same shape; tests/gpu/check.sh puts them side by side.
//   attention_bench [--batch=16 --heads=12 --head_size=64 --context=1024] [--iters=20]
//                   [--json=F]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda_transformer.h"
#include "kernels/gpu_check.h"

ABSL_FLAG(int, batch, 16, "sequences");
ABSL_FLAG(int, heads, 12, "attention heads");
ABSL_FLAG(int, head_size, 64, "channels per head");
ABSL_FLAG(int, context, 1024, "tokens per sequence");
ABSL_FLAG(int, iters, 20, "timed iterations (after 3 warm-up ones)");
ABSL_FLAG(std::string, json, "", "write the results here as JSON");

namespace {

namespace cuda = lockstep::kernels::cuda;

struct Timing {
  double forward_ms = 0, backward_ms = 0;  // backward alone: forward + backward minus forward
};

// Device buffers of one precision: q/k/v and the output in T (float or Bf16), the rest FP32.
template <typename T>
struct Buffers {
  T* qkv = nullptr;
  T* out = nullptr;
  float *lse = nullptr, *dout = nullptr, *dqkv = nullptr;
};

template <typename T>
absl::StatusOr<Timing> Time(int b, int h, int hs, int t, int iters) {
  const int c = h * hs;
  const size_t rows = static_cast<size_t>(b) * t;
  std::vector<float> host(rows * 3 * c);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (float& v : host) v = normal(rng);
  std::vector<T> typed(host.size());
  for (size_t i = 0; i < host.size(); ++i) {
    if constexpr (std::is_same_v<T, float>) {
      typed[i] = host[i];
    } else {
      uint32_t bits;
      std::memcpy(&bits, &host[i], sizeof(bits));
      typed[i].bits = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
    }
  }
  Buffers<T> d;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&d.qkv, typed.size() * sizeof(T)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&d.out, rows * c * sizeof(T)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&d.lse, static_cast<size_t>(b) * h * t * 4));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&d.dout, rows * c * sizeof(float)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&d.dqkv, rows * 3 * c * sizeof(float)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      cudaMemcpy(d.qkv, typed.data(), typed.size() * sizeof(T), cudaMemcpyHostToDevice));
  // dO: the first rows * c of the same normal values.
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      cudaMemcpy(d.dout, host.data(), rows * c * sizeof(float), cudaMemcpyHostToDevice));
  cudaStream_t stream;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventCreate(&start));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventCreate(&stop));
  auto run = [&](bool backward) -> absl::StatusOr<double> {
    for (int i = 0; i < 3 + iters; ++i) {
      if (i == 3) LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventRecord(start, stream));
      LOCKSTEP_RETURN_IF_ERROR(
          cuda::CausalAttentionForward(d.qkv, b, t, c, h, d.out, d.lse, stream));
      if (backward) {
        LOCKSTEP_RETURN_IF_ERROR(cuda::CausalAttentionBackward(d.dout, d.qkv, d.out, d.lse, b, t,
                                                               c, h, d.dqkv, stream));
      }
    }
    LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
    LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventSynchronize(stop));
    float ms = 0;
    LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
    return ms / iters;
  };
  absl::StatusOr<double> forward = run(false);
  absl::StatusOr<double> both = forward.ok() ? run(true) : forward;
  cudaFree(d.qkv);
  cudaFree(d.out);
  cudaFree(d.lse);
  cudaFree(d.dout);
  cudaFree(d.dqkv);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  if (!both.ok()) return both.status();
  return Timing{*forward, *both - *forward};
}

absl::Status Run() {
  const int b = absl::GetFlag(FLAGS_batch), h = absl::GetFlag(FLAGS_heads);
  const int hs = absl::GetFlag(FLAGS_head_size), t = absl::GetFlag(FLAGS_context);
  const int iters = absl::GetFlag(FLAGS_iters);
  if (b <= 0 || h <= 0 || hs <= 0 || t <= 0 || iters <= 0) {
    return absl::InvalidArgumentError("--batch, --heads, --head_size, --context, --iters > 0");
  }
  absl::StatusOr<Timing> bf16 = Time<cuda::Bf16>(b, h, hs, t, iters);
  if (!bf16.ok()) return bf16.status();
  absl::StatusOr<Timing> fp32 = Time<float>(b, h, hs, t, iters);
  if (!fp32.ok()) return fp32.status();
  const double forward_flops = 4.0 * b * h * static_cast<double>(t) * t * hs / 2;
  const double backward_flops = 2.5 * forward_flops;
  auto tflops = [](double flops, double ms) { return flops / (ms * 1e-3) / 1e12; };
  cudaDeviceProp props{};
  cudaGetDeviceProperties(&props, 0);
  std::printf("| GPU | kernels | shape | forward ms | forward TFLOP/s | backward ms | backward "
              "TFLOP/s |\n|---|---|---|---|---|---|---|\n");
  const std::string shape = absl::StrCat(b, "x", t, ", ", h, " heads of ", hs);
  for (const auto& [name, r] : {std::pair<const char*, Timing>{"bf16 tensor cores", *bf16},
                                std::pair<const char*, Timing>{"fp32 CUDA cores", *fp32}}) {
    std::printf("| %s | %s | %s | %.3f | %.1f | %.3f | %.1f |\n", props.name, name, shape.c_str(),
                r.forward_ms, tflops(forward_flops, r.forward_ms), r.backward_ms,
                tflops(backward_flops, r.backward_ms));
  }
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream(path) << "{\"gpu\": \"" << props.name << "\", \"batch\": " << b
                        << ", \"heads\": " << h << ", \"head_size\": " << hs
                        << ", \"context\": " << t << ", \"bf16_forward_ms\": " << bf16->forward_ms
                        << ", \"bf16_backward_ms\": " << bf16->backward_ms
                        << ", \"bf16_forward_tflops\": " << tflops(forward_flops, bf16->forward_ms)
                        << ", \"bf16_backward_tflops\": "
                        << tflops(backward_flops, bf16->backward_ms)
                        << ", \"fp32_forward_ms\": " << fp32->forward_ms
                        << ", \"fp32_backward_ms\": " << fp32->backward_ms << "}\n";
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = Run(); !s.ok()) {
    std::fprintf(stderr, "attention_bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
