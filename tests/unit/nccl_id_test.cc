// Distribution of the NCCL id through a store, which needs NCCL but no GPU (runs in CI): every
// rank of a generation gets rank 0's id, a rank waits a bounded time for it, an abort ends the
// wait, a failing store is not mistaken for a slow rank 0, and a generation's key space (the
// coordinator scopes keys by job and generation; a PrefixStore stands in here) never hands an
// old generation's id to a new one.
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gloo/common/error.h"
#include "gloo/rendezvous/hash_store.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gtest/gtest.h"
#include "worker/comm/nccl_communicator.h"

namespace lockstep::worker {
namespace {

TEST(NcclIdTest, EveryRankGetsRankZerosId) {
  gloo::rendezvous::HashStore store;
  const int world = 4;
  std::vector<absl::StatusOr<ncclUniqueId>> ids(world, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  // Ranks 1..3 start first and wait; rank 0 publishes last.
  for (int r = world - 1; r >= 0; --r) {
    threads.emplace_back([&, r] { ids[r] = ExchangeNcclId(store, r, absl::Seconds(20)); });
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
  gloo::rendezvous::HashStore store;
  const absl::Time start = absl::Now();
  absl::StatusOr<ncclUniqueId> id = ExchangeNcclId(store, 1, absl::Milliseconds(300));
  EXPECT_EQ(id.status().code(), absl::StatusCode::kDeadlineExceeded) << id.status();
  EXPECT_NE(id.status().message().find(kNcclIdKey), std::string::npos) << id.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "the wait must be bounded";
}

// A coordinator abort ends the wait for a missing rank 0 at once, not at the timeout (a minute
// here: a cancel that did not work would end in DEADLINE_EXCEEDED, which fails the test).
TEST(NcclIdTest, CancelEndsTheWaitForRankZero) {
  gloo::rendezvous::HashStore store;
  std::atomic<bool> cancel{false};
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    cancel = true;
  });
  absl::StatusOr<ncclUniqueId> id = ExchangeNcclId(store, 1, absl::Seconds(60), &cancel);
  aborter.join();
  EXPECT_EQ(id.status().code(), absl::StatusCode::kAborted) << id.status();
  EXPECT_NE(id.status().message().find(kNcclIdKey), std::string::npos) << id.status();
}

// A store that fails for another reason than time (the generation is over, the coordinator is
// gone) ends the wait with UNAVAILABLE and the store's message, without waiting out the timeout.
TEST(NcclIdTest, AFailingStoreIsUnavailableNotATimeout) {
  class EndedGeneration : public gloo::rendezvous::Store {
   public:
    void set(const std::string&, const std::vector<char>&) override {}
    std::vector<char> get(const std::string&) override { return {}; }
    void wait(const std::vector<std::string>& keys) override {
      wait(keys, std::chrono::milliseconds(0));
    }
    void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
      ++calls;
      GLOO_THROW_IO_EXCEPTION("store wait \"", keys.front(), "\": 9 generation 3 is over");
    }
    int calls = 0;
  } store;
  absl::StatusOr<ncclUniqueId> id = ExchangeNcclId(store, 1, absl::Seconds(60));
  EXPECT_EQ(id.status().code(), absl::StatusCode::kUnavailable) << id.status();
  EXPECT_NE(id.status().message().find("generation 3 is over"), std::string::npos) << id.status();
  EXPECT_EQ(store.calls, 1);
}

TEST(NcclIdTest, AnOldGenerationsIdIsNotSeenByTheNextGeneration) {
  gloo::rendezvous::HashStore store;
  gloo::rendezvous::PrefixStore generation1("job-1/1", store), generation2("job-1/2", store);
  ASSERT_TRUE(ExchangeNcclId(generation1, 0, absl::Seconds(5)).ok());
  absl::StatusOr<ncclUniqueId> late = ExchangeNcclId(generation2, 1, absl::Milliseconds(200));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
}

}  // namespace
}  // namespace lockstep::worker
