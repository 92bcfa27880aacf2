// The NCCL communicator on one GPU (label gpu; skipped without a device): a one-rank group
// initializes through the store, sums and broadcasts in place, and Abort() ends a Wait() with
// ABORTED. Two ranks on the one GPU (threads of this process): with NCCL 2.30.3 or later and
// NCCL_MULTI_RANK_GPU_ENABLE=1 they sum and broadcast; with an older NCCL both get the clear
// refusal that names what is needed. It prints which one it saw ("several ranks on one GPU:
// allowed" or "refused"), which tests/gpu/check.sh reads to decide on its multi-rank jobs.
#include "worker/cuda/nccl_communicator.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <iostream>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/testing/local_store.h"

namespace lockstep::worker {
namespace {

// Before main: NCCL reads its variables once, at its first use in the process.
const bool kSharedGpuVariable = setenv(kNcclSharedGpuVariable, "1", /*overwrite=*/1) == 0;

TEST(NcclCommunicatorTest, OneRankGroupSumsAndAborts) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no usable GPU";
  coordinator::BootstrapStore store;
  const coordinator::StoreScope scope{"job-1", 1};
  store.Open(scope);
  testing::LocalStoreClient client(&store, scope);
  auto comm = NcclCommunicator::Create(client, 0, 1, {});
  ASSERT_TRUE(comm.ok()) << comm.status();
  std::vector<float> host = {1.5f, -2.0f, 3.25f};
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, host.size() * sizeof(float)), cudaSuccess);
  cudaMemcpy(device, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice);
  ASSERT_TRUE((*comm)->AllreduceSum(device, host.size()).ok());
  ASSERT_TRUE((*comm)->Broadcast(device, host.size() * sizeof(float), 0).ok());
  ASSERT_TRUE((*comm)->Wait().ok());
  std::vector<float> back(host.size());
  cudaMemcpy(back.data(), device, back.size() * sizeof(float), cudaMemcpyDeviceToHost);
  EXPECT_EQ(back, host);  // a sum over one rank is the identity
  (*comm)->Abort();
  ASSERT_TRUE((*comm)->AllreduceSum(device, host.size()).ok());
  EXPECT_EQ((*comm)->Wait().code(), absl::StatusCode::kAborted);
  cudaFree(device);
}

TEST(NcclCommunicatorTest, TwoRanksOnOneGpu) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no usable GPU";
  ASSERT_TRUE(kSharedGpuVariable);
  const int version = NcclRuntimeVersion();
  coordinator::BootstrapStore store;
  const coordinator::StoreScope scope{"job-1", 1};
  store.Open(scope);
  NcclCommunicator::Options options;
  options.init_timeout = absl::Seconds(60);
  options.collective_timeout = absl::Seconds(60);
  absl::Status status[2];
  std::vector<float> result[2];
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      cudaSetDevice(0);  // the current device is per thread
      testing::LocalStoreClient client(&store, scope);
      auto comm = NcclCommunicator::Create(client, rank, 2, options);
      if (!comm.ok()) {
        status[rank] = comm.status();
        return;
      }
      // Rank r holds {r + 1, 10 (r + 1)}: the sum is {3, 30}; then rank 1's {7, 8} to all.
      std::vector<float> host = {rank + 1.0f, 10.0f * (rank + 1)};
      float* device = nullptr;
      cudaMalloc(&device, 4 * sizeof(float));
      cudaMemcpy(device, host.data(), 2 * sizeof(float), cudaMemcpyHostToDevice);
      const float mine[2] = {7.0f, 8.0f};
      if (rank == 1) cudaMemcpy(device + 2, mine, sizeof(mine), cudaMemcpyHostToDevice);
      status[rank] = (*comm)->AllreduceSum(device, 2);
      if (status[rank].ok()) status[rank] = (*comm)->Broadcast(device + 2, 2 * sizeof(float), 1);
      if (status[rank].ok()) status[rank] = (*comm)->Wait();
      result[rank].resize(4);
      cudaMemcpy(result[rank].data(), device, 4 * sizeof(float), cudaMemcpyDeviceToHost);
      cudaFree(device);
    });
  }
  for (std::thread& t : ranks) t.join();
  // What happened decides (the first NCCL that allows it is this project's reading of NCCL's
  // notes); check.sh reads the line to decide on its multi-rank jobs.
  const bool allowed = status[0].ok() && status[1].ok();
  std::cout << "NCCL " << NcclVersionName(version) << ": several ranks on one GPU: "
            << (allowed ? "allowed" : "refused") << std::endl;
  if (version >= kNcclSharedGpuVersion) {
    EXPECT_TRUE(allowed) << "NCCL " << NcclVersionName(version);
  }
  if (allowed) {
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(result[rank], (std::vector<float>{3.0f, 30.0f, 7.0f, 8.0f})) << "rank " << rank;
    }
    return;
  }
  // The refusal says what is missing, in the worker's words, in the error of a rank that NCCL
  // refused; the other may fail of its peer's abort instead (NCCL's last error is one text for
  // the process, and its words decide), but it fails.
  int told = 0;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_FALSE(status[rank].ok()) << "rank " << rank;
    if (status[rank].code() == absl::StatusCode::kFailedPrecondition &&
        absl::StrContains(status[rank].message(), "NCCL_MULTI_RANK_GPU_ENABLE")) {
      ++told;
    }
  }
  EXPECT_GE(told, 1) << status[0] << " | " << status[1];
}

}  // namespace
}  // namespace lockstep::worker
