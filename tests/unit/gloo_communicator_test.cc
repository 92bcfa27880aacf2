// Gloo that can be aborted: a collective or a group formation blocked on a peer that never
// comes (a frozen or partitioned process) returns ABORTED as soon as the generation's abort
// signal is raised, not at the collective timeout (a minute here: an abort that did not work
// would end in DEADLINE_EXCEEDED, which fails these tests); an abandoned call never writes into
// the caller's memory, even when the peer shows up later; and store errors keep their codes.
#include "worker/comm/gloo_communicator.h"

#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/local_store.h"

namespace lockstep::worker {
namespace {

using testing::LocalStoreClient;

constexpr std::chrono::milliseconds kLongTimeout(60000);
const coordinator::StoreScope kScope{"job-1", 1};

// Raises `signal` after `delay`, on a thread of its own.
std::thread RaiseAfter(std::shared_ptr<AbortSignal> signal, absl::Duration delay) {
  return std::thread([signal, delay] {
    absl::SleepFor(delay);
    signal->Raise();
  });
}

// Waits (bounded) until no abandoned call is left in this process.
bool AbandonedCallsEnd() {
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (GlooCommunicator::AbandonedThreads() > 0) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

TEST(GlooCommunicatorTest, AbortReleasesACollectiveWaitingForAFrozenPeer) {
  coordinator::BootstrapStore store;
  store.Open(kScope);
  auto abort0 = std::make_shared<AbortSignal>();
  absl::Notification rank1_may_leave;
  std::vector<float> data = {1, 2, 3};
  absl::Status status;
  std::thread rank1([&] {
    auto comm = GlooCommunicator::Create(1, 2, std::make_shared<LocalStoreClient>(&store, kScope),
                                         "127.0.0.1", kLongTimeout);
    ASSERT_TRUE(comm.ok()) << comm.status();
    // Frozen: never joins the allreduce until rank 0 has given up on it.
    rank1_may_leave.WaitForNotification();
  });
  {
    auto comm = GlooCommunicator::Create(0, 2, std::make_shared<LocalStoreClient>(&store, kScope),
                                         "127.0.0.1", kLongTimeout, abort0);
    ASSERT_TRUE(comm.ok()) << comm.status();
    std::thread aborter = RaiseAfter(abort0, absl::Milliseconds(100));
    status = (*comm)->AllreduceSum(data.data(), data.size());
    aborter.join();
    EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
    // Later calls on the aborted communicator return at once too.
    EXPECT_EQ((*comm)->Barrier().code(), absl::StatusCode::kAborted);
  }  // destroying it abandons the blocked call's thread
  EXPECT_EQ(data, (std::vector<float>{1, 2, 3})) << "the caller's memory is untouched";
  rank1_may_leave.Notify();
  rank1.join();  // rank 1's group goes away: the abandoned call fails and its thread ends
  EXPECT_TRUE(AbandonedCallsEnd());
}

// The frozen peer wakes up and completes the collective with the abandoned call: the sum lands
// in the abandoned call's own copy, never in the memory the caller has since reused.
TEST(GlooCommunicatorTest, AnAbandonedCallNeverWritesIntoTheCallersMemory) {
  coordinator::BootstrapStore store;
  store.Open(kScope);
  auto abort0 = std::make_shared<AbortSignal>();
  absl::Notification rank0_gave_up;
  std::vector<float> mine = {1, 2, 3};
  std::thread rank1([&] {
    auto comm = GlooCommunicator::Create(1, 2, std::make_shared<LocalStoreClient>(&store, kScope),
                                         "127.0.0.1", kLongTimeout);
    ASSERT_TRUE(comm.ok()) << comm.status();
    rank0_gave_up.WaitForNotification();
    std::vector<float> theirs = {10, 20, 30};
    // Completes with rank 0's abandoned call.
    EXPECT_TRUE((*comm)->AllreduceSum(theirs.data(), theirs.size()).ok());
    EXPECT_EQ(theirs, (std::vector<float>{11, 22, 33}));
  });
  auto comm = GlooCommunicator::Create(0, 2, std::make_shared<LocalStoreClient>(&store, kScope),
                                       "127.0.0.1", kLongTimeout, abort0);
  ASSERT_TRUE(comm.ok()) << comm.status();
  std::thread aborter = RaiseAfter(abort0, absl::Milliseconds(100));
  EXPECT_EQ((*comm)->AllreduceSum(mine.data(), mine.size()).code(), absl::StatusCode::kAborted);
  aborter.join();
  mine = {7, 7, 7};  // reused for the next generation
  rank0_gave_up.Notify();
  rank1.join();
  EXPECT_EQ(mine, (std::vector<float>{7, 7, 7}));
  comm->reset();
  EXPECT_TRUE(AbandonedCallsEnd());
}

// Forming a group with a peer that published nothing (it died before, or never came) ends as
// soon as the generation is aborted.
TEST(GlooCommunicatorTest, AbortEndsTheFormationOfAGroup) {
  coordinator::BootstrapStore store;
  store.Open(kScope);
  auto abort = std::make_shared<AbortSignal>();
  std::thread aborter = RaiseAfter(abort, absl::Milliseconds(100));
  auto comm = GlooCommunicator::Create(
      0, 2, std::make_shared<LocalStoreClient>(&store, kScope, abort), "127.0.0.1", kLongTimeout,
      abort);
  aborter.join();
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kAborted) << comm.status();
  EXPECT_TRUE(AbandonedCallsEnd());
}

// A generation the coordinator already ended: the store's ABORTED comes back as ABORTED with
// the store's message, not as an unavailable transport.
TEST(GlooCommunicatorTest, StoreErrorsKeepTheirCode) {
  coordinator::BootstrapStore store;  // the scope is never opened: the generation is over
  auto comm = GlooCommunicator::Create(0, 2, std::make_shared<LocalStoreClient>(&store, kScope),
                                       "127.0.0.1", kLongTimeout);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kAborted) << comm.status();
  EXPECT_NE(comm.status().message().find("forming the Gloo group"), std::string::npos)
      << comm.status();
  EXPECT_NE(comm.status().message().find("not live"), std::string::npos) << comm.status();
}

// A peer killed mid-collective is an error (UNAVAILABLE) at once, without an abort.
TEST(GlooCommunicatorTest, AKilledPeerIsUnavailable) {
  coordinator::BootstrapStore store;
  store.Open(kScope);
  absl::Notification formed;
  std::thread rank1([&] {
    auto comm = GlooCommunicator::Create(1, 2, std::make_shared<LocalStoreClient>(&store, kScope),
                                         "127.0.0.1", kLongTimeout);
    ASSERT_TRUE(comm.ok()) << comm.status();
    formed.WaitForNotification();
    absl::SleepFor(absl::Milliseconds(100));
  });  // its group closes: what a killed process's sockets do
  auto comm = GlooCommunicator::Create(0, 2, std::make_shared<LocalStoreClient>(&store, kScope),
                                       "127.0.0.1", kLongTimeout);
  ASSERT_TRUE(comm.ok()) << comm.status();
  formed.Notify();
  std::vector<double> data(1000, 1.0);
  absl::Status s = (*comm)->AllreduceSum(data.data(), data.size());
  rank1.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

}  // namespace
}  // namespace lockstep::worker
