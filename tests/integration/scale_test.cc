// The control plane with a thousand workers (simulated on the real Session API,
// bench/sim_workers.h) on loopback: every worker is assigned, ranks are host-contiguous, and one
// dropped stream re-forms the job from the 999 survivors, again host-contiguous. The sessions
// are on completion queues and the store's waits on the callback API, so the coordinator's
// threads stay under a bound that does not depend on the number of workers, with a thousand
// sessions and with a thousand members waiting in the store.
#include <algorithm>
#include <fstream>
#include <map>
#include <set>

#include "bench/sim_workers.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"

namespace lockstep {
namespace {

constexpr int kWorkers = 1000;
constexpr int kPerHost = 8;
// The coordinator starts with its fixed set (gRPC's own, which grow with the machine's cores,
// the 16 session queues, the strand pool, the tick loop). A thousand sessions may add a few
// (the synchronous services' pollers grow on demand), never one per stream: that would be
// 1,000 or more here.
constexpr int kMaxAddedThreads = 24;

// Every rank 0..size-1 once, and each host's ranks one contiguous run.
void ExpectHostContiguous(bench::SimWorkers& workers, int64_t generation, int size) {
  std::map<std::string, std::vector<int>> by_host;
  std::set<int> ranks;
  for (int i = 0; i < workers.size(); ++i) {
    const int rank = workers.RankIn(i, generation);
    if (rank < 0) continue;
    EXPECT_TRUE(ranks.insert(rank).second) << "rank " << rank << " twice";
    by_host[workers.host(i)].push_back(rank);
  }
  EXPECT_EQ(static_cast<int>(ranks.size()), size);
  if (!ranks.empty()) {
    EXPECT_EQ(*ranks.begin(), 0);
    EXPECT_EQ(*ranks.rbegin(), size - 1);
  }
  for (auto& [host, r] : by_host) {
    std::sort(r.begin(), r.end());
    EXPECT_EQ(r.back() - r.front() + 1, static_cast<int>(r.size()))
        << host << "'s ranks are not contiguous in generation " << generation;
  }
}

int ThreadsOf(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

TEST(ScaleTest, AThousandWorkersAreAssignedAndOneDropReforms) {
  auto started = testing::Cluster::Start();
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<testing::Cluster> cluster = *std::move(started);
  const pid_t coordinator = cluster->coordinator()->pid();
  const int idle_threads = ThreadsOf(coordinator);
  bench::SimWorkers workers(cluster->address(), {kWorkers, kPerHost, 64});
  ASSERT_TRUE(workers.WaitRegistered(absl::Seconds(120)))
      << workers.registered() << " of " << kWorkers << " registered";

  auto job = cluster->Submit(bench::SimulatedJob(kWorkers - 1, kWorkers));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(workers.WaitAssigned(1, kWorkers, absl::Seconds(120)));
  ExpectHostContiguous(workers, 1, kWorkers);
  auto running = cluster->Get(job->job_id());
  ASSERT_TRUE(running.ok());
  EXPECT_EQ(running->members_size(), kWorkers);
  const int busy_threads = ThreadsOf(coordinator);
  std::cout << "coordinator threads: " << idle_threads << " idle, " << busy_threads << " with "
            << kWorkers << " sessions" << std::endl;
  ASSERT_GT(idle_threads, 0);
  EXPECT_LE(busy_threads, idle_threads + kMaxAddedThreads);

  // Every member waits in the bootstrap store for a key (as members forming a group wait for
  // their NCCL id): the waits hold no coordinator thread, and one Set answers them all.
  const int waiting = workers.StartStoreWaits(job->job_id(), 1, "nccl-id", absl::Seconds(120));
  ASSERT_EQ(waiting, kWorkers);
  absl::SleepFor(absl::Milliseconds(500));  // let the waits arrive: the bound must hold anyway
  const int waiting_threads = ThreadsOf(coordinator);
  std::cout << "coordinator threads with " << waiting << " store waits: " << waiting_threads
            << std::endl;
  EXPECT_LE(waiting_threads, idle_threads + kMaxAddedThreads);
  ASSERT_TRUE(workers.StoreSet(0, job->job_id(), 1, "nccl-id", "id-bytes").ok());
  int answered_ok = 0;
  ASSERT_TRUE(workers.WaitStoreAnswers(kWorkers, absl::Seconds(60), &answered_ok));
  EXPECT_EQ(answered_ok, kWorkers);

  // One stream drops: every survivor is aborted and re-assigned, by one message each (the
  // abort inside the assignment). A separate abort would be on the stream before the
  // assignment it precedes, so it would be counted by now.
  const int64_t received_before = workers.received();
  workers.Drop(500);
  ASSERT_TRUE(workers.WaitAborted(1, kWorkers - 1, absl::Seconds(120)));
  ASSERT_TRUE(workers.WaitAssigned(2, kWorkers - 1, absl::Seconds(120)));
  EXPECT_EQ(workers.received() - received_before, kWorkers - 1);
  EXPECT_EQ(workers.RankIn(500, 2), -1);
  ExpectHostContiguous(workers, 2, kWorkers - 1);
  auto reformed = cluster->WaitFor(
      job->job_id(), [](const v1::Job& j) { return j.generation() == 2; }, absl::Seconds(30));
  ASSERT_TRUE(reformed.ok()) << reformed.status();
  EXPECT_EQ(reformed->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(reformed->members_size(), kWorkers - 1);
  ASSERT_EQ(reformed->recovery_history_size(), 1);
  EXPECT_NE(reformed->recovery_history(0).reason().find("sim-00500"), std::string::npos)
      << reformed->recovery_history(0).reason();
  EXPECT_LE(ThreadsOf(coordinator), idle_threads + kMaxAddedThreads) << "after the re-formation";
  EXPECT_TRUE(cluster->coordinator()->running());
}

}  // namespace
}  // namespace lockstep
