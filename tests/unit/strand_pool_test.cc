// StrandPool: tasks of one strand run one at a time and in the order posted, strands run side
// by side, a task may post more, and the destructor runs everything already posted.
#include "coordinator/service/strand_pool.h"

#include <atomic>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace lockstep::coordinator {
namespace {

TEST(StrandPoolTest, EachStrandRunsInOrderAndNeverTwoAtOnce) {
  constexpr int kStrands = 16, kTasks = 2000;
  std::vector<std::vector<int>> seen(kStrands);
  std::vector<std::atomic<int>> running(kStrands);
  std::atomic<int> overlaps{0};
  {
    StrandPool pool(4);
    std::vector<std::shared_ptr<StrandPool::Strand>> strands;
    for (int s = 0; s < kStrands; ++s) strands.push_back(pool.NewStrand());
    for (int i = 0; i < kTasks; ++i) {
      for (int s = 0; s < kStrands; ++s) {
        pool.Post(strands[s], [&, s, i] {
          if (running[s].fetch_add(1) != 0) ++overlaps;
          seen[s].push_back(i);  // unsynchronised on purpose: only one task of s at a time
          running[s].fetch_sub(1);
        });
      }
    }
  }  // the destructor runs every posted task
  EXPECT_EQ(overlaps.load(), 0);
  for (int s = 0; s < kStrands; ++s) {
    ASSERT_EQ(static_cast<int>(seen[s].size()), kTasks) << "strand " << s;
    for (int i = 0; i < kTasks; ++i) ASSERT_EQ(seen[s][i], i) << "strand " << s;
  }
}

TEST(StrandPoolTest, ABlockedStrandDoesNotHoldTheOthers) {
  StrandPool pool(2);
  auto blocked = pool.NewStrand();
  auto other = pool.NewStrand();
  absl::Notification release, ran_other;
  pool.Post(blocked, [&] { release.WaitForNotification(); });
  pool.Post(other, [&] { ran_other.Notify(); });
  EXPECT_TRUE(ran_other.WaitForNotificationWithTimeout(absl::Seconds(30)));
  release.Notify();
}

TEST(StrandPoolTest, ATaskMayPostToItsOwnStrandAndItRunsAfter) {
  std::vector<int> order;
  absl::Mutex mu;
  {
    StrandPool pool(3);
    auto strand = pool.NewStrand();
    pool.Post(strand, [&] {
      pool.Post(strand, [&] {
        absl::MutexLock lock(&mu);
        order.push_back(2);
      });
      absl::SleepFor(absl::Milliseconds(20));  // the posted task must still wait for this one
      absl::MutexLock lock(&mu);
      order.push_back(1);
    });
  }
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
}

}  // namespace
}  // namespace lockstep::coordinator
