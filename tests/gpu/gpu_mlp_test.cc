// The GPU model against the CPU model (label gpu; skipped without a device): same parameters
// and batch give the same loss and gradients (to FP32 rounding of the summation order), and
// the gradient pieces are reported at the same points, which bucketing relies on.
#include "worker/cuda/gpu_mlp.h"

#include <cuda_runtime.h>

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/device_memory.h"
#include "worker/model/mlp.h"

namespace lockstep::worker {
namespace {

// The batch's features and labels in device memory (the caller frees them).
void ToDevice(const std::vector<float>& x, const std::vector<int32_t>& y, float** dx,
              int32_t** dy) {
  ASSERT_EQ(cudaMalloc(dx, x.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(dy, y.size() * sizeof(int32_t)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(*dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(*dy, y.data(), y.size() * sizeof(int32_t), cudaMemcpyHostToDevice),
            cudaSuccess);
}

TEST(GpuMlpTest, MatchesCpuMlpForwardBackward) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no usable GPU";
  // Odd widths, so the layers in the flat buffer are not 16-byte aligned.
  const std::vector<int> dims = {37, 64, 45, 7};
  const int n = 50;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(n) * dims.front());
  for (float& v : x) v = normal(rng);
  std::vector<int32_t> y(n);
  for (int i = 0; i < n; ++i) y[i] = i % dims.back();

  for (kernels::Activation act : {kernels::Activation::kRelu, kernels::Activation::kGelu}) {
    Mlp cpu(dims, act);
    cpu.Initialize(11);
    std::vector<size_t> cpu_points, gpu_points;
    const double cpu_loss = cpu.ForwardBackward(x.data(), y.data(), n, 1.0f / n, 500, nullptr,
                                                [&](size_t end) { cpu_points.push_back(end); });

    auto gpu = GpuMlp::Create(dims, act, nullptr);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    ASSERT_TRUE((*gpu)->UploadParams(cpu.params()).ok());
    float* dx = nullptr;
    int32_t* dy = nullptr;
    ToDevice(x, y, &dx, &dy);
    ASSERT_FALSE(HasFatalFailure());
    ASSERT_TRUE((*gpu)
                    ->ForwardBackward(dx, dy, n, 1.0f / n, 500,
                                      [&](size_t end) { gpu_points.push_back(end); },
                                      /*accumulate=*/false)
                    .ok());
    auto gpu_loss = (*gpu)->LossSum();
    ASSERT_TRUE(gpu_loss.ok()) << gpu_loss.status();
    EXPECT_NEAR(*gpu_loss, cpu_loss, 1e-5 * std::abs(cpu_loss));
    EXPECT_EQ(gpu_points, cpu_points);
    std::vector<float> grads((*gpu)->num_params());
    ASSERT_TRUE((*gpu)->DownloadGrads(grads.data()).ok());
    double diff = 0, norm = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      diff += (double{grads[i]} - cpu.grads()[i]) * (double{grads[i]} - cpu.grads()[i]);
      norm += double{cpu.grads()[i]} * cpu.grads()[i];
    }
    EXPECT_LT(std::sqrt(diff / norm), 1e-5) << "activation " << static_cast<int>(act);

    // Gradient accumulation: a second micro-batch (the first 20 samples) adds its gradient and
    // its loss, on both.
    const int m = 20;
    const double cpu_loss2 =
        cpu.ForwardBackward(x.data(), y.data(), m, 1.0f / n, 500, nullptr, nullptr, true);
    ASSERT_TRUE((*gpu)->ForwardBackward(dx, dy, m, 1.0f / n, 500, nullptr, true).ok());
    gpu_loss = (*gpu)->LossSum();
    ASSERT_TRUE(gpu_loss.ok()) << gpu_loss.status();
    EXPECT_NEAR(*gpu_loss, cpu_loss + cpu_loss2, 1e-5 * std::abs(cpu_loss + cpu_loss2));
    ASSERT_TRUE((*gpu)->DownloadGrads(grads.data()).ok());
    diff = 0;
    norm = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      diff += (double{grads[i]} - cpu.grads()[i]) * (double{grads[i]} - cpu.grads()[i]);
      norm += double{cpu.grads()[i]} * cpu.grads()[i];
    }
    EXPECT_LT(std::sqrt(diff / norm), 1e-5) << "accumulated, activation " << static_cast<int>(act);
    cudaFree(dx);
    cudaFree(dy);
  }
}

// bf16: the products' operand slots are sized before the first product, so a backward
// allocates and frees nothing (a cudaFree waits for the whole device, NCCL's sums of the
// buckets already sent included: a peer that died then would hang the worker). The second
// layer's weight (512 x 8), a backward operand, is larger than any forward operand of its slot.
TEST(GpuMlpTest, Bf16BackwardAllocatesNothing) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no usable GPU";
  const std::vector<int> dims = {16, 512, 8};
  const int n = 4;
  Mlp cpu(dims, kernels::Activation::kRelu);
  cpu.Initialize(3);
  auto gpu = GpuMlp::Create(dims, kernels::Activation::kRelu, nullptr);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ASSERT_TRUE((*gpu)->UploadParams(cpu.params()).ok());
  ASSERT_TRUE((*gpu)->blas().SetPrecision(kernels::cuda::Blas::Precision::kBf16).ok());
  std::vector<float> x(static_cast<size_t>(n) * dims.front(), 0.5f);
  std::vector<int32_t> y = {0, 1, 2, 3};
  float* dx = nullptr;
  int32_t* dy = nullptr;
  ToDevice(x, y, &dx, &dy);
  ASSERT_FALSE(HasFatalFailure());
  std::vector<int64_t> in_use;  // at each piece of the gradient, as backward reports them
  ASSERT_TRUE((*gpu)
                  ->ForwardBackward(
                      dx, dy, n, 1.0f / n, 500,
                      [&](size_t) { in_use.push_back(kernels::cuda::DeviceBytesInUse()); },
                      /*accumulate=*/false)
                  .ok());
  const int64_t after = kernels::cuda::DeviceBytesInUse();
  ASSERT_FALSE(in_use.empty());
  for (int64_t bytes : in_use) EXPECT_EQ(bytes, in_use.front());
  EXPECT_EQ(after, in_use.front());
  cudaFree(dx);
  cudaFree(dy);
}

}  // namespace
}  // namespace lockstep::worker
