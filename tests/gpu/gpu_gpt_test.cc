// The GPU GPT against the CPU GPT (label gpu; the comparisons skip without a device): the same
// parameters and tokens give the same loss, gradients and evaluation (to FP32 rounding of the
// summation order), and the gradient pieces are reported at the same points, which bucketing
// relies on.
#include "worker/cuda/gpu_gpt.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "worker/model/gpt.h"

namespace lockstep::worker {
namespace {

double RelativeError(const float* got, const float* want, size_t n, float want_scale = 1.0f) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < n; ++i) {
    const double w = double{want[i]} * want_scale;
    diff += (got[i] - w) * (got[i] - w);
    norm += w * w;
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

// Device memory for the test's tokens, freed however the test ends.
struct DeviceTokens {
  explicit DeviceTokens(const std::vector<int32_t>& host) {
    ok = cudaMalloc(&ptr, host.size() * sizeof(int32_t)) == cudaSuccess &&
         cudaMemcpy(ptr, host.data(), host.size() * sizeof(int32_t), cudaMemcpyHostToDevice) ==
             cudaSuccess;
  }
  ~DeviceTokens() { cudaFree(ptr); }
  int32_t* ptr = nullptr;
  bool ok = false;
};

TEST(GpuGptTest, MatchesCpuGptForwardBackwardAndEvaluate) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no usable GPU";
  // Two layers, two heads of 16, a context that is not a multiple of the attention's tiles,
  // and an LM head in chunks of 64 rows (200 rows: 64, 64, 64 and 8), so the loss sums and
  // wte's gradient are carried across chunks.
  const GptConfig config{/*vocab=*/97, /*context=*/40, /*layers=*/2, /*heads=*/2, /*d_model=*/32};
  const size_t head_chunk_values = size_t{97} * 64;
  const int n = 5, wider = 9, stride = config.context + 1;
  std::mt19937 rng(3);
  std::vector<int32_t> tokens(static_cast<size_t>(wider) * stride);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % config.vocab);
  Gpt cpu(config);
  cpu.Initialize(7);
  Batch batch;
  batch.n = n;
  batch.tokens = tokens.data();
  batch.token_stride = stride;
  std::vector<size_t> cpu_points, gpu_points;
  const double cpu_loss =
      cpu.ForwardBackward(batch, 1.0f / n, std::numeric_limits<size_t>::max(), nullptr,
                          [&](size_t end) { cpu_points.push_back(end); });
  std::vector<float> cpu_grads(cpu.grads(), cpu.grads() + cpu.num_params());

  auto gpu = GpuGpt::Create(cpu, nullptr, head_chunk_values);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ASSERT_TRUE((*gpu)->UploadParams(cpu.params()).ok());
  DeviceTokens device(tokens);
  ASSERT_TRUE(device.ok);
  int32_t* device_tokens = device.ptr;
  ASSERT_TRUE((*gpu)
                  ->ForwardBackward(
                      device_tokens, stride, n, 1.0f / n,
                      [&](size_t end) { gpu_points.push_back(end); },
                      /*accumulate=*/false)
                  .ok());
  auto loss = (*gpu)->LossSum();
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_NEAR(*loss, cpu_loss, 1e-5 * std::abs(cpu_loss));
  EXPECT_EQ(gpu_points, cpu.ready_points());
  EXPECT_EQ(cpu_points, cpu.ready_points()) << "one piece per tensor group on both sides";
  std::vector<float> grads((*gpu)->num_params());
  ASSERT_TRUE((*gpu)->DownloadGrads(grads.data()).ok());
  EXPECT_LT(RelativeError(grads.data(), cpu_grads.data(), grads.size()), 1e-4);
  // Per tensor, so a wrong piece is named.
  for (const Tensor& t : cpu.tensors()) {
    EXPECT_LT(RelativeError(grads.data() + t.offset, cpu_grads.data() + t.offset, t.count), 1e-3)
        << t.name;
  }

  // Accumulating the same batch again doubles every gradient and the loss sum.
  ASSERT_TRUE(
      (*gpu)
          ->ForwardBackward(device_tokens, stride, n, 1.0f / n, nullptr, /*accumulate=*/true)
          .ok());
  ASSERT_TRUE((*gpu)->DownloadGrads(grads.data()).ok());
  EXPECT_LT(RelativeError(grads.data(), cpu_grads.data(), grads.size(), 2.0f), 1e-4);
  loss = (*gpu)->LossSum();
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_NEAR(*loss, 2 * cpu_loss, 2e-5 * std::abs(cpu_loss));

  int64_t cpu_correct = 0, gpu_correct = 0;
  const double cpu_eval = cpu.Evaluate(batch, &cpu_correct);
  auto gpu_eval = (*gpu)->Evaluate(device_tokens, stride, n, &gpu_correct);
  ASSERT_TRUE(gpu_eval.ok()) << gpu_eval.status();
  EXPECT_NEAR(*gpu_eval, cpu_eval, 1e-5 * std::abs(cpu_eval));
  EXPECT_NEAR(*gpu_eval, cpu_loss, 1e-5 * std::abs(cpu_loss)) << "the same forward";
  // An argmax may flip between two logits within rounding of each other: at most one here.
  EXPECT_LE(std::abs(gpu_correct - cpu_correct), 1) << gpu_correct << " vs " << cpu_correct;
  auto after = (*gpu)->LossSum();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(*after, *loss) << "Evaluate keeps the training loss";

  // More windows than before: the activations grow.
  Batch all = batch;
  all.n = wider;
  int64_t cpu_all_correct = 0, gpu_all_correct = 0;
  const double cpu_all = cpu.Evaluate(all, &cpu_all_correct);
  auto gpu_all = (*gpu)->Evaluate(device_tokens, stride, wider, &gpu_all_correct);
  ASSERT_TRUE(gpu_all.ok()) << gpu_all.status();
  EXPECT_NEAR(*gpu_all, cpu_all, 1e-5 * std::abs(cpu_all));
  EXPECT_LE(std::abs(gpu_all_correct - cpu_all_correct), 1);
  EXPECT_TRUE(absl::IsInvalidArgument(
      (*gpu)->ForwardBackward(device_tokens, config.context, n, 1.0f, nullptr, false)))
      << "windows one token short";
}

// Precision bf16 (products on tensor cores, bf16 activations, the forward's bias and GELU in
// cuBLASLt's epilogue, tensor-core attention) against the CPU GPT in FP32: close to bf16's
// precision, per tensor too, so a wrong epilogue, transpose or bias shows as an O(1) error. A
// width that is a multiple of 8 (every epilogue applies) and one that is not (half the bf16
// biases then sit off 16-byte alignment and take the kernels' path; heads of 12, loaded
// element by element).
TEST(GpuGptTest, Bf16IsCloseToTheCpuInFp32) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no usable GPU";
  for (const GptConfig& config : {GptConfig{/*vocab=*/97, /*context=*/70, /*layers=*/2,
                                            /*heads=*/2, /*d_model=*/64},
                                  GptConfig{/*vocab=*/61, /*context=*/33, /*layers=*/2,
                                            /*heads=*/3, /*d_model=*/36}}) {
    SCOPED_TRACE(config.d_model);
    const int n = 4, stride = config.context + 1;
    std::mt19937 rng(5);
    std::vector<int32_t> tokens(static_cast<size_t>(n) * stride);
    for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % config.vocab);
    Gpt cpu(config);
    cpu.Initialize(11);
    Batch batch;
    batch.n = n;
    batch.tokens = tokens.data();
    batch.token_stride = stride;
    const double cpu_loss =
        cpu.ForwardBackward(batch, 1.0f / n, std::numeric_limits<size_t>::max(), nullptr, nullptr);
    std::vector<float> cpu_grads(cpu.grads(), cpu.grads() + cpu.num_params());
    auto gpu = GpuGpt::Create(cpu, nullptr);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    ASSERT_TRUE((*gpu)->blas().SetPrecision(kernels::cuda::Blas::Precision::kBf16).ok());
    ASSERT_TRUE((*gpu)->UploadParams(cpu.params()).ok());
    DeviceTokens device(tokens);
    ASSERT_TRUE(device.ok);
    ASSERT_TRUE((*gpu)->ForwardBackward(device.ptr, stride, n, 1.0f / n, nullptr, false).ok());
    auto loss = (*gpu)->LossSum();
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_NEAR(*loss, cpu_loss, 1e-2 * std::abs(cpu_loss));
    std::vector<float> grads((*gpu)->num_params());
    ASSERT_TRUE((*gpu)->DownloadGrads(grads.data()).ok());
    EXPECT_LT(RelativeError(grads.data(), cpu_grads.data(), grads.size()), 5e-2);
    for (const Tensor& t : cpu.tensors()) {
      EXPECT_LT(RelativeError(grads.data() + t.offset, cpu_grads.data() + t.offset, t.count),
                0.15)
          << t.name;
    }
    int64_t cpu_correct = 0, gpu_correct = 0;
    const double cpu_eval = cpu.Evaluate(batch, &cpu_correct);
    auto gpu_eval = (*gpu)->Evaluate(device.ptr, stride, n, &gpu_correct);
    ASSERT_TRUE(gpu_eval.ok()) << gpu_eval.status();
    EXPECT_NEAR(*gpu_eval, cpu_eval, 1e-2 * std::abs(cpu_eval));
  }
}

// Refused before any device work, so this runs without a GPU too.
TEST(GpuGptTest, RefusesHeadsLargerThanTheAttentionKernelTakes) {
  Gpt wide(GptConfig{/*vocab=*/10, /*context=*/4, /*layers=*/1, /*heads=*/2, /*d_model=*/512});
  auto gpu = GpuGpt::Create(wide, nullptr);
  ASSERT_FALSE(gpu.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(gpu.status())) << gpu.status();
  EXPECT_NE(gpu.status().message().find("256"), std::string::npos) << gpu.status();
}

}  // namespace
}  // namespace lockstep::worker
