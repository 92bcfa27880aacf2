// The shared-memory fast path: sums match, sizes beyond the segment fall back to Gloo, and a
// rank stuck waiting for a peer is released by Abort or by its deadline.
#include "worker/comm/shm_communicator.h"

#include <unistd.h>

#include <filesystem>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/gloo_group.h"
#include "worker/comm/gloo_communicator.h"

namespace lockstep::worker {
namespace {

// Forms a Gloo group of `world` threads, wraps it, and runs fn(rank, comm) on each.
void RunGroup(int world, size_t max_bytes, std::chrono::milliseconds timeout,
              const std::function<void(int, Communicator&)>& fn) {
  testing::RunInGlooGroup(world, [&](int r, std::unique_ptr<GlooCommunicator> gloo) {
    auto comm = ShmCommunicator::Wrap(std::move(gloo), max_bytes, timeout);
    ASSERT_TRUE(comm.ok()) << comm.status();
    ASSERT_NE(dynamic_cast<ShmCommunicator*>(comm->get()), nullptr)
        << "ranks in one process share /dev/shm: the fast path must be taken";
    fn(r, **comm);
  });
}

// Staged sums: each rank writes into the segment itself and sums it in pieces; the result is
// the exact integer sum, read in place, and ordinary sums still work in between steps.
TEST(ShmCommunicatorTest, StagedInt64SumsInPieces) {
  for (int world : {2, 3}) {
    const size_t n = 1000;
    RunGroup(
        world, n * sizeof(int64_t), std::chrono::milliseconds(20000),
        [&](int r, Communicator& comm) {
          EXPECT_EQ(comm.StagingInt64(n + 1), nullptr) << "beyond the segment";
          for (int step = 0; step < 5; ++step) {
            int64_t* staged = comm.StagingInt64(n);
            ASSERT_NE(staged, nullptr);
            for (size_t i = 0; i < n; ++i) staged[i] = (r + 1) * int64_t(i) + step;
            for (size_t offset : {size_t{0}, size_t{300}, size_t{301}, size_t{700}}) {
              const size_t end = offset == 0 ? 300 : offset == 300 ? 301 : offset == 301 ? 700 : n;
              ASSERT_TRUE(comm.SumStagedInt64(offset, end - offset).ok());
            }
            const int64_t* sum = comm.StagedResultInt64();
            for (size_t i = 0; i < n; ++i) {
              ASSERT_EQ(sum[i], world * (world + 1) / 2 * int64_t(i) + world * step)
                  << "world " << world << " step " << step << " i " << i;
            }
            float f[3] = {1, 2, 3};
            ASSERT_TRUE(comm.AllreduceSum(f, 3).ok());
            EXPECT_EQ(f[2], 3.0f * world);
          }
        });
  }
}

TEST(ShmCommunicatorTest, SumsMatchAndAreIdenticalOnEveryRank) {
  for (int world : {2, 3, 4}) {
    const size_t max_bytes = 1000 * sizeof(float);
    std::vector<std::vector<float>> results(world);
    RunGroup(world, max_bytes, std::chrono::milliseconds(20000), [&](int r, Communicator& comm) {
      // Many operations of varying size, including one larger than the segment (Gloo path).
      for (size_t n :
           {size_t{1}, size_t{7}, size_t{1000}, size_t{999}, size_t{2500}, size_t{333}}) {
        for (int rep = 0; rep < 20; ++rep) {
          std::vector<float> v(n);
          for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>((r + 1) * (i % 13) + rep);
          ASSERT_TRUE(comm.AllreduceSum(v.data(), n).ok());
          for (size_t i = 0; i < n; ++i) {
            const float want = static_cast<float>(world * (world + 1) / 2 * (i % 13) + world * rep);
            ASSERT_EQ(v[i], want) << "world " << world << " n " << n << " i " << i;
          }
          if (n == 999 && rep == 19) results[r] = v;
        }
      }
      double d[2] = {1.5, static_cast<double>(r)};
      ASSERT_TRUE(comm.AllreduceSum(d, 2).ok());
      EXPECT_EQ(d[0], 1.5 * world);
      // int64 through shared memory (500 fit) and through Gloo (600 do not).
      for (size_t n : {size_t{500}, size_t{600}}) {
        std::vector<int64_t> q(n);
        for (size_t i = 0; i < n; ++i) q[i] = (int64_t{1} << 50) * (r % 2 ? -1 : 1) + r + i;
        ASSERT_TRUE(comm.AllreduceSum(q.data(), n).ok());
        int64_t big = 0, small = 0;
        for (int k = 0; k < world; ++k) {
          big += (int64_t{1} << 50) * (k % 2 ? -1 : 1);
          small += k;
        }
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(q[i], big + small + world * int64_t(i));
      }
    });
    for (int r = 1; r < world; ++r) EXPECT_EQ(results[r], results[0]);
  }
}

TEST(ShmCommunicatorTest, NonIntegerSumsAreBitIdenticalAcrossRanks) {
  const int world = 3;
  std::vector<std::vector<float>> results(world);
  RunGroup(world, 4096 * sizeof(float), std::chrono::milliseconds(20000),
           [&](int r, Communicator& comm) {
             std::vector<float> v(4096);
             for (size_t i = 0; i < v.size(); ++i)
               v[i] = 0.1f * static_cast<float>(r + 1) / (i + 3.0f);
             ASSERT_TRUE(comm.AllreduceSum(v.data(), v.size()).ok());
             results[r] = v;
           });
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
}

TEST(ShmCommunicatorTest, AbortReleasesARankWaitingForAMissingPeer) {
  RunGroup(2, 64 * sizeof(float), std::chrono::milliseconds(60000), [&](int r, Communicator& comm) {
    if (r == 1) return;  // never joins the sum
    std::thread aborter([&] {
      absl::SleepFor(absl::Milliseconds(200));
      comm.Abort();
    });
    const absl::Time start = absl::Now();
    std::vector<float> v(64, 1.0f);
    absl::Status s = comm.AllreduceSum(v.data(), v.size());
    aborter.join();
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_LT(absl::Now() - start, absl::Seconds(30)) << "abort must not wait for the timeout";
  });
}

TEST(ShmCommunicatorTest, MissingPeerHitsTheDeadline) {
  RunGroup(2, 64 * sizeof(float), std::chrono::milliseconds(300), [&](int r, Communicator& comm) {
    if (r == 1) return;
    std::vector<float> v(64, 1.0f);
    absl::Status s = comm.AllreduceSum(v.data(), v.size());
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  });
}

// Segments of this process in /dev/shm ("lockstep-PID-...").
int OwnSegments() {
  int n = 0;
  const std::string prefix = "lockstep-" + std::to_string(getpid()) + "-";
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    if (e.path().filename().string().rfind(prefix, 0) == 0) ++n;
  }
  return n;
}

// A communicator of rank 0 in a group of 2 whose peer is gone: every collective fails.
class PeerGone final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  absl::Status AllreduceSum(float*, size_t) override { return Gone(); }
  absl::Status AllreduceSum(double*, size_t) override { return Gone(); }
  absl::Status AllreduceSum(int64_t*, size_t) override { return Gone(); }
  absl::Status Broadcast(void*, size_t, int) override { return Gone(); }
  absl::Status Barrier() override { return Gone(); }

 private:
  static absl::Status Gone() { return absl::UnavailableError("peer gone"); }
};

// Defect 7: a peer that dies during the segment's setup must not leave its name behind.
TEST(ShmCommunicatorTest, ASetupThatFailsUnlinksTheSegment) {
  const int before = OwnSegments();
  auto comm = ShmCommunicator::Wrap(std::make_unique<PeerGone>(), 4096,
                                    std::chrono::milliseconds(1000));
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kUnavailable) << comm.status();
  EXPECT_EQ(OwnSegments(), before);
}

// What a process killed inside that window leaves is swept: a name of a dead pid of this pid
// namespace goes; a live process's name stays.
TEST(ShmCommunicatorTest, SweepRemovesOnlyDeadProcessesSegments) {
  struct stat st {};
  ASSERT_EQ(stat("/proc/self/ns/pid", &st), 0);
  const pid_t dead = [] {
    const pid_t child = fork();
    if (child == 0) _exit(0);
    waitpid(child, nullptr, 0);
    return child;
  }();
  const std::string stale = absl::StrFormat("/lockstep-%d-%d-%016x", dead, st.st_ino, 42);
  const std::string live = absl::StrFormat("/lockstep-%d-%d-%016x", getpid(), st.st_ino, 43);
  for (const std::string& name : {stale, live}) {
    const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
    ASSERT_GE(fd, 0);
    close(fd);
  }
  EXPECT_GE(ShmCommunicator::SweepStaleSegments(), 1);
  EXPECT_FALSE(std::filesystem::exists("/dev/shm" + stale));
  EXPECT_TRUE(std::filesystem::exists("/dev/shm" + live));
  shm_unlink(live.c_str());
}

}  // namespace
}  // namespace lockstep::worker
