// The bootstrap store: scoped keys, blocking waits that end with the right code (the key
// arrived, the deadline passed, the generation ended, the caller went away, the coordinator
// shut down), and scopes that never see each other's keys.
#include "coordinator/store/bootstrap_store.h"

#include <map>
#include <thread>

#include "absl/synchronization/mutex.h"
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

TEST(BootstrapStoreTest, AddCountsFromZeroAndWakesWaiters) {
  BootstrapStore store;
  store.Open(kG1);
  std::thread adder([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_EQ(*store.Add(kG1, "count", 2), 2);
  });
  absl::StatusOr<std::string> value =
      store.Wait(kG1, {"count"}, absl::Now() + absl::Seconds(30));
  adder.join();
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "2");  // the value is the decimal sum, as c10d's add keeps it
  EXPECT_EQ(*store.Add(kG1, "count", -5), -3);
  EXPECT_EQ(*store.Add(kG1, "count", 0), -3);
  ASSERT_TRUE(store.Set(kG1, "text", "abc").ok());
  absl::StatusOr<int64_t> bad = store.Add(kG1, "text", 1);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("\"text\": its value is not an integer"),
            std::string::npos)
      << bad.status();
  ASSERT_TRUE(store.Set(kG1, "big", "9223372036854775807").ok());
  EXPECT_NE(store.Add(kG1, "big", 1).status().message().find("overflows"), std::string::npos);
  EXPECT_EQ(store.Add(kG2, "count", 1).status().code(), absl::StatusCode::kAborted);
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

// Waits without a thread: each ends exactly once, with what the call that decided it says.
struct Outcomes {
  BootstrapStore::WaitDone Record(int i) {
    return [this, i](absl::StatusOr<std::string> v) {
      absl::MutexLock lock(&mu);
      ++calls[i];
      results.insert_or_assign(i, std::move(v));
    };
  }
  int Calls(int i) {
    absl::MutexLock lock(&mu);
    return calls[i];
  }
  absl::StatusOr<std::string> Result(int i) {
    absl::MutexLock lock(&mu);
    return results.at(i);
  }
  absl::Mutex mu;
  std::map<int, int> calls;
  std::map<int, absl::StatusOr<std::string>> results;
};

TEST(BootstrapStoreTest, ManyAsyncWaitersEndOnTheSetThatCompletesThem) {
  BootstrapStore store;
  store.Open(kG1);
  Outcomes out;
  constexpr int kWaiters = 1000;
  for (int i = 0; i < kWaiters; ++i) {
    store.WaitAsync(kG1, {"id"}, absl::Now() + absl::Seconds(60), out.Record(i));
  }
  // A waiter for three keys moves on key by key, whatever order they come in.
  store.WaitAsync(kG1, {"a", "b", "c"}, absl::Now() + absl::Seconds(60), out.Record(-1));
  EXPECT_EQ(store.pending_waits(), static_cast<size_t>(kWaiters + 1));
  ASSERT_TRUE(store.Set(kG1, "c", "3").ok());
  ASSERT_TRUE(store.Set(kG1, "a", "1").ok());
  EXPECT_EQ(out.Calls(-1), 0);
  ASSERT_TRUE(store.Set(kG1, "id", "nccl-id").ok());
  EXPECT_EQ(store.pending_waits(), 1u);
  for (int i = 0; i < kWaiters; ++i) {
    ASSERT_EQ(out.Calls(i), 1) << i;
    ASSERT_TRUE(out.Result(i).ok());
    ASSERT_EQ(*out.Result(i), "nccl-id");
  }
  ASSERT_TRUE(store.Set(kG1, "b", "2").ok());
  EXPECT_EQ(out.Calls(-1), 1);
  EXPECT_EQ(*out.Result(-1), "1") << "the value of the first key";
  // Decided at once: on this thread, before WaitAsync returns.
  EXPECT_EQ(store.WaitAsync(kG1, {"b"}, absl::Now() + absl::Seconds(60), out.Record(-2)), 0u);
  EXPECT_EQ(*out.Result(-2), "2");
  EXPECT_EQ(store.pending_waits(), 0u);
}

TEST(BootstrapStoreTest, AsyncWaitsExpireCancelAndCloseOnce) {
  BootstrapStore store;
  store.Open(kG1);
  store.Open(kG2);
  Outcomes out;
  const absl::Time now = absl::Now();
  store.WaitAsync(kG1, {"x", "late"}, now + absl::Seconds(1), out.Record(1));
  ASSERT_TRUE(store.Set(kG1, "x", "1").ok());
  store.WaitAsync(kG1, {"y"}, now + absl::Seconds(10), out.Record(2));
  const BootstrapStore::WaitId cancelled =
      store.WaitAsync(kG1, {"z"}, now + absl::Seconds(10), out.Record(3));
  store.WaitAsync(kG2, {"w"}, now + absl::Seconds(10), out.Record(4));
  store.Expire(now + absl::Seconds(2));
  ASSERT_EQ(out.Calls(1), 1);
  EXPECT_EQ(out.Result(1).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(out.Result(1).status().message().find("\"late\""), std::string::npos)
      << "names the key still missing: " << out.Result(1).status();
  EXPECT_EQ(out.Calls(2), 0) << "its deadline has not passed";
  store.Cancel(cancelled);
  store.Cancel(cancelled);
  EXPECT_EQ(out.Calls(3), 1);
  EXPECT_EQ(out.Result(3).status().code(), absl::StatusCode::kCancelled);
  store.Close(kG1);
  EXPECT_EQ(out.Calls(2), 1);
  EXPECT_EQ(out.Result(2).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(out.Calls(4), 0) << "another scope's wait goes on";
  store.Expire(now + absl::Seconds(60));
  store.Close(kG1);
  EXPECT_EQ(out.Calls(1) + out.Calls(2) + out.Calls(3), 3) << "nothing ends twice";
  EXPECT_EQ(out.Calls(4), 1);
  EXPECT_EQ(store.pending_waits(), 0u);
}

// A deferred close ends the scope at once (no Set gets in) and leaves the waits' callbacks to
// the caller, who runs them once its own lock is released.
TEST(BootstrapStoreTest, ADeferredCloseEndsWaitsWhenItsCompletionsRun) {
  BootstrapStore store;
  store.Open(kG1);
  store.Open(kG2);
  Outcomes out;
  for (int i = 0; i < 3; ++i) {
    store.WaitAsync(kG1, {"k"}, absl::Now() + absl::Seconds(60), out.Record(i));
  }
  store.WaitAsync(kG2, {"k"}, absl::Now() + absl::Seconds(60), out.Record(9));
  BootstrapStore::Completions ended = store.CloseDeferred(kG1);
  EXPECT_EQ(store.Set(kG1, "k", "v").code(), absl::StatusCode::kAborted);
  EXPECT_EQ(out.Calls(0), 0) << "not before Run";
  EXPECT_EQ(store.pending_waits(), 1u);
  ended.Run();
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(out.Calls(i), 1);
    EXPECT_EQ(out.Result(i).status().code(), absl::StatusCode::kAborted);
  }
  EXPECT_EQ(out.Calls(9), 0) << "the other scope's wait goes on";
}

// The callback runs without the store's lock: it may call the store again.
TEST(BootstrapStoreTest, AWaitsCallbackMayUseTheStore) {
  BootstrapStore store;
  store.Open(kG1);
  absl::Notification chained;
  store.WaitAsync(kG1, {"first"}, absl::Now() + absl::Seconds(60),
                  [&](absl::StatusOr<std::string> v) {
                    ASSERT_TRUE(v.ok());
                    ASSERT_TRUE(store.Set(kG1, "second", *v + "+").ok());
                  });
  store.WaitAsync(kG1, {"second"}, absl::Now() + absl::Seconds(60),
                  [&](absl::StatusOr<std::string> v) {
                    EXPECT_EQ(*v, "1+");
                    chained.Notify();
                  });
  ASSERT_TRUE(store.Set(kG1, "first", "1").ok());
  EXPECT_TRUE(chained.HasBeenNotified());
}

// A member cannot spend the coordinator's memory beyond its generation's limits: a write past
// them is refused naming the limit and changes nothing; an overwrite counts once; a closed
// scope gives its bytes back.
TEST(BootstrapStoreTest, ScopesHoldAtMostTheirLimits) {
  BootstrapStore store;
  store.Open(kG1, ScopeLimits{3, 100});
  ASSERT_TRUE(store.Set(kG1, "a", std::string(40, 'x')).ok());
  ASSERT_TRUE(store.Set(kG1, "a", std::string(40, 'y')).ok()) << "an overwrite replaces";
  EXPECT_EQ(store.bytes(), 41u);
  absl::Status too_big = store.Set(kG1, "b", std::string(60, 'x'));
  EXPECT_EQ(too_big.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(too_big.message().find("at most 100 bytes"), std::string::npos) << too_big;
  EXPECT_EQ(store.bytes(), 41u) << "a refused write changes nothing";
  ASSERT_TRUE(store.Set(kG1, "b", "1").ok());
  ASSERT_TRUE(store.Set(kG1, "c", "2").ok());
  absl::Status too_many = store.Set(kG1, "d", "3");
  EXPECT_EQ(too_many.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(too_many.message().find("limit of 3 store keys"), std::string::npos) << too_many;
  EXPECT_TRUE(store.Set(kG1, "c", "22").ok()) << "an existing key may still change";
  store.Close(kG1);
  EXPECT_EQ(store.bytes(), 0u);
  // A generation's limits grow with its size: Gloo's full mesh of 1,000 ranks fits.
  const ScopeLimits big = ScopeLimits::ForWorld(1000);
  EXPECT_GE(big.max_keys, 1000u + 16);
  EXPECT_GE(big.max_bytes, size_t{1000} * 1000 * 136);
  EXPECT_LE(ScopeLimits::ForWorld(2).max_bytes, size_t{32} << 20);
}

}  // namespace
}  // namespace lockstep::coordinator
