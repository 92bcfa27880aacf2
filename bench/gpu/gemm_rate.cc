#include "bench/gpu/gemm_rate.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/gpu_check.h"

namespace lockstep::bench {

// cuBLAS's rate on one large square product in this precision: FP32 or TF32 operands, or
// bf16 operands (already rounded: the raw tensor-core rate) with FP32 sums and output.
absl::StatusOr<double> GemmTflops(const std::string& precision) {
  const int g = 8192;
  cudaStream_t stream;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamCreate(&stream));
  cublasHandle_t handle;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasCreate(&handle));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasSetStream(handle, stream));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasSetMathMode(
      handle, precision == "tf32" ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  const bool bf16 = precision == "bf16";
  const size_t count = size_t{g} * g, bytes = count * (bf16 ? 2 : 4);
  std::vector<float> host(count);
  std::mt19937 rng(4);
  std::normal_distribution<float> normal;
  for (float& v : host) v = normal(rng);  // random: zeros draw less power and run faster
  std::vector<uint16_t> host16(bf16 ? count : 0);
  for (size_t i = 0; i < host16.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &host[i], sizeof(bits));
    host16[i] = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
  }
  const void* source = bf16 ? static_cast<const void*>(host16.data()) : host.data();
  void *a, *b;
  float* c;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&a, bytes));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&b, bytes));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&c, count * sizeof(float)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemcpy(a, source, bytes, cudaMemcpyHostToDevice));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemcpy(b, source, bytes, cudaMemcpyHostToDevice));
  cudaEvent_t start, stop;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventCreate(&start));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventCreate(&stop));
  const float one = 1, zero = 0;
  const cudaDataType_t type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const cublasComputeType_t compute =
      precision == "tf32" ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  for (int i = 0; i < 13; ++i) {
    if (i == 3) LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventRecord(start, stream));
    LOCKSTEP_GPU_RETURN_IF_ERROR(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, g, g, g, &one, a,
                                              type, g, b, type, g, &zero, c, CUDA_R_32F, g,
                                              compute, CUBLAS_GEMM_DEFAULT));
  }
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventSynchronize(stop));
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  cublasDestroy(handle);
  cudaStreamDestroy(stream);
  return 2.0 * g * g * g / (ms / 10 * 1e-3) / 1e12;
}

}  // namespace lockstep::bench
