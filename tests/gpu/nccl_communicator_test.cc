// The NCCL communicator on one GPU (label gpu; skipped without a device): a one-rank group
// initializes through the store, sums and broadcasts in place, and Abort() ends a Wait() with
// ABORTED. Several ranks need several GPUs (NCCL refuses two ranks on one device); their
// failure handling is exercised with Gloo on CPU in the integration tests.
#include "worker/comm/nccl_communicator.h"

#include <cuda_runtime.h>

#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/local_store.h"

namespace lockstep::worker {
namespace {

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

}  // namespace
}  // namespace lockstep::worker
