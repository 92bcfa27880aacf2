// Distribution of the NCCL id through the bootstrap store, which needs NCCL but no GPU (runs in
// CI): every rank of a generation gets rank 0's id, a rank waits a bounded time for it, an abort
// ends the wait, a store error keeps its code (the generation ended: ABORTED, not a timeout),
// and a generation's scope never hands an old generation's id to a new one. Also what a user is
// told when NCCL refuses several ranks on one GPU, and the run-time version's name.
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/local_store.h"
#include "worker/cuda/nccl_communicator.h"

namespace lockstep::worker {
namespace {

using testing::LocalStoreClient;

const coordinator::StoreScope kScope{"job-1", 1};

TEST(NcclIdTest, EveryRankGetsRankZerosId) {
  coordinator::BootstrapStore store;
  store.Open(kScope);
  const int world = 4;
  std::vector<absl::StatusOr<ncclUniqueId>> ids(world, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  // Ranks 1..3 start first and wait; rank 0 publishes last.
  for (int r = world - 1; r >= 0; --r) {
    threads.emplace_back([&, r] {
      LocalStoreClient client(&store, kScope);
      ids[r] = ExchangeNcclId(client, r, absl::Seconds(20));
    });
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(ids[r].ok()) << "rank " << r << ": " << ids[r].status();
    EXPECT_EQ(0, std::memcmp(ids[r]->internal, ids[0]->internal, sizeof(ncclUniqueId)))
        << "rank " << r;
  }
  bool nonzero = false;
  for (char c : ids[0]->internal) nonzero |= c != 0;
  EXPECT_TRUE(nonzero) << "ncclGetUniqueId gave an empty id";
}

TEST(NcclIdTest, MissingRankZeroTimesOutNamingTheKey) {
  coordinator::BootstrapStore store;
  store.Open(kScope);
  LocalStoreClient client(&store, kScope);
  absl::StatusOr<ncclUniqueId> id = ExchangeNcclId(client, 1, absl::Milliseconds(300));
  EXPECT_EQ(id.status().code(), absl::StatusCode::kDeadlineExceeded) << id.status();
  EXPECT_NE(id.status().message().find(kNcclIdKey), std::string::npos) << id.status();
}

// A coordinator abort ends the wait for a missing rank 0 at once, not at the timeout (a minute
// here: an abort that did not work would end in DEADLINE_EXCEEDED, which fails the test).
TEST(NcclIdTest, AbortEndsTheWaitForRankZero) {
  coordinator::BootstrapStore store;
  store.Open(kScope);
  auto abort = std::make_shared<AbortSignal>();
  LocalStoreClient client(&store, kScope, abort);
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    abort->Raise();
  });
  absl::StatusOr<ncclUniqueId> id = ExchangeNcclId(client, 1, absl::Seconds(60));
  aborter.join();
  EXPECT_EQ(id.status().code(), absl::StatusCode::kAborted) << id.status();
  EXPECT_NE(id.status().message().find("NCCL id"), std::string::npos) << id.status();
}

// The generation ends while rank 1 waits (the coordinator closes its scope): the wait ends with
// the store's ABORTED, at once, and is not mistaken for a slow rank 0.
TEST(NcclIdTest, AnEndedGenerationIsAbortedNotATimeout) {
  coordinator::BootstrapStore store;
  store.Open(kScope);
  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    store.Close(kScope);
  });
  LocalStoreClient client(&store, kScope);
  absl::StatusOr<ncclUniqueId> id = ExchangeNcclId(client, 1, absl::Seconds(60));
  closer.join();
  EXPECT_EQ(id.status().code(), absl::StatusCode::kAborted) << id.status();
  EXPECT_NE(id.status().message().find("generation 1"), std::string::npos) << id.status();
}

TEST(NcclIdTest, AnOldGenerationsIdIsNotSeenByTheNextGeneration) {
  coordinator::BootstrapStore store;
  const coordinator::StoreScope g1{"job-1", 1}, g2{"job-1", 2};
  store.Open(g1);
  store.Open(g2);
  LocalStoreClient first(&store, g1), second(&store, g2);
  ASSERT_TRUE(ExchangeNcclId(first, 0, absl::Seconds(5)).ok());
  absl::StatusOr<ncclUniqueId> late = ExchangeNcclId(second, 1, absl::Milliseconds(200));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
}

TEST(NcclIdTest, NamesVersionsAsNcclDoes) {
  EXPECT_EQ(NcclVersionName(23003), "2.30.3");
  EXPECT_EQ(NcclVersionName(22809), "2.28.9");
  EXPECT_EQ(NcclVersionName(2708), "2.7.8");  // the old encoding
  EXPECT_EQ(NcclVersionName(NcclRuntimeVersion()).substr(0, 2), "2.") << "the loaded NCCL";
}

TEST(NcclIdTest, SaysWhatSeveralRanksOnOneGpuNeed) {
  const std::string refusal = "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1d000";
  // Too old: names the loaded version, the one needed and the variable.
  const std::string old = SharedGpuAdvice(refusal, 22809, /*variable_set=*/true);
  EXPECT_NE(old.find("NCCL 2.28.9 refuses"), std::string::npos) << old;
  EXPECT_NE(old.find("2.30.3 or later"), std::string::npos) << old;
  EXPECT_NE(old.find("NCCL_MULTI_RANK_GPU_ENABLE=1"), std::string::npos) << old;
  // New enough, the variable unset: NCCL's newer words, and ours say to set it.
  const std::string newer =
      "Multiple Ranks are using the same GPU/Partition. Set NCCL_MULTI_RANK_GPU_ENABLE=1 to "
      "enable this configuration.";
  const std::string unset = SharedGpuAdvice(newer, 23102, /*variable_set=*/false);
  EXPECT_NE(unset.find("set NCCL_MULTI_RANK_GPU_ENABLE=1"), std::string::npos) << unset;
  EXPECT_NE(unset.find("NCCL 2.31.2"), std::string::npos) << unset;
  EXPECT_EQ(SharedGpuAdvice(newer, 23102, /*variable_set=*/true), "");
  // Other failures are NCCL's own to describe.
  EXPECT_EQ(SharedGpuAdvice("socket connect failed", 22809, false), "");
  EXPECT_EQ(SharedGpuAdvice(refusal, 23003, true), "");
}

}  // namespace
}  // namespace lockstep::worker
