// Coordinators on etcd (--state_backend=etcd; docs/deploy.md), with real etcd processes on
// loopback that the tests start and remove: three coordinators, one leading. Killed with -9
// while a job trains (and after one etcd member of three was killed), a standby leads, the
// workers follow it, and the job ends with exactly its steps, the bits of an undisturbed run
// and no step redone; the job queued behind it runs. A leader frozen past its lease is
// deposed: a standby leads, and the old one, thawed, steps down (exit 3). A deposed leader's
// writes are refused by etcd (the fence), and bad flags and foreign prefixes are refused at
// start with the reason. A job submitted during a failover is refused (UNAVAILABLE) or kept.
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/loopback_ports.h"
#include "common/status_macros.h"
#include "coordinator/store/etcd_client.h"
#include "coordinator/store/etcd_job_store.h"
#include "coordinator/store/leadership.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/exact.h"
#include "tests/testing/pki.h"

namespace lockstep {
namespace {

using testing::Cluster;
using testing::Process;

constexpr char kEtcdBin[] = "/usr/bin/etcd";
constexpr absl::Duration kWait = absl::Seconds(180);

int FreePort() { return FreeLoopbackPorts(1)[0]; }

// The coordinator's files for an etcd with TLS (Etcd::Start(n, true)): the test CA, and the
// client certificate etcd requires.
TlsFiles EtcdClientTls() {
  TlsFiles tls;
  tls.flags = "--etcd_tls";
  tls.ca = testing::Pki::Get().Path("ca.crt");
  tls.cert = testing::Pki::Get().Path("ctl.crt");
  tls.key = testing::Pki::Get().Path("ctl.key");
  return tls;
}

// An etcd cluster of `n` members on loopback, in a directory of its own; removed with it. With
// `tls`, clients must speak TLS and present a certificate of the test CA (testing::Pki).
class Etcd {
 public:
  // Up to three tries: a port chosen free may be taken by another test's process before the
  // member binds it (ctest -j2), and then that member exits.
  static absl::StatusOr<std::unique_ptr<Etcd>> Start(int n, bool tls = false) {
    if (tls && !testing::Pki::Get().ok) {
      return absl::InternalError("openssl could not make the certificates: " +
                                 testing::Pki::Get().error);
    }
    absl::Status last;
    for (int attempt = 0; attempt < 3; ++attempt) {
      absl::StatusOr<std::unique_ptr<Etcd>> etcd = TryStart(n, attempt, tls);
      if (etcd.ok()) return etcd;
      last = etcd.status();
      std::cerr << "etcd did not start (try " << attempt + 1 << "): " << last << "\n";
    }
    return last;
  }
  ~Etcd() {
    members_.clear();
    std::filesystem::remove_all(dir_);
  }

  std::string endpoints() const { return absl::StrJoin(client_urls_, ","); }
  Process* member(int i) { return members_.at(i).get(); }
  absl::Status Restart(int i) {
    auto process = Process::Spawn(argv_[i], absl::StrCat(dir_, "/m", i, ".log"));
    if (!process.ok()) return process.status();
    members_[i] = *std::move(process);
    return absl::OkStatus();
  }

 private:
  Etcd() = default;
  static absl::StatusOr<std::unique_ptr<Etcd>> TryStart(int n, int attempt, bool tls) {
    std::unique_ptr<Etcd> etcd(new Etcd());
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    etcd->dir_ = absl::StrCat(::testing::TempDir(), "/lockstep-etcd-", getpid(), "-",
                              info ? info->name() : "etcd", "-", attempt);
    std::filesystem::remove_all(etcd->dir_);
    std::filesystem::create_directories(etcd->dir_);
    std::vector<std::string> peers;
    const std::vector<int> ports = FreeLoopbackPorts(2 * n);
    for (int i = 0; i < n; ++i) {
      etcd->client_urls_.push_back(
          absl::StrCat(tls ? "https" : "http", "://127.0.0.1:", ports[2 * i]));
      peers.push_back(absl::StrCat("m", i, "=http://127.0.0.1:", ports[2 * i + 1]));
    }
    for (int i = 0; i < n; ++i) {
      const std::string peer = peers[i].substr(peers[i].find('=') + 1);
      etcd->argv_.push_back(
          {kEtcdBin, absl::StrCat("--name=m", i), absl::StrCat("--data-dir=", etcd->dir_, "/m", i),
           "--listen-client-urls=" + etcd->client_urls_[i],
           "--advertise-client-urls=" + etcd->client_urls_[i], "--listen-peer-urls=" + peer,
           "--initial-advertise-peer-urls=" + peer,
           "--initial-cluster=" + absl::StrJoin(peers, ","), "--initial-cluster-state=new",
           "--initial-cluster-token=lockstep-test"});
      if (tls) {
        const testing::Pki& pki = testing::Pki::Get();
        for (const std::string& flag :
             {"--cert-file=" + pki.Path("server.crt"), "--key-file=" + pki.Path("server.key"),
              "--trusted-ca-file=" + pki.Path("ca.crt"), std::string("--client-cert-auth")}) {
          etcd->argv_.back().push_back(flag);
        }
      }
      etcd->members_.emplace_back();
      LOCKSTEP_RETURN_IF_ERROR(etcd->Restart(i));
    }
    // Serving once a write goes through (the members have elected their leader).
    auto client = coordinator::EtcdClient::Connect(etcd->endpoints(), "/probe", absl::Seconds(20),
                                                   tls ? EtcdClientTls() : TlsFiles());
    if (!client.ok()) return absl::Status(client.status().code(), etcd->Failure(client.status()));
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    for (;;) {
      etcdserverpb::TxnRequest txn;
      etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
      put->set_key("/probe");
      put->set_value("1");
      if ((*client)->Txn(txn).ok()) break;
      if (absl::Now() > deadline) {
        return absl::UnavailableError(etcd->Failure(absl::UnavailableError("no write served")));
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    return etcd;
  }
  // `status`, with the end of each member's log.
  std::string Failure(const absl::Status& status) const {
    std::string out(status.message());
    for (size_t i = 0; i < members_.size(); ++i) {
      std::ifstream in(absl::StrCat(dir_, "/m", i, ".log"));
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      absl::StrAppend(&out, "\n--- etcd member ", i, ":\n",
                      text.substr(text.size() > 1500 ? text.size() - 1500 : 0));
    }
    return out;
  }

  std::string dir_;
  std::vector<std::string> client_urls_;
  std::vector<std::vector<std::string>> argv_;
  std::vector<std::unique_ptr<Process>> members_;
};

bool EtcdInstalled() { return std::filesystem::exists(kEtcdBin); }

#define SKIP_WITHOUT_ETCD()                           \
  if (!EtcdInstalled())                               \
  GTEST_SKIP() << kEtcdBin                            \
               << " is missing (Debian etcd-server; " \
                  "scripts/install_deps.sh --test installs it)"

// Waits until every thread of `pid` is stopped (a SIGSTOP is delivered to a process's threads
// one by one: a thread already running may still answer a call meanwhile).
bool WaitStopped(pid_t pid) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    bool all = true;
    const std::string tasks = absl::StrCat("/proc/", pid, "/task");
    for (const auto& task : std::filesystem::directory_iterator(tasks)) {
      std::ifstream stat(task.path() / "stat");
      std::string line;
      std::getline(stat, line);
      const size_t close = line.rfind(')');
      if (close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'T') {
        all = false;
      }
    }
    if (all) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

// An etcd of `members` members and `coordinators` coordinators on it, coordinator 0 leading.
// The cluster goes before the etcd it stands on.
struct OnEtcd {
  std::unique_ptr<Etcd> etcd;
  std::unique_ptr<Cluster> cluster;
};
absl::StatusOr<OnEtcd> StartOnEtcd(int members, int coordinators,
                                   const std::vector<std::string>& coordinator_flags = {}) {
  OnEtcd on;
  LOCKSTEP_ASSIGN_OR_RETURN(on.etcd, Etcd::Start(members));
  LOCKSTEP_ASSIGN_OR_RETURN(
      on.cluster, Cluster::StartOnEtcd(on.etcd->endpoints(), coordinators, coordinator_flags));
  LOCKSTEP_ASSIGN_OR_RETURN(const int leader, on.cluster->FollowLeader(absl::Seconds(10)));
  if (leader != 0) {
    return absl::InternalError(absl::StrCat("coordinator ", leader, " leads, not coordinator 0"));
  }
  return on;
}

// The text of `worker`'s log once it holds `needle` (or when `timeout` is over).
std::string WaitForLog(Cluster& cluster, const std::string& worker, const std::string& needle,
                       absl::Duration timeout) {
  const std::string log = absl::StrCat(cluster.dir(), "/", worker, ".log");
  const absl::Time deadline = absl::Now() + timeout;
  std::string text;
  while (!absl::StrContains(text, needle) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
    std::ifstream in(log);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return text;
}

// Workers w0, w1 (and up to w`n-1`), each holding before step `held_at` (test hooks) until
// released.
void StartHeldWorkers(Cluster& cluster, int64_t held_at, int n = 2) {
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(
        cluster
            .StartWorker(absl::StrCat("w", i), {absl::StrCat("--test_hooks=before_step@", held_at)})
            .ok())
        << cluster.Logs();
  }
}

// The two-member job succeeds with exactly `steps` steps, one checksum, nothing redone.
void ExpectEndsWhole(Cluster& cluster, const std::string& job_id, int64_t steps) {
  auto done = cluster.WaitForEnd(job_id, kWait);
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster.Logs();
  EXPECT_EQ(done->step(), steps);
  ASSERT_EQ(done->members_size(), 2);
  EXPECT_EQ(done->members(0).parameter_checksum(), done->members(1).parameter_checksum());
  for (const v1::Recovery& r : done->recovery_history()) EXPECT_EQ(r.steps_redone(), 0);
}

TEST(EtcdTest, TheLeaderKilledDuringTrainingCostsTheJobNothing) {
  SKIP_WITHOUT_ETCD();
  auto on = StartOnEtcd(3, 3);
  ASSERT_TRUE(on.ok()) << on.status();
  Cluster& cluster = *on->cluster;

  constexpr int64_t kSteps = 600, kHeldAt = 300;
  const v1::JobSpec spec = testing::DeterministicJob(2, 2, kSteps, 0, 5000);
  const std::string checksum = testing::ReferenceChecksumOnOneWorker(cluster, spec);
  ASSERT_FALSE(checksum.empty());

  // The members hold before step kHeldAt, so the failover lands mid-training on any machine.
  ASSERT_NO_FATAL_FAILURE(StartHeldWorkers(cluster, kHeldAt));
  auto job = cluster.Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  auto queued = cluster.Submit(testing::DeterministicJob(2, 2, 50, 0, 5000));
  ASSERT_TRUE(queued.ok()) << queued.status();
  for (const char* w : {"w0", "w1"}) {
    ASSERT_TRUE(cluster.WaitForHook(w, "before_step", kWait).ok());
  }

  // One etcd member of three lost: nothing to see.
  on->etcd->member(2)->Signal(SIGKILL);
  auto still = cluster.Get(job->job_id());
  ASSERT_TRUE(still.ok()) << still.status();
  EXPECT_EQ(still->state(), v1::JOB_STATE_RUNNING);

  auto listed_before = cluster.List();
  ASSERT_TRUE(listed_before.ok()) << listed_before.status();
  auto old_term = cluster.TermOf(0);  // in every answer, for clients to pass over a deposed one
  ASSERT_TRUE(old_term.ok()) << old_term.status();
  EXPECT_GT(*old_term, 0);
  const absl::Time killed = absl::Now();
  cluster.coordinator(0)->Signal(SIGKILL);
  // A job submitted during the failover, to each coordinator in turn until one takes it: every
  // other answer is UNAVAILABLE, and the one taken is kept (listed below, and it runs).
  const v1::JobSpec during = testing::DeterministicJob(2, 2, 20, 0, 5000);
  int refused = 0;
  std::string taken;
  while (taken.empty() && absl::Now() < killed + absl::Seconds(20)) {
    for (int i = 0; i < 3 && taken.empty(); ++i) {
      auto submitted = cluster.SubmitTo(i, during, absl::Seconds(2));
      if (submitted.ok()) {
        taken = submitted->job_id();
        std::cout << "coordinator " << i << " took a job "
                  << absl::FormatDuration(absl::Now() - killed) << " after the leader was killed; "
                  << refused << " submits refused before\n";
      } else {
        EXPECT_EQ(submitted.status().code(), absl::StatusCode::kUnavailable) << submitted.status();
        ++refused;
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_FALSE(taken.empty()) << "no coordinator took a job within 20 s of the kill"
                              << cluster.Logs();
  EXPECT_GT(refused, 0);  // the killed leader's own address at least
  auto leader = cluster.FollowLeader(absl::Seconds(20));
  ASSERT_TRUE(leader.ok()) << leader.status();
  EXPECT_NE(*leader, 0);
  std::cout << "a standby led " << absl::FormatDuration(absl::Now() - killed)
            << " after the leader was killed\n";
  auto new_term = cluster.TermOf(*leader);
  ASSERT_TRUE(new_term.ok()) << new_term.status();
  EXPECT_GT(*new_term, *old_term);
  // The members register with it, their group kept as it is (busy in generation 1); only then
  // do they go on (released sooner, they could finish the job before they are back).
  for (const char* w : {"w0", "w1"}) {
    ASSERT_TRUE(cluster.WaitForWorker(w, "busy", absl::Seconds(30)).ok());
  }
  for (const char* w : {"w0", "w1"}) cluster.ReleaseHook(w, "before_step");

  auto done = cluster.WaitForEnd(job->job_id(), kWait);
  ASSERT_TRUE(done.ok()) << done.status() << cluster.Logs();
  testing::ExpectExact(cluster, *done, kSteps, checksum);
  // The group was never stopped: the new leader kept its generation as it was.
  EXPECT_EQ(done->generations_size(), 1) << cluster.Logs();
  EXPECT_EQ(done->recovery_history_size(), 0) << cluster.Logs();
  auto next = cluster.WaitForEnd(queued->job_id(), kWait);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->state(), v1::JOB_STATE_SUCCEEDED) << next->reason() << cluster.Logs();
  auto after = cluster.WaitForEnd(taken, kWait);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->state(), v1::JOB_STATE_SUCCEEDED) << after->reason() << cluster.Logs();
  // Nothing of the refused submits was stored: the leader knows the jobs it knew before the
  // kill and the one taken, no more.
  std::vector<std::string> expected = {taken}, ids;
  for (const v1::Job& j : *listed_before) expected.push_back(j.job_id());
  auto jobs = cluster.List();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  for (const v1::Job& j : *jobs) ids.push_back(j.job_id());
  EXPECT_THAT(ids, ::testing::UnorderedElementsAreArray(expected));

  // A standby names the leader; lockstepctl given every address finds it.
  const std::string standby = cluster.coordinator_address(*leader == 1 ? 2 : 1);
  auto named = testing::RunCommand({LOCKSTEP_CTL_BIN, "--coordinator=" + standby, "list"},
                                   absl::Seconds(20));
  ASSERT_TRUE(named.ok());
  EXPECT_EQ(named->exit_code, 3) << named->output;
  EXPECT_TRUE(
      absl::StrContains(named->output, "the leader is at " + cluster.coordinator_address(*leader)))
      << named->output;
  auto listed = testing::RunCommand(
      {LOCKSTEP_CTL_BIN,
       absl::StrCat("--coordinator=", cluster.coordinator_address(0), ",", standby), "list"},
      absl::Seconds(20));
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->exit_code, 0) << listed->output;
  EXPECT_TRUE(absl::StrContains(listed->output, job->job_id())) << listed->output;
}

// A member killed while no coordinator leads: the survivors' group breaks, they keep their
// state (and the failure they could not report), and the new leader re-forms the job from them
// instead of keeping the broken generation; the job ends with an undisturbed run's bits.
TEST(EtcdTest, AWorkerLostDuringTheFailoverIsRecoveredByTheNewLeader) {
  SKIP_WITHOUT_ETCD();
  auto on = StartOnEtcd(1, 2);
  ASSERT_TRUE(on.ok()) << on.status();
  Cluster& cluster = *on->cluster;
  constexpr int64_t kSteps = 500, kHeldAt = 250;
  const v1::JobSpec spec = testing::DeterministicJob(2, 3, kSteps, 0, 5000);
  const std::string checksum = testing::ReferenceChecksumOnOneWorker(cluster, spec);
  ASSERT_FALSE(checksum.empty());
  ASSERT_NO_FATAL_FAILURE(StartHeldWorkers(cluster, kHeldAt, 3));
  auto job = cluster.Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  for (const char* w : {"w0", "w1", "w2"}) {
    ASSERT_TRUE(cluster.WaitForHook(w, "before_step", kWait).ok()) << cluster.Logs();
  }

  cluster.coordinator(0)->Signal(SIGKILL);
  cluster.worker("w2")->Signal(SIGKILL);
  ASSERT_TRUE(cluster.worker("w2")->Wait(absl::Seconds(10)).ok());
  // The survivors go on: their next collective finds w2 gone, and the group breaks.
  for (const char* w : {"w0", "w1"}) cluster.ReleaseHook(w, "before_step");
  auto leader = cluster.FollowLeader(absl::Seconds(20));
  ASSERT_TRUE(leader.ok()) << leader.status();
  EXPECT_EQ(*leader, 1);

  auto done = cluster.WaitForEnd(job->job_id(), kWait);
  ASSERT_TRUE(done.ok()) << done.status() << cluster.Logs();
  testing::ExpectExact(cluster, *done, kSteps, checksum);
  EXPECT_EQ(done->members_size(), 2);
  ASSERT_GE(done->recovery_history_size(), 1) << cluster.Logs();
  for (const v1::Recovery& r : done->recovery_history()) {
    EXPECT_EQ(r.steps_redone(), 0) << r.reason();
  }
  EXPECT_GE(done->generations_size(), 2) << "the broken generation is not kept";
}

TEST(EtcdTest, ALeaderFrozenPastItsLeaseIsDeposedAndStepsDown) {
  SKIP_WITHOUT_ETCD();
  auto on = StartOnEtcd(1, 2);
  ASSERT_TRUE(on.ok()) << on.status();
  Cluster& cluster = *on->cluster;
  ASSERT_TRUE(cluster.StartWorkers(2).ok()) << cluster.Logs();
  constexpr int64_t kSteps = 400;
  auto job = cluster.Submit(testing::DeterministicJob(2, 2, kSteps, 0, 5000));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(cluster
                  .WaitFor(
                      job->job_id(), [](const v1::Job& j) { return j.step() > 0; }, kWait)
                  .ok());

  cluster.coordinator(0)->Signal(SIGSTOP);
  ASSERT_TRUE(WaitStopped(cluster.coordinator(0)->pid()));  // every thread, not just signalled
  auto leader = cluster.FollowLeader(absl::Seconds(20));
  ASSERT_TRUE(leader.ok()) << leader.status();
  ASSERT_EQ(*leader, 1);
  cluster.coordinator(0)->Signal(SIGCONT);
  // Thawed, it finds its lease gone and stops: whatever it would still write is fenced off.
  auto code = cluster.coordinator(0)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status() << cluster.Logs();
  EXPECT_EQ(*code, 3) << cluster.Logs();

  ExpectEndsWhole(cluster, job->job_id(), kSteps);
}

TEST(EtcdTest, WorkersPassOverADeposedLeaderThatStillServes) {
  SKIP_WITHOUT_ETCD();
  // The first coordinator, once deposed, holds before it exits (test hook), still serving.
  auto on = StartOnEtcd(1, 2, {"--test_hooks=step_down"});
  ASSERT_TRUE(on.ok()) << on.status();
  Cluster& cluster = *on->cluster;
  ASSERT_TRUE(cluster.StartWorker("w0").ok()) << cluster.Logs();

  // Frozen past its lease, coordinator 0 is replaced; the worker moves to coordinator 1.
  cluster.coordinator(0)->Signal(SIGSTOP);
  ASSERT_TRUE(WaitStopped(cluster.coordinator(0)->pid()));
  ASSERT_EQ(*cluster.FollowLeader(absl::Seconds(20)), 1);
  ASSERT_TRUE(cluster.WaitForWorker("w0", "idle", absl::Seconds(20)).ok());
  cluster.coordinator(0)->Signal(SIGCONT);
  ASSERT_TRUE(cluster.WaitForHook("coordinator", "step_down", absl::Seconds(20)).ok());

  // Coordinator 1 frozen in turn: the worker tries coordinator 0, which answers, but leads an
  // older term than the one the worker registered under: it is passed over.
  cluster.coordinator(1)->Signal(SIGSTOP);
  ASSERT_TRUE(WaitStopped(cluster.coordinator(1)->pid()));
  const std::string text = WaitForLog(cluster, "w0", "it was deposed", absl::Seconds(30));
  EXPECT_TRUE(absl::StrContains(text, "it was deposed")) << cluster.Logs();
  EXPECT_FALSE(absl::StrContains(text.substr(text.find("it was deposed")),
                                 "registered with " + cluster.coordinator_address(0)))
      << text;
  cluster.coordinator(1)->Signal(SIGCONT);
  cluster.ReleaseHook("coordinator", "step_down");
  auto code = cluster.coordinator(0)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 3);
}

TEST(EtcdTest, WithEtcdGoneNoCoordinatorLeadsAndTheJobGoesOnWhenItIsBack) {
  SKIP_WITHOUT_ETCD();
  auto on = StartOnEtcd(1, 2);
  ASSERT_TRUE(on.ok()) << on.status();
  Cluster& cluster = *on->cluster;
  constexpr int64_t kSteps = 400, kHeldAt = 200;
  ASSERT_NO_FATAL_FAILURE(StartHeldWorkers(cluster, kHeldAt));
  auto job = cluster.Submit(testing::DeterministicJob(2, 2, kSteps, 0, 5000));
  ASSERT_TRUE(job.ok()) << job.status();
  for (const char* w : {"w0", "w1"}) {
    ASSERT_TRUE(cluster.WaitForHook(w, "before_step", kWait).ok());
  }

  // etcd gone: the leader cannot renew its lease nor keep what it decides, and steps down; the
  // standby cannot lead, and says why.
  on->etcd->member(0)->Signal(SIGKILL);
  ASSERT_TRUE(on->etcd->member(0)->Wait(absl::Seconds(10)).ok());
  auto code = cluster.coordinator(0)->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status() << cluster.Logs();
  EXPECT_EQ(*code, 3);
  // No coordinator leads, and the group trains on, to its last step.
  for (const char* w : {"w0", "w1"}) cluster.ReleaseHook(w, "before_step");
  const std::string finished = absl::StrCat(job->job_id(), " finished at step ", kSteps);
  for (const char* w : {"w0", "w1"}) {
    ASSERT_TRUE(absl::StrContains(WaitForLog(cluster, w, finished, kWait), finished))
        << cluster.Logs();
  }
  const std::string standby = cluster.coordinator_address(1);
  std::string said;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!absl::StrContains(said, "no leader is known") && absl::Now() < deadline) {
    auto listed = testing::RunCommand({LOCKSTEP_CTL_BIN, "--coordinator=" + standby, "list"},
                                      absl::Seconds(20));
    ASSERT_TRUE(listed.ok());
    said = listed->output;
  }
  EXPECT_TRUE(absl::StrContains(said,
                                "UNAVAILABLE: this coordinator is a standby and no leader "
                                "is known: etcd"))
      << said;

  // etcd back: the standby leads with every job, and the job ends with exactly its steps, all
  // trained while no coordinator led: the members only finish it from what they hold.
  ASSERT_TRUE(on->etcd->Restart(0).ok());
  auto leader = cluster.FollowLeader(absl::Seconds(60));
  ASSERT_TRUE(leader.ok()) << leader.status();
  EXPECT_EQ(*leader, 1);
  ExpectEndsWhole(cluster, job->job_id(), kSteps);
  auto done = cluster.Get(job->job_id());
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->recovery_history_size(), 1);
  EXPECT_EQ(done->recovery_history(0).resumed_from_step(), kSteps);
}

TEST(EtcdTest, ADeposedLeadersWritesAreRefused) {
  SKIP_WITHOUT_ETCD();
  auto etcd = Etcd::Start(1);
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  auto client = coordinator::EtcdClient::Connect((*etcd)->endpoints(), "/t/", absl::Seconds(10));
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE(coordinator::EtcdClusterId(client->get(), "/t/").ok());
  // Why each lost the leadership: set by the renewing thread or by a refused write.
  absl::Mutex mu;
  std::string a_lost, b_lost;
  auto campaign = [&](const std::string& address, std::string* lost) {
    coordinator::LeadershipOptions options;
    options.prefix = "/t/";
    options.address = address;
    return coordinator::Leadership::Campaign(
        client->get(), options, [](const std::string&, const std::string&) {},
        [lost, &mu](const std::string& reason) {
          absl::MutexLock lock(&mu);
          *lost = reason;
        },
        [] { return false; });
  };
  auto a = campaign("a:1", &a_lost);
  ASSERT_TRUE(a.ok()) << a.status();
  coordinator::EtcdJobStore a_store(client->get(), "/t/", a->get());
  v1::Job job;
  job.set_job_id("job-1-abcdef");
  job.set_step(10);
  ASSERT_TRUE(a_store.Save(job).ok());

  // A's lease ends behind its back (as when it was frozen past it); B leads.
  ASSERT_TRUE((*client)->LeaseRevoke((*a)->lease()).ok());
  auto b = campaign("b:2", &b_lost);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_GT((*b)->term(), (*a)->term());
  coordinator::EtcdJobStore b_store(client->get(), "/t/", b->get());
  job.set_step(20);
  ASSERT_TRUE(b_store.Save(job).ok());

  job.set_step(11);
  absl::Status refused = a_store.Save(job);
  EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "no longer leads")) << refused;
  {
    // Whichever saw it first: the refused write, or A's renewal finding its lease gone.
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(absl::StrContains(a_lost, "another coordinator leads") ||
                absl::StrContains(a_lost, "lease expired"))
        << a_lost;
    EXPECT_TRUE(b_lost.empty()) << b_lost;
  }
  auto jobs = b_store.LoadAll();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].step(), 20);  // B's write, never A's late one
  (*b)->Resign();
}

// etcd that requires TLS and a client certificate: coordinators given the CA and a certificate
// lead, store a job and hand it over; one with plaintext endpoints, without a client
// certificate or with another CA's trust is refused at start, saying why.
TEST(EtcdTest, CoordinatorsReachEtcdOverTls) {
  SKIP_WITHOUT_ETCD();
  auto etcd = Etcd::Start(1, /*tls=*/true);
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const TlsFiles tls = EtcdClientTls();
  const std::vector<std::string> flags = {"--etcd_tls_ca=" + tls.ca, "--etcd_tls_cert=" + tls.cert,
                                          "--etcd_tls_key=" + tls.key};
  auto cluster = Cluster::StartOnEtcd((*etcd)->endpoints(), 2, flags);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_TRUE((*cluster)->FollowLeader(absl::Seconds(10)).ok());
  auto job = (*cluster)->Submit(testing::DeterministicJob(2, 2, 20, 0, 5000));
  ASSERT_TRUE(job.ok()) << job.status();
  (*cluster)->coordinator(0)->Signal(SIGKILL);
  auto leader = (*cluster)->FollowLeader(absl::Seconds(20));
  ASSERT_TRUE(leader.ok()) << leader.status();
  EXPECT_EQ(*leader, 1);
  auto kept = (*cluster)->Get(job->job_id());  // read back from etcd over TLS
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->state(), v1::JOB_STATE_PENDING);

  auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = {LOCKSTEP_COORDINATOR_BIN, "--listen=127.0.0.1:0",
                                     "--state_backend=etcd"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto result = testing::RunCommand(argv, absl::Seconds(30));
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : testing::CommandResult{};
  };
  const std::string plain = absl::StrReplaceAll((*etcd)->endpoints(), {{"https://", "http://"}});
  const std::string pki = testing::Pki::Get().dir;
  for (const auto& [extra, words] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           // TLS files with a plaintext endpoint.
           {{"--etcd_endpoints=" + plain, flags[0], flags[1], flags[2]},
            "every endpoint must be https://"},
           // No client certificate: etcd refuses the handshake.
           {{"--etcd_endpoints=" + (*etcd)->endpoints(), flags[0]}, "no etcd endpoint answers"},
           // etcd's certificate checked against another CA.
           {{"--etcd_endpoints=" + (*etcd)->endpoints(), "--etcd_tls_ca=" + pki + "/other-ca.crt",
             flags[1], flags[2]},
            "no etcd endpoint answers"},
           {{"--etcd_endpoints=" + (*etcd)->endpoints(), flags[0], flags[1]},
            "--etcd_tls_cert and --etcd_tls_key go together"}}) {
    auto result = run(extra);
    EXPECT_EQ(result.exit_code, 1) << absl::StrJoin(extra, " ");
    EXPECT_TRUE(absl::StrContains(result.output, words)) << result.output;
  }
}

TEST(EtcdTest, BadEndpointsAndForeignPrefixesAreRefusedAtStart) {
  SKIP_WITHOUT_ETCD();
  auto etcd = Etcd::Start(1);
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  auto run = [](std::vector<std::string> flags) {
    std::vector<std::string> argv = {LOCKSTEP_COORDINATOR_BIN, "--listen=127.0.0.1:0"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto result = testing::RunCommand(argv, absl::Seconds(30));
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : testing::CommandResult{};
  };
  const int dead = FreePort();
  auto unreachable =
      run({"--state_backend=etcd", absl::StrCat("--etcd_endpoints=http://127.0.0.1:", dead)});
  EXPECT_EQ(unreachable.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(unreachable.output, "no etcd endpoint answers"))
      << unreachable.output;
  EXPECT_TRUE(absl::StrContains(unreachable.output, absl::StrCat("127.0.0.1:", dead)))
      << unreachable.output;

  auto client = coordinator::EtcdClient::Connect((*etcd)->endpoints(), "/", absl::Seconds(10));
  ASSERT_TRUE(client.ok());
  etcdserverpb::TxnRequest txn;
  txn.add_success()->mutable_request_put()->set_key("/theirs/config");
  ASSERT_TRUE((*client)->Txn(txn).ok());
  auto foreign = run({"--state_backend=etcd", "--etcd_endpoints=" + (*etcd)->endpoints(),
                      "--etcd_prefix=/theirs"});
  EXPECT_EQ(foreign.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(foreign.output, "not a Lockstep cluster's (/theirs/config"))
      << foreign.output;

  // Refused before anything is written: the directory is not created.
  const std::string state_dir =
      (std::filesystem::temp_directory_path() / absl::StrCat("lockstep-etcd-state-", getpid()))
          .string();
  for (const auto& [flags, words] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--state_backend=etcd", "--etcd_endpoints=" + (*etcd)->endpoints(),
             "--state_dir=" + state_dir},
            "--state_dir is the file backend's"},
           {{"--state_backend=zookeeper"}, "not \"file\" or \"etcd\""},
           {{"--etcd_endpoints=" + (*etcd)->endpoints()},
            "--etcd_endpoints needs --state_backend=etcd"},
           {{"--state_backend=etcd", "--etcd_endpoints=https://127.0.0.1:1"},
            "https:// needs --etcd_tls_ca"},
           {{"--state_backend=etcd", "--etcd_endpoints=" + (*etcd)->endpoints(),
             "--etcd_tls_ca=/nonexistent/ca.crt"},
            "--etcd_tls_ca: cannot read /nonexistent/ca.crt"},
           {{"--etcd_tls_ca=" + testing::Pki::Get().Path("ca.crt")},
            "--etcd_tls_* need --state_backend=etcd"},
           {{"--state_backend=etcd", "--etcd_endpoints=" + (*etcd)->endpoints(), "--etcd_prefix=x"},
            "must start with /"}}) {
    auto result = run(flags);
    EXPECT_EQ(result.exit_code, 1) << absl::StrJoin(flags, " ");
    EXPECT_TRUE(absl::StrContains(result.output, words)) << result.output;
  }
  EXPECT_FALSE(std::filesystem::exists(state_dir));
}

}  // namespace
}  // namespace lockstep
