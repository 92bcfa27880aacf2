// The bootstrap store: scoped keys, blocking waits that end with the right code (the key
// arrived, the deadline passed, the generation ended, the caller went away, the coordinator
// shut down), and scopes that never see each other's keys.
#include "coordinator/store/bootstrap_store.h"

#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace lockstep::coordinator {
namespace {

const StoreScope kG1{"job-1", 1}, kG2{"job-1", 2};

TEST(BootstrapStoreTest, WaitReturnsTheValueOnceEveryKeyIsSet) {
  BootstrapStore store;
  store.Open(kG1);
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE(store.Set(kG1, "b", "2").ok());
    ASSERT_TRUE(store.Set(kG1, "a", "1").ok());
  });
  absl::StatusOr<std::string> value = store.Wait(kG1, {"a", "b"}, absl::Now() + absl::Seconds(30));
  setter.join();
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "1");
}

TEST(BootstrapStoreTest, ScopesAreSeparateAndOnlyOpenOnesAcceptCalls) {
  BootstrapStore store;
  store.Open(kG1);
  store.Open(kG2);
  ASSERT_TRUE(store.Set(kG1, "k", "old").ok());
  absl::StatusOr<std::string> other = store.Wait(kG2, {"k"}, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kDeadlineExceeded) << other.status();
  EXPECT_NE(other.status().message().find("\"k\""), std::string::npos) << other.status();
  const StoreScope never{"job-2", 1};
  EXPECT_EQ(store.Set(never, "k", "v").code(), absl::StatusCode::kAborted);
  EXPECT_EQ(store.Wait(never, {"k"}, absl::Now() + absl::Seconds(30)).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(store.open_scopes(), 2u);
  store.Close(kG1);
  EXPECT_EQ(store.Set(kG1, "k", "v").code(), absl::StatusCode::kAborted);
  EXPECT_EQ(store.open_scopes(), 1u);
}

// A generation that ends while members wait ends their waits at once with ABORTED.
TEST(BootstrapStoreTest, ClosingAScopeEndsItsWaits) {
  BootstrapStore store;
  store.Open(kG1);
  std::thread closer([&] {
    absl::SleepFor(absl::Milliseconds(50));
    store.Close(kG1);
  });
  absl::StatusOr<std::string> value = store.Wait(kG1, {"k"}, absl::Now() + absl::Seconds(60));
  closer.join();
  EXPECT_EQ(value.status().code(), absl::StatusCode::kAborted) << value.status();
}

TEST(BootstrapStoreTest, CancelledCallsAndShutdownEndWaits) {
  BootstrapStore store;
  store.Open(kG1);
  std::atomic<bool> cancelled{false};
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(50));
    cancelled = true;
  });
  absl::StatusOr<std::string> value =
      store.Wait(kG1, {"k"}, absl::Now() + absl::Seconds(60), [&] { return cancelled.load(); });
  canceller.join();
  EXPECT_EQ(value.status().code(), absl::StatusCode::kCancelled) << value.status();
  std::thread stopper([&] {
    absl::SleepFor(absl::Milliseconds(50));
    store.Shutdown();
  });
  value = store.Wait(kG1, {"k"}, absl::Now() + absl::Seconds(60));
  stopper.join();
  EXPECT_EQ(value.status().code(), absl::StatusCode::kUnavailable) << value.status();
  EXPECT_EQ(store.Set(kG1, "k", "v").code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace lockstep::coordinator
