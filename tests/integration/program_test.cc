// Program jobs: the user's own script, run by workers started with --programs_root. Each test
// runs real workers and real Python processes, and checks what a user relies on: torchrun's
// environment, a failed or killed process restarting the group, a fatal exit code failing the
// job, nothing of a program outliving its stop or its worker, a hang found by the step
// timeout, and scripts outside the root refused with the worker left healthy.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/http.h"

namespace lockstep {
namespace {

using testing::Cluster;

constexpr absl::Duration kJobWait = absl::Seconds(180);

// Where a test's programs live (the workers' --programs_root) and write what they saw
// (world-writable: the programs may run as nobody).
struct Programs {
  std::string root;
  std::string out;
};

Programs MakePrograms(const Cluster& cluster) {
  Programs p{cluster.dir() + "/programs", cluster.dir() + "/programs/out"};
  std::filesystem::create_directories(p.out);
  chmod(cluster.dir().c_str(), 0755);
  chmod(p.root.c_str(), 0755);
  chmod(p.out.c_str(), 0777);
  return p;
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  chmod(path.c_str(), 0644);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The worker flags that let it run the test's programs: as nobody when the test runs as root
// (the switch of user is part of what is tested), else as the test's own user.
std::vector<std::string> ProgramFlags(const Programs& p, bool as_nobody = true) {
  std::vector<std::string> flags = {"--programs_root=" + p.root};
  if (geteuid() == 0) {
    flags.push_back(as_nobody ? "--program_user=nobody" : "--allow_programs_as_root");
  }
  return flags;
}

// Workers that run the test's programs.
void StartProgramWorkers(Cluster& cluster, const Programs& p,
                         const std::vector<std::string>& names) {
  for (const std::string& name : names) {
    ASSERT_TRUE(cluster.StartWorker(name, ProgramFlags(p)).ok()) << cluster.Logs();
  }
}

v1::JobSpec ProgramJob(const Programs& p, std::vector<std::string> argv, int min_workers,
                       int max_workers) {
  v1::JobSpec spec;
  spec.set_name("program");
  spec.set_min_workers(min_workers);
  spec.set_max_workers(max_workers);
  spec.set_heartbeat_timeout_ms(5000);
  for (std::string& a : argv) spec.mutable_program()->add_argv(std::move(a));
  spec.mutable_program()->set_workdir(p.root);
  spec.mutable_program()->set_stop_grace_ms(1000);
  return spec;
}

// "NAME=value" lines into a map.
std::map<std::string, std::string> ParseEnv(const std::string& text) {
  std::map<std::string, std::string> env;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    const size_t eq = line.find('=');
    if (eq != absl::string_view::npos) {
      env[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
    }
  }
  return env;
}

// Waits until `path` exists (bounded).
bool WaitForFile(const std::string& path, absl::Duration timeout) {
  const absl::Time until = absl::Now() + timeout;
  while (absl::Now() < until) {
    if (std::filesystem::exists(path)) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

// Waits until the process `pid` is gone (bounded).
bool WaitGone(pid_t pid, absl::Duration timeout) {
  const absl::Time until = absl::Now() + timeout;
  while (absl::Now() < until) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

pid_t ReadPid(const std::string& path) {
  int pid = 0;
  EXPECT_TRUE(absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadFile(path)), &pid)) << path;
  return pid;
}

// Submits `spec` and waits for the job to end.
absl::StatusOr<v1::Job> RunToEnd(Cluster& cluster, const v1::JobSpec& spec) {
  auto job = cluster.Submit(spec);
  if (!job.ok()) return job.status();
  return cluster.WaitForEnd(job->job_id(), kJobWait);
}

std::unique_ptr<Cluster> StartCluster(const std::string& token = "") {
  auto cluster = Cluster::Start({}, token);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  return cluster.ok() ? *std::move(cluster) : nullptr;
}

class ProgramTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The workers' programs import lockstep.torch from the build tree.
    setenv("PYTHONPATH", LOCKSTEP_PYTHON_DIR, 1);
  }
};

// Writes every variable a torchrun script reads, and its arguments, to out/gen-G-rank-R.env.
constexpr char kEnvScript[] = R"py(import os, sys
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
path = os.path.join(out, "gen-%s-rank-%s.env" % (os.environ["LOCKSTEP_GENERATION"], os.environ["RANK"]))
with open(path + ".tmp", "w") as f:
    for name, value in sorted(os.environ.items()):
        f.write("%s=%s\n" % (name, value))
    f.write("ARGV=%s\n" % " ".join(sys.argv[1:]))
os.rename(path + ".tmp", path)
)py";

TEST_F(ProgramTest, EnvironmentIsTorchrunsOnThreeWorkersAcrossTwoHosts) {
  const std::string token = "sekrit-token-7f3a9";
  auto cluster = StartCluster(token);
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/env.py", kEnvScript);
  // The worker's own environment holds where its token is; the program must not see it.
  setenv("LOCKSTEP_TOKEN_FILE", cluster->token_file().c_str(), 1);
  for (const auto& [name, host] : std::vector<std::pair<std::string, std::string>>{
           {"w0", "alpha"}, {"w1", "alpha"}, {"w2", "beta"}}) {
    std::vector<std::string> flags = ProgramFlags(p);
    flags.push_back("--host=" + host);
    ASSERT_TRUE(cluster->StartWorker(name, flags).ok()) << cluster->Logs();
  }
  unsetenv("LOCKSTEP_TOKEN_FILE");
  v1::JobSpec spec = ProgramJob(p, {"/usr/bin/python3", "env.py", "--epochs=2"}, 3, 3);
  spec.set_threads_per_worker(2);
  spec.set_max_restarts(4);
  spec.mutable_program()->set_local_rank_arg("--local-rank");
  (*spec.mutable_program()->mutable_env())["EXTRA_SETTING"] = "yes";
  auto done = RunToEnd(*cluster, spec);
  ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
  ASSERT_EQ(done->recoveries(), 0) << done->DebugString() << cluster->Logs();

  std::string master;
  for (int rank = 0; rank < 3; ++rank) {
    SCOPED_TRACE(absl::StrCat("rank ", rank));
    auto env = ParseEnv(ReadFile(absl::StrCat(p.out, "/gen-1-rank-", rank, ".env")));
    const std::string host = done->members(rank).host();
    // Host-contiguous ranks: alpha's two members first, then beta's.
    EXPECT_EQ(host, rank < 2 ? "alpha" : "beta");
    EXPECT_EQ(env["RANK"], absl::StrCat(rank));
    EXPECT_EQ(env["WORLD_SIZE"], "3");
    EXPECT_EQ(env["LOCAL_RANK"], rank < 2 ? absl::StrCat(rank) : "0");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], rank < 2 ? "2" : "1");
    EXPECT_EQ(env["GROUP_RANK"], rank < 2 ? "0" : "1");
    EXPECT_EQ(env["GROUP_WORLD_SIZE"], "2");
    EXPECT_EQ(env["ROLE_NAME"], "default");
    EXPECT_EQ(env["ROLE_RANK"], absl::StrCat(rank));
    EXPECT_EQ(env["ROLE_WORLD_SIZE"], "3");
    EXPECT_EQ(env["MASTER_ADDR"], "127.0.0.1");
    int port = 0;
    EXPECT_TRUE(absl::SimpleAtoi(env["MASTER_PORT"], &port) && port > 0) << env["MASTER_PORT"];
    if (rank == 0) master = env["MASTER_PORT"];
    EXPECT_EQ(env["MASTER_PORT"], master);
    EXPECT_EQ(env["TORCHELASTIC_RUN_ID"], done->job_id());
    EXPECT_EQ(env["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(env["TORCHELASTIC_MAX_RESTARTS"], "4");
    EXPECT_EQ(env["LOCKSTEP_JOB_ID"], done->job_id());
    EXPECT_EQ(env["LOCKSTEP_GENERATION"], "1");
    EXPECT_EQ(env["LOCKSTEP_WORKER"], done->members(rank).worker_name());
    EXPECT_EQ(env["OMP_NUM_THREADS"], "2");
    EXPECT_EQ(env["EXTRA_SETTING"], "yes");
    EXPECT_EQ(env["ARGV"], absl::StrCat("--epochs=2 --local-rank=", env["LOCAL_RANK"]));
    EXPECT_EQ(env.count("CUDA_VISIBLE_DEVICES"), 0u);
    EXPECT_TRUE(absl::StartsWith(env["LOCKSTEP_AGENT_ADDRESS"], "unix:"));
    EXPECT_EQ(env["LOCKSTEP_AGENT_TOKEN"].size(), 32u);
    EXPECT_EQ(env.count("LOCKSTEP_TOKEN_FILE"), 0u);
    if (geteuid() == 0) {
      EXPECT_EQ(env["USER"], "nobody");
    }
    for (const auto& [name, value] : env) {
      EXPECT_FALSE(absl::StrContains(value, token)) << name << " carries the token";
    }
  }
}

// Raises in generation 1 on rank 1, writes its restart count in every generation.
constexpr char kFailOnceScript[] = R"py(import os, time
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
gen, rank = os.environ["LOCKSTEP_GENERATION"], os.environ["RANK"]
path = os.path.join(out, "restart-%s-%s" % (gen, rank))
with open(path + ".tmp", "w") as f:
    f.write(os.environ["TORCHELASTIC_RESTART_COUNT"])
os.rename(path + ".tmp", path)
if gen == "1" and rank == "1":
    # Once rank 0 has run (a failure stops the whole group, and on a loaded machine rank 0
    # might not have started yet).
    deadline = time.time() + 60
    while not os.path.exists(os.path.join(out, "restart-1-0")) and time.time() < deadline:
        time.sleep(0.02)
    raise ValueError("boom on rank 1")
)py";

// Writes its environment, how it was started, and whether torch was imported before the script
// ran (a warm start) to out/gen-G-WORKER.env; in generation 1 it then runs until it is stopped.
constexpr char kWarmScript[] = R"py(import os, sys, time
warm = "torch" in sys.modules
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
gen = os.environ["LOCKSTEP_GENERATION"]
path = os.path.join(out, "gen-%s-%s.env" % (gen, os.environ["LOCKSTEP_WORKER"]))
with open(path + ".tmp", "w") as f:
    for name, value in sorted(os.environ.items()):
        f.write("%s=%s\n" % (name, value))
    f.write("ARGV=%s\nCWD=%s\nPATH0=%s\nFILE=%s\nWARM=%s\n" % (
        " ".join(sys.argv), os.getcwd(), sys.path[0], __file__, warm))
os.rename(path + ".tmp", path)
while gen == "1":
    time.sleep(0.05)
)py";

// The interpreters parked by `worker` (worker/program/warm_start.h): children of its supervisors.
std::vector<pid_t> ParkedInterpreters(pid_t worker) {
  auto parent = [](const std::string& pid) {
    // /proc/PID/stat: "PID (COMM) STATE PPID ...", COMM may hold spaces and parentheses.
    const std::string stat = ReadFile("/proc/" + pid + "/stat");
    const size_t close = stat.rfind(')');
    int ppid = -1;
    if (close == std::string::npos) return ppid;
    const std::vector<std::string> fields =
        absl::StrSplit(stat.substr(close + 2), ' ', absl::SkipEmpty());
    if (fields.size() < 2 || !absl::SimpleAtoi(fields[1], &ppid)) return -1;
    return ppid;
  };
  std::vector<pid_t> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string pid = entry.path().filename();
    int n = 0;
    if (!absl::SimpleAtoi(pid, &n)) continue;
    if (!absl::StrContains(ReadFile("/proc/" + pid + "/cmdline"), "LOCKSTEP_PARKED_PROGRAM")) {
      continue;
    }
    const int supervisor = parent(pid);
    if (supervisor > 0 && parent(absl::StrCat(supervisor)) == worker) out.push_back(n);
  }
  return out;
}

TEST_F(ProgramTest, ARestartRunsInTheInterpreterParkedForItAndAParkedOneGoesWithItsWorker) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/warm.py", kWarmScript);
  for (const std::string name : {"w0", "w1"}) {
    std::vector<std::string> flags = ProgramFlags(p);
    flags.push_back("--test_hooks=warm_interpreter_parked");
    ASSERT_TRUE(cluster->StartWorker(name, flags).ok()) << cluster->Logs();
  }
  v1::JobSpec spec = ProgramJob(p, {"/usr/bin/python3", "warm.py", "--epochs=2"}, 1, 2);
  spec.set_max_restarts(4);
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  // Both members' workers parked an interpreter for the next generation (and hold there).
  for (const std::string name : {"w0", "w1"}) {
    ASSERT_TRUE(cluster->WaitForHook(name, "warm_interpreter_parked", absl::Seconds(60)).ok())
        << name << cluster->Logs();
  }
  // Launched; its exec (which names it) may take a moment more.
  std::vector<pid_t> parked;
  for (const absl::Time until = absl::Now() + absl::Seconds(30);
       parked.empty() && absl::Now() < until; absl::SleepFor(absl::Milliseconds(20))) {
    parked = ParkedInterpreters(cluster->worker("w1")->pid());
  }
  ASSERT_EQ(parked.size(), 1u) << cluster->Logs();
  // kill -9 of a worker while it holds a parked interpreter: the interpreter goes with it.
  cluster->worker("w1")->Signal(SIGKILL);
  EXPECT_TRUE(WaitGone(parked[0], absl::Seconds(10))) << "a parked interpreter outlived its worker";
  cluster->ReleaseHook("w0", "warm_interpreter_parked");
  auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
  ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
  EXPECT_TRUE(absl::StrContains(cluster->Logs(), "in a warm interpreter")) << cluster->Logs();

  // The survivor's next generation ran in its parked interpreter, and saw what a cold start
  // sees: every variable the same but those of the new generation, nothing more.
  auto cold = ParseEnv(ReadFile(p.out + "/gen-1-w0.env"));
  auto warm = ParseEnv(ReadFile(p.out + "/gen-2-w0.env"));
  ASSERT_FALSE(warm.empty()) << cluster->Logs();
  EXPECT_EQ(cold["WARM"], "False");
  EXPECT_EQ(warm["WARM"], "True");
  EXPECT_EQ(warm["WORLD_SIZE"], "1");
  EXPECT_EQ(warm["RANK"], "0");
  EXPECT_EQ(warm["LOCKSTEP_GENERATION"], "2");
  EXPECT_EQ(warm["TORCHELASTIC_RESTART_COUNT"], "1");
  const std::set<std::string> per_generation = {"WARM",
                                                "WORLD_SIZE",
                                                "RANK",
                                                "LOCAL_RANK",
                                                "LOCAL_WORLD_SIZE",
                                                "ROLE_RANK",
                                                "ROLE_WORLD_SIZE",
                                                "GROUP_RANK",
                                                "GROUP_WORLD_SIZE",
                                                "MASTER_ADDR",
                                                "MASTER_PORT",
                                                "LOCKSTEP_GENERATION",
                                                "TORCHELASTIC_RESTART_COUNT",
                                                "LOCKSTEP_AGENT_TOKEN"};
  for (const auto& [name, value] : cold) {
    if (per_generation.count(name) == 0) {
      EXPECT_EQ(warm[name], value) << name;
    }
  }
  for (const auto& [name, value] : warm) EXPECT_EQ(cold.count(name), 1u) << name << "=" << value;
  EXPECT_EQ(warm["ARGV"], "warm.py --epochs=2");
  EXPECT_EQ(warm["CWD"], cold["CWD"]);  // and PATH0 (sys.path[0]) and FILE (__file__) above
}

TEST_F(ProgramTest, FailedProcessRestartsTheGroupAndTheJobSucceeds) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/fail_once.py", kFailOnceScript);
  ASSERT_NO_FATAL_FAILURE(StartProgramWorkers(*cluster, p, {"w0", "w1"}));
  auto done = RunToEnd(*cluster, ProgramJob(p, {"/usr/bin/python3", "fail_once.py"}, 2, 2));
  ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
  EXPECT_EQ(done->recoveries(), 1);
  EXPECT_EQ(done->generation(), 2);
  ASSERT_EQ(done->program_exits_size(), 1) << done->DebugString() << cluster->Logs();
  const v1::ProgramExit& exit = done->program_exits(0);
  EXPECT_EQ(exit.rank(), 1);
  EXPECT_EQ(exit.generation(), 1);
  EXPECT_EQ(exit.exit_code(), 1);
  EXPECT_EQ(exit.signal(), "");
  EXPECT_EQ(exit.worker(), done->members(1).worker_name());
  EXPECT_EQ(exit.summary(), "ValueError: boom on rank 1");
  EXPECT_TRUE(absl::StrContains(exit.stderr_tail(), "Traceback (most recent call last)"))
      << exit.stderr_tail();
  ASSERT_EQ(done->recovery_history_size(), 1);
  EXPECT_TRUE(absl::StrContains(done->recovery_history(0).reason(),
                                "rank 1 (" + exit.worker() + ") exited with code 1"))
      << done->recovery_history(0).reason();
  EXPECT_TRUE(done->recovery_history(0).counted());
  for (const char* rank : {"0", "1"}) {
    EXPECT_EQ(ReadFile(absl::StrCat(p.out, "/restart-1-", rank)), "0");
    EXPECT_EQ(ReadFile(absl::StrCat(p.out, "/restart-2-", rank)), "1");
  }
  // lockstepctl logs: the failed rank's traceback, prefixed as torchrun's --tee does.
  auto logs = testing::RunCommand({LOCKSTEP_CTL_BIN, "--coordinator=" + cluster->address(), "logs",
                                   done->job_id(), "--rank=1", "--generation=1"},
                                  absl::Seconds(30));
  ASSERT_TRUE(logs.ok()) << logs.status();
  EXPECT_EQ(logs->exit_code, 0) << logs->output;
  EXPECT_TRUE(absl::StrContains(logs->output,
                                "--- generation 1 ---\n[default1]:Traceback "
                                "(most recent call last):"))
      << logs->output;
  EXPECT_TRUE(absl::StrContains(logs->output, "[default1]:ValueError: boom on rank 1"))
      << logs->output;
  EXPECT_FALSE(absl::StrContains(logs->output, "[default0]")) << logs->output;
}

TEST_F(ProgramTest, FatalExitCodeFailsTheJobAtOnceNamingRankAndCode) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/fatal.py", R"py(import os, sys, time
if os.environ["RANK"] == "1":
    print("the data set is gone", file=sys.stderr)
    sys.exit(7)
time.sleep(600)
)py");
  ASSERT_NO_FATAL_FAILURE(StartProgramWorkers(*cluster, p, {"w0", "w1"}));
  v1::JobSpec spec = ProgramJob(p, {"/usr/bin/python3", "fatal.py"}, 2, 2);
  spec.mutable_program()->add_fatal_exit_codes(7);
  auto done = RunToEnd(*cluster, spec);
  ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
  EXPECT_EQ(done->state(), v1::JOB_STATE_FAILED) << done->reason();
  EXPECT_TRUE(absl::StrContains(done->reason(), "rank 1")) << done->reason();
  EXPECT_TRUE(absl::StrContains(done->reason(), "exited with code 7 (a fatal exit code)"))
      << done->reason();
  EXPECT_TRUE(absl::StrContains(done->reason(), "the data set is gone")) << done->reason();
  EXPECT_EQ(done->recoveries(), 0);
  // Both workers stay healthy and are free again (rank 0's sleeping program was stopped).
  for (const char* name : {"w0", "w1"}) {
    EXPECT_TRUE(cluster->WaitForWorker(name, "idle", absl::Seconds(30)).ok()) << name;
  }
}

// Rank 0 forks a grandchild that ignores SIGTERM (and writes its pid); in generation 1 it then
// fails, in generation 2 it waits to be stopped.
constexpr char kGrandchildScript[] = R"py(import os, signal, subprocess, sys, time
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
gen, rank = os.environ["LOCKSTEP_GENERATION"], os.environ["RANK"]
if rank == "0":
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"])
    time.sleep(0.3)  # the grandchild ignores SIGTERM from here on
    with open(os.path.join(out, "grandchild-%s.tmp" % gen), "w") as f:
        f.write(str(child.pid))
    os.rename(os.path.join(out, "grandchild-%s.tmp" % gen), os.path.join(out, "grandchild-%s" % gen))
    if gen == "1":
        sys.exit(3)
time.sleep(3600)
)py";

TEST_F(ProgramTest, GrandchildIgnoringSigtermIsGoneAfterRestartAndCancel) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/grandchild.py", kGrandchildScript);
  ASSERT_NO_FATAL_FAILURE(StartProgramWorkers(*cluster, p, {"w0", "w1"}));
  auto job = cluster->Submit(ProgramJob(p, {"/usr/bin/python3", "grandchild.py"}, 2, 2));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(WaitForFile(p.out + "/grandchild-1", absl::Seconds(60))) << cluster->Logs();
  const pid_t first = ReadPid(p.out + "/grandchild-1");
  ASSERT_TRUE(WaitForFile(p.out + "/grandchild-2", absl::Seconds(60))) << cluster->Logs();
  const pid_t second = ReadPid(p.out + "/grandchild-2");
  // Restarted: generation 1's grandchild went with its group (SIGKILL after the grace).
  EXPECT_TRUE(WaitGone(first, absl::Seconds(10))) << "generation 1's grandchild " << first;
  EXPECT_EQ(kill(second, 0), 0) << "generation 2's grandchild should run";
  grpc::ClientContext context;
  v1::CancelJobRequest cancel;
  cancel.set_job_id(job->job_id());
  v1::Job cancelled;
  ASSERT_TRUE(cluster->jobs().CancelJob(&context, cancel, &cancelled).ok());
  EXPECT_TRUE(WaitGone(second, absl::Seconds(10))) << "generation 2's grandchild " << second;
  auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state(), v1::JOB_STATE_CANCELLED);
}

// Each rank writes its pid and its grandchild's; generation 1 runs until stopped.
constexpr char kPidsScript[] = R"py(import os, subprocess, sys, time
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
gen, rank = os.environ["LOCKSTEP_GENERATION"], os.environ["RANK"]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
name = "pids-%s-%s" % (gen, os.environ["LOCKSTEP_WORKER"])
with open(os.path.join(out, name + ".tmp"), "w") as f:
    f.write("%d %d" % (os.getpid(), child.pid))
os.rename(os.path.join(out, name + ".tmp"), os.path.join(out, name))
if gen == "1":
    time.sleep(3600)
child.kill()
)py";

std::pair<pid_t, pid_t> ReadPids(const std::string& path) {
  std::vector<std::string> parts = absl::StrSplit(ReadFile(path), ' ');
  int a = 0, b = 0;
  EXPECT_TRUE(parts.size() == 2 && absl::SimpleAtoi(parts[0], &a) && absl::SimpleAtoi(parts[1], &b))
      << path;
  return {a, b};
}

TEST_F(ProgramTest, KilledWorkerTakesItsProgramAlongAndTheGroupReformsOntoASpare) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/pids.py", kPidsScript);
  ASSERT_NO_FATAL_FAILURE(StartProgramWorkers(*cluster, p, {"w0", "w1", "w2"}));
  auto job = cluster->Submit(ProgramJob(p, {"/usr/bin/python3", "pids.py"}, 2, 2));
  ASSERT_TRUE(job.ok()) << job.status();
  auto running = cluster->WaitFor(
      job->job_id(), [](const v1::Job& j) { return j.members_size() == 2; }, kJobWait);
  ASSERT_TRUE(running.ok()) << running.status();
  const std::string victim = running->members(1).worker_name();
  const std::string pids_file = absl::StrCat(p.out, "/pids-1-", victim);
  ASSERT_TRUE(WaitForFile(pids_file, absl::Seconds(60))) << cluster->Logs();
  const auto [program, grandchild] = ReadPids(pids_file);
  cluster->worker(victim)->Signal(SIGKILL);
  EXPECT_TRUE(WaitGone(program, absl::Seconds(10))) << "the killed worker's program " << program;
  EXPECT_TRUE(WaitGone(grandchild, absl::Seconds(10))) << "its grandchild " << grandchild;
  auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
  ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
  ASSERT_EQ(done->members_size(), 2);
  for (const v1::Member& m : done->members()) EXPECT_NE(m.worker_name(), victim);
}

TEST_F(ProgramTest, KilledRankProcessRestartsTheGroup) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/pids.py", kPidsScript);
  ASSERT_NO_FATAL_FAILURE(StartProgramWorkers(*cluster, p, {"w0", "w1"}));
  auto job = cluster->Submit(ProgramJob(p, {"/usr/bin/python3", "pids.py"}, 2, 2));
  ASSERT_TRUE(job.ok()) << job.status();
  auto running = cluster->WaitFor(
      job->job_id(), [](const v1::Job& j) { return j.members_size() == 2; }, kJobWait);
  ASSERT_TRUE(running.ok()) << running.status();
  const std::string victim = running->members(1).worker_name();
  const std::string pids_file = absl::StrCat(p.out, "/pids-1-", victim);
  ASSERT_TRUE(WaitForFile(pids_file, absl::Seconds(60))) << cluster->Logs();
  const auto [program, grandchild] = ReadPids(pids_file);
  ASSERT_EQ(kill(program, SIGKILL), 0);
  auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
  ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
  EXPECT_EQ(done->recoveries(), 1);
  ASSERT_EQ(done->program_exits_size(), 1);
  EXPECT_EQ(done->program_exits(0).signal(), "SIGKILL");
  EXPECT_EQ(done->program_exits(0).rank(), 1);
  EXPECT_TRUE(WaitGone(grandchild, absl::Seconds(10))) << "the killed rank's grandchild";
  // The same workers trained on: the worker itself was healthy.
  std::vector<std::string> names;
  for (const v1::Member& m : done->members()) names.push_back(m.worker_name());
  EXPECT_EQ(names.size(), 2u);
}

// Reports steps through lockstep.torch over a Gloo group formed on the coordinator's store; in
// generation 1, rank 1 stops taking part after step 3 and rank 0 waits in the all-reduce.
constexpr char kHangScript[] = R"py(import os, time
import torch, torch.distributed as dist
import lockstep.torch as lt
lt.init_process_group("gloo")
gen, rank = int(os.environ["LOCKSTEP_GENERATION"]), dist.get_rank()
for step in range(1, 7):
    if gen == 1 and rank == 1 and step == 4:
        time.sleep(3600)
    t = torch.ones(4) * (rank + 1)
    dist.all_reduce(t)
    assert t[0].item() == 3.0, t
    lt.report(step=step, loss=1.0 / step, samples=8)
dist.destroy_process_group()
)py";

TEST_F(ProgramTest, HangInsideACollectiveIsFoundByTheStepTimeout) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/hang.py", kHangScript);
  for (const char* name : {"w0", "w1"}) {
    std::vector<std::string> flags = ProgramFlags(p);
    flags.push_back("--metrics_listen=127.0.0.1:0");
    flags.push_back(absl::StrCat("--metrics_port_file=", cluster->dir(), "/", name, ".port"));
    ASSERT_TRUE(cluster->StartWorker(name, flags).ok()) << cluster->Logs();
  }
  v1::JobSpec spec = ProgramJob(p, {"/usr/bin/python3", "hang.py"}, 2, 2);
  spec.set_step_timeout_ms(4000);
  auto done = RunToEnd(*cluster, spec);
  ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
  EXPECT_EQ(done->step(), 6);
  EXPECT_DOUBLE_EQ(done->loss(), 1.0 / 6);
  ASSERT_EQ(done->recovery_history_size(), 1) << cluster->Logs();
  const v1::Recovery& r = done->recovery_history(0);
  EXPECT_TRUE(absl::StrContains(r.reason(), "no step completed")) << r.reason();
  EXPECT_TRUE(absl::StrContains(r.reason(), "step_timeout_ms 4000")) << r.reason();
  EXPECT_EQ(r.step_at_detection(), 3);
  // The program starts over (it keeps no checkpoint): the recovery says it redid 3 steps.
  EXPECT_EQ(r.resumed_from_step(), 0);
  EXPECT_EQ(r.steps_redone(), 3);
  EXPECT_GT(r.first_step_unix_ms(), 0);
  // The reports reached each worker's metrics: 3 steps, then 6 again.
  for (const char* name : {"w0", "w1"}) {
    int port = 0;
    ASSERT_TRUE(absl::SimpleAtoi(
        absl::StripAsciiWhitespace(ReadFile(absl::StrCat(cluster->dir(), "/", name, ".port"))),
        &port));
    auto metrics = testing::HttpGet("127.0.0.1", port, "/metrics");
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    EXPECT_TRUE(absl::StrContains(*metrics, "lockstep_worker_steps_total 9")) << *metrics;
    EXPECT_TRUE(absl::StrContains(*metrics, "lockstep_worker_runs_total 2")) << *metrics;
  }
}

TEST_F(ProgramTest, ScriptsOutsideTheRootAreRefusedAndTheWorkerStaysHealthy) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  const std::string outside = cluster->dir() + "/outside";
  std::filesystem::create_directories(outside);
  WriteFile(outside + "/evil.py", "print('should never run')\n");
  WriteFile(p.root + "/ok.py", "print('ok')\n");
  std::filesystem::create_symlink(outside + "/evil.py", p.root + "/escape.py");
  ASSERT_TRUE(cluster->StartWorker("w0", ProgramFlags(p)).ok()) << cluster->Logs();
  struct Case {
    std::string what;
    v1::JobSpec spec;
    std::string reason;
  };
  std::vector<Case> cases;
  {
    v1::JobSpec spec = ProgramJob(p, {"/usr/bin/python3", "evil.py"}, 1, 1);
    spec.mutable_program()->set_workdir(outside);
    cases.push_back({"workdir outside", spec, "program.workdir"});
  }
  cases.push_back({"symlink escaping", ProgramJob(p, {"/usr/bin/python3", "escape.py"}, 1, 1),
                   "program.argv[1]"});
  cases.push_back({"script outside",
                   ProgramJob(p, {"/usr/bin/python3", outside + "/evil.py"}, 1, 1),
                   "outside the allowed directories"});
  cases.push_back({"missing script", ProgramJob(p, {"/usr/bin/python3", "nope.py"}, 1, 1),
                   "program.argv[1]: no file"});
  cases.push_back(
      {"no interpreter", ProgramJob(p, {"no-such-python", "ok.py"}, 1, 1), "not found in PATH"});
  WriteFile(p.root + "/not_executable.sh", "#!/bin/sh\necho hi\n");  // mode 0644
  cases.push_back({"not executable", ProgramJob(p, {"./not_executable.sh"}, 1, 1),
                   "program.argv[0]: cannot run"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    auto job = cluster->Submit(c.spec);
    ASSERT_TRUE(job.ok()) << job.status();
    auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
    ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
    EXPECT_EQ(done->state(), v1::JOB_STATE_FAILED);
    EXPECT_TRUE(absl::StrContains(done->reason(), c.reason)) << done->reason();
    EXPECT_TRUE(cluster->WaitForWorker("w0", "idle", absl::Seconds(30)).ok());
  }
  EXPECT_FALSE(absl::StrContains(cluster->Logs(), "should never run"));
  // And the healthy worker runs a good one.
  auto job = cluster->Submit(ProgramJob(p, {"/usr/bin/python3", "ok.py"}, 1, 1));
  ASSERT_TRUE(job.ok()) << job.status();
  auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
}

TEST_F(ProgramTest, ProgramJobsWaitForWorkersThatRunPrograms) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/ok.py", "print('ok')\n");
  ASSERT_TRUE(cluster->StartWorker("plain").ok()) << cluster->Logs();
  auto job = cluster->Submit(ProgramJob(p, {"/usr/bin/python3", "ok.py"}, 1, 1));
  ASSERT_TRUE(job.ok()) << job.status();
  auto waiting = cluster->WaitFor(
      job->job_id(),
      [](const v1::Job& j) { return absl::StrContains(j.reason(), "that run programs"); },
      absl::Seconds(30));
  ASSERT_TRUE(waiting.ok()) << waiting.status();
  EXPECT_EQ(waiting->state(), v1::JOB_STATE_PENDING);
  EXPECT_TRUE(absl::StrContains(waiting->reason(),
                                "0 that run programs (lockstep-worker "
                                "--programs_root)"))
      << waiting->reason();
  ASSERT_TRUE(cluster->StartWorker("runner", ProgramFlags(p)).ok()) << cluster->Logs();
  auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason();
  ASSERT_EQ(done->members_size(), 1);
  EXPECT_EQ(done->members(0).worker_name(), "runner");
}

// The example script (examples/torch/train.py), copied into the test's programs root.
void CopyExample(const Programs& p) {
  std::filesystem::copy_file(std::string(LOCKSTEP_SOURCE_DIR) + "/examples/torch/train.py",
                             p.root + "/train.py",
                             std::filesystem::copy_options::overwrite_existing);
  chmod((p.root + "/train.py").c_str(), 0644);
}

// "final_loss=..." as the script printed it (rank 0), or "" when it did not.
std::string FinalLoss(const std::string& output) {
  const size_t at = output.rfind("final_loss=");
  if (at == std::string::npos) return "";
  const size_t end = output.find_first_of("\r\n", at);
  return output.substr(at + 11, end == std::string::npos ? std::string::npos : end - at - 11);
}

// The same script under torchrun on `n` processes of this host.
std::string TorchrunFinalLoss(int n, const std::vector<std::string>& args, const std::string& dir) {
  std::vector<std::string> argv = {"/usr/bin/python3", "-m", "torch.distributed.run",
                                   "--standalone", absl::StrCat("--nproc_per_node=", n),
                                   // Debian's torchrun on Python 3.11 needs both (FACTS).
                                   "--redirects=9:1", "--tee=9:1", dir + "/train.py"};
  argv.insert(argv.end(), args.begin(), args.end());
  auto result = testing::RunCommand(argv, absl::Seconds(300));
  EXPECT_TRUE(result.ok()) << result.status();
  if (!result.ok()) return "";
  EXPECT_EQ(result->exit_code, 0) << result->output;
  return FinalLoss(result->output);
}

// Rank 0's output lines of the job, joined.
std::string RankZeroOutput(Cluster& cluster, const std::string& job_id) {
  v1::GetJobLogsRequest request;
  request.set_job_id(job_id);
  request.set_rank(0);
  request.set_max_lines(10000);
  v1::JobLogs logs;
  grpc::ClientContext context;
  EXPECT_TRUE(cluster.jobs().GetJobLogs(&context, request, &logs).ok());
  std::string out;
  for (const v1::LogLine& line : logs.lines()) absl::StrAppend(&out, line.text(), "\n");
  return out;
}

TEST_F(ProgramTest, ExampleEndsWithTorchrunsFinalLossOnTwoAndThreeWorkers) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  CopyExample(p);
  ASSERT_NO_FATAL_FAILURE(StartProgramWorkers(*cluster, p, {"w0", "w1", "w2"}));
  for (int n : {2, 3}) {
    SCOPED_TRACE(absl::StrCat(n, " workers"));
    const std::string reference = TorchrunFinalLoss(
        n, {"--steps=40", "--checkpoint-dir=" + p.out + "/torchrun-" + absl::StrCat(n)}, p.root);
    ASSERT_FALSE(reference.empty());
    v1::JobSpec spec = ProgramJob(p,
                                  {"/usr/bin/python3", "train.py", "--steps=40",
                                   absl::StrCat("--checkpoint-dir=", p.out, "/lockstep-", n)},
                                  n, n);
    spec.mutable_program()->set_local_rank_arg("--local_rank");
    auto job = cluster->Submit(spec);
    ASSERT_TRUE(job.ok()) << job.status();
    auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
    ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
    ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
    EXPECT_EQ(FinalLoss(RankZeroOutput(*cluster, job->job_id())), reference);
    // The script reports through lockstep.torch: the job knows its steps and loss.
    EXPECT_EQ(done->step(), 40);
    EXPECT_GT(done->loss(), 0);
  }
}

// The pid of the process whose command line holds every one of `parts` (0: none).
pid_t FindProcess(const std::vector<std::string>& parts) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    int pid = 0;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &pid)) continue;
    std::string cmdline = ReadFile(entry.path().string() + "/cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    bool all = !cmdline.empty();
    for (const std::string& part : parts) all = all && absl::StrContains(cmdline, part);
    if (all) return pid;
  }
  return 0;
}

TEST_F(ProgramTest, KilledRankResumesFromItsCheckpointWithTheUndisturbedFinalLoss) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  CopyExample(p);
  ASSERT_NO_FATAL_FAILURE(StartProgramWorkers(*cluster, p, {"w0", "w1"}));
  const std::vector<std::string> args = {"--steps=100", "--checkpoint-every=20"};
  std::vector<std::string> reference_args = args;
  reference_args.push_back("--checkpoint-dir=" + p.out + "/reference");
  const std::string reference = TorchrunFinalLoss(2, reference_args, p.root);
  ASSERT_FALSE(reference.empty());
  const std::string checkpoints = p.out + "/killed";
  std::vector<std::string> argv = {"/usr/bin/python3", "train.py", "--sleep-ms=40",
                                   "--checkpoint-dir=" + checkpoints};
  argv.insert(argv.end(), args.begin(), args.end());
  v1::JobSpec spec = ProgramJob(p, argv, 2, 2);
  spec.mutable_program()->set_local_rank_arg("--local_rank");
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  // Past the checkpoint of step 40: kill -9 rank 1's Python process.
  auto past = cluster->WaitFor(
      job->job_id(), [](const v1::Job& j) { return j.step() >= 45; }, kJobWait);
  ASSERT_TRUE(past.ok()) << past.status() << cluster->Logs();
  const pid_t victim =
      FindProcess({"train.py", "--checkpoint-dir=" + checkpoints, "--local_rank=1"});
  ASSERT_GT(victim, 0);
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
  ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
  EXPECT_EQ(done->step(), 100);
  EXPECT_EQ(FinalLoss(RankZeroOutput(*cluster, job->job_id())), reference);
  ASSERT_GE(done->recovery_history_size(), 1);
  const v1::Recovery& r = done->recovery_history(0);
  EXPECT_GE(r.step_at_detection(), 45);
  // Resumed from a checkpoint (every 20 steps), not from the start.
  EXPECT_GE(r.resumed_from_step(), 40) << r.reason();
  EXPECT_EQ(r.resumed_from_step() % 20, 0) << r.reason();
  EXPECT_EQ(r.steps_redone(), r.step_at_detection() - r.resumed_from_step());
  ASSERT_GE(done->program_exits_size(), 1);
  EXPECT_EQ(done->program_exits(0).signal(), "SIGKILL");
}

// Trains a small model with DDP over Gloo for STEPS steps (data depends only on step and rank),
// saving through lockstep.torch.Checkpointer after every step; writes TAG-gen-G-rank-R.restored
// (what load() returned) and, at the end, TAG-final (steps and a digest of the parameters).
// HOLD (generation 1 only): "after-save:K" waits after every rank's save of step K (having
// written TAG-held-RANK with its pid); "mid-save:K:R" holds rank R inside its save of step K,
// its tensors copied and not committed (lockstep.checkpoint's test hook writes TAG-held-R).
// NONBLOCKING=1: every save is save(..., blocking=False), its checksum and commit in a thread.
constexpr char kCheckpointScript[] = R"py(import hashlib, os, sys, time
import torch, torch.nn as nn, torch.distributed as dist
import lockstep.torch as lt
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
tag, steps = sys.argv[1], int(sys.argv[2])
gen, rank = os.environ["LOCKSTEP_GENERATION"], int(os.environ["RANK"])
hold = os.environ.get("HOLD", "") if gen == "1" else ""
nonblocking = os.environ.get("NONBLOCKING") == "1"
step_sleep = float(os.environ.get("STEP_SLEEP", "0"))
def write(name, text):
    path = os.path.join(out, "%s-%s" % (tag, name))
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)
lt.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
ddp = nn.parallel.DistributedDataParallel(model)
if hold.startswith("mid-save:") and hold.split(":")[2] == str(rank):
    # read when the Checkpointer is made: its save of that step stops before the commit
    os.environ["LOCKSTEP_TEST_HOLD_SAVE_AT_STEP"] = hold.split(":")[1]
    os.environ["LOCKSTEP_TEST_HOLD_SAVE_FILE"] = os.path.join(out, "%s-held-%d" % (tag, rank))
ckpt = lt.Checkpointer()
start = ckpt.load(model, opt)
write("gen-%s-rank-%d.restored" % (gen, rank), str(start))
for step in range((start or 0) + 1, steps + 1):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
    loss = ((ddp(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    handle = ckpt.save(step, model, opt, extra={"step": step}, blocking=not nonblocking)
    lt.report(step, loss=loss.item())
    time.sleep(step_sleep)
    if hold == "after-save:%d" % step:
        if handle is not None:
            handle.wait()
        write("held-%d" % rank, str(os.getpid()))
        while True:
            time.sleep(1)
digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values()))
if rank == 0:
    write("final", "%d %s" % (steps, digest.hexdigest()))
del ddp
dist.destroy_process_group()
)py";

// ckpt.py TAG STEPS as a job of two workers, HOLD in its environment ("": none).
v1::JobSpec CheckpointJob(const Programs& p, const std::string& tag, int steps,
                          const std::string& hold) {
  v1::JobSpec s = ProgramJob(p, {"/usr/bin/python3", "ckpt.py", tag, absl::StrCat(steps)}, 2, 2);
  s.set_max_restarts(3);
  if (!hold.empty()) (*s.mutable_program()->mutable_env())["HOLD"] = hold;
  return s;
}

// What load() returned to TAG's rank RANK in generation GENERATION.
std::string Restored(const Programs& p, const std::string& tag, int64_t generation, int rank) {
  return ReadFile(absl::StrCat(p.out, "/", tag, "-gen-", generation, "-rank-", rank, ".restored"));
}

// Runs ckpt.py undisturbed (tag "ref"): `digest` is the final line every disturbed run of
// STEPS must end with.
void RunCheckpointReference(Cluster& cluster, const Programs& p, int steps, std::string* digest) {
  auto reference = RunToEnd(cluster, CheckpointJob(p, "ref", steps, ""));
  ASSERT_TRUE(reference.ok()) << reference.status() << cluster.Logs();
  ASSERT_EQ(reference->state(), v1::JOB_STATE_SUCCEEDED) << reference->reason() << cluster.Logs();
  *digest = ReadFile(p.out + "/ref-final");
  ASSERT_TRUE(absl::StartsWith(*digest, absl::StrCat(steps, " "))) << *digest;
  EXPECT_EQ(Restored(p, "ref", 1, 0), "None");
}

TEST_F(ProgramTest, CheckpointerRestoresTheNewestStepEveryMemberHoldsFromMemory) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/ckpt.py", kCheckpointScript);
  ASSERT_NO_FATAL_FAILURE(StartProgramWorkers(*cluster, p, {"w0", "w1"}));
  auto spec = [&](const std::string& tag, const std::string& hold) {
    return CheckpointJob(p, tag, 30, hold);
  };
  auto restored = [&](const std::string& tag, int64_t generation, int rank) {
    return Restored(p, tag, generation, rank);
  };
  auto kill_held = [&](const std::string& tag, int rank) {
    const std::string held = absl::StrCat(p.out, "/", tag, "-held-", rank);
    EXPECT_TRUE(WaitForFile(held, kJobWait)) << cluster->Logs();
    const pid_t pid = ReadPid(held);
    ASSERT_GT(pid, 0);
    ASSERT_EQ(kill(pid, SIGKILL), 0);
  };

  // Undisturbed: the digest every disturbed run must end with.
  std::string digest;
  ASSERT_NO_FATAL_FAILURE(RunCheckpointReference(*cluster, p, 30, &digest));

  {
    SCOPED_TRACE("kill -9 of rank 1 right after its save of step 12");
    auto job = cluster->Submit(spec("after", "after-save:12"));
    ASSERT_TRUE(job.ok()) << job.status();
    ASSERT_TRUE(WaitForFile(p.out + "/after-held-0", kJobWait)) << cluster->Logs();
    ASSERT_TRUE(cluster
                    ->WaitFor(
                        job->job_id(), [](const v1::Job& j) { return j.step() >= 12; }, kJobWait)
                    .ok());
    ASSERT_NO_FATAL_FAILURE(kill_held("after", 1));
    auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
    ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
    ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
    EXPECT_EQ(ReadFile(p.out + "/after-final"), digest);
    ASSERT_GE(done->recovery_history_size(), 1);
    const v1::Recovery& r = done->recovery_history(0);
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(restored("after", r.to_generation(), rank), "12");
    }
    EXPECT_EQ(r.restored_from(), "memory") << r.DebugString();
    EXPECT_EQ(r.resumed_from_step(), 12) << r.DebugString();
    EXPECT_EQ(r.steps_redone(), 0) << r.DebugString();
    // status shows where the state came from with how long the restore took.
    auto status = testing::RunCommand(
        {LOCKSTEP_CTL_BIN, "--coordinator=" + cluster->address(), "status", job->job_id()},
        absl::Seconds(30));
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_TRUE(absl::StrContains(status->output, "(memory)")) << status->output;
  }
  {
    SCOPED_TRACE("non-blocking saves: kill -9 of rank 1 right after its save of step 12");
    v1::JobSpec s = spec("async", "after-save:12");
    (*s.mutable_program()->mutable_env())["NONBLOCKING"] = "1";
    auto job = cluster->Submit(s);
    ASSERT_TRUE(job.ok()) << job.status();
    ASSERT_TRUE(WaitForFile(p.out + "/async-held-0", kJobWait)) << cluster->Logs();
    ASSERT_NO_FATAL_FAILURE(kill_held("async", 1));
    auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
    ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
    ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
    EXPECT_EQ(ReadFile(p.out + "/async-final"), digest);
    ASSERT_GE(done->recovery_history_size(), 1);
    const v1::Recovery& r = done->recovery_history(0);
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(restored("async", r.to_generation(), rank), "12");
    }
    EXPECT_EQ(r.steps_redone(), 0) << r.DebugString();
  }
  {
    SCOPED_TRACE("kill -9 of rank 1 inside its save of step 12 (rank 0 completed it)");
    auto job = cluster->Submit(spec("mid", "mid-save:12:1"));
    ASSERT_TRUE(job.ok()) << job.status();
    ASSERT_NO_FATAL_FAILURE(kill_held("mid", 1));
    auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
    ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
    ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
    EXPECT_EQ(ReadFile(p.out + "/mid-final"), digest);
    ASSERT_GE(done->recovery_history_size(), 1);
    const v1::Recovery& r = done->recovery_history(0);
    // Rank 1's torn save of step 12 is never restored; rank 0's whole one is discarded: the
    // newest step both hold is 11.
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(restored("mid", r.to_generation(), rank), "11");
    }
    EXPECT_EQ(r.restored_from(), "memory") << r.DebugString();
    EXPECT_EQ(r.resumed_from_step(), 11) << r.DebugString();
  }
}

// Flags for a program worker NAME on HOST whose checkpoint memory is where the test can look at
// it (its slots' headers: MemoryDir), plus `more`.
std::vector<std::string> PeerCopyFlags(Cluster& cluster, const Programs& p, const std::string& name,
                                       const std::string& host,
                                       const std::vector<std::string>& more = {}) {
  const std::string dir = absl::StrCat(cluster.dir(), "/shm-", name);
  std::filesystem::create_directories(dir);
  std::vector<std::string> f = ProgramFlags(p);
  f.push_back("--checkpoint_memory_dir=" + dir);
  f.push_back("--host=" + host);
  f.insert(f.end(), more.begin(), more.end());
  return f;
}

std::string MemoryDir(Cluster& cluster, const std::string& name) {
  return absl::StrCat(cluster.dir(), "/shm-", name);
}

// Waits until every one of `ranks` ranks of JOB has a save in the persist directory `dir`;
// returns the newest step there (0 if that did not happen within kJobWait).
int64_t WaitForDiskSaves(const std::string& dir, const std::string& job_id, int ranks) {
  const absl::Time until = absl::Now() + kJobWait;
  std::set<int> seen;
  int64_t newest = 0;
  while (static_cast<int>(seen.size()) < ranks && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(20));
    std::error_code error;
    for (const auto& f : std::filesystem::directory_iterator(dir, error)) {
      const std::string name = f.path().filename();
      int64_t step = 0;
      int rank = 0;
      if (sscanf(name.c_str(), (job_id + ".step-%ld.rank-%d.lsckpt").c_str(), &step, &rank) == 2 &&
          absl::EndsWith(name, ".lsckpt")) {
        seen.insert(rank);
        newest = std::max(newest, step);
      }
    }
  }
  return static_cast<int>(seen.size()) < ranks ? 0 : newest;
}

// The committed copies of a peer's saves that a worker keeps (".copy" slots in its checkpoint
// memory directory under `dir`; with `kind` ".slot", its own) of `step` (-1: of any step).
std::vector<std::string> CommittedCopies(const std::string& dir, int64_t step,
                                         const std::string& kind = ".copy") {
  std::vector<std::string> copies;
  std::error_code error;
  for (const auto& memory : std::filesystem::directory_iterator(dir, error)) {
    for (const auto& slot : std::filesystem::directory_iterator(memory.path(), error)) {
      if (slot.path().extension() != kind) continue;
      std::ifstream in(slot.path(), std::ios::binary);
      char header[24] = {};
      if (!in.read(header, sizeof header)) continue;
      uint64_t sequence = 0;
      int64_t saved = 0;
      std::memcpy(&sequence, header + 8, 8);
      std::memcpy(&saved, header + 16, 8);
      if (std::string(header, 8) == "LSCKPT01" && sequence != 0 && (step < 0 || saved == step)) {
        copies.push_back(slot.path());
      }
    }
  }
  return copies;
}

// A worker daemon killed with its memory (kill -9: its saves go with it). Its checkpoint peer
// kept a copy of each of its saves, so no step is lost: restarted under its name, the worker
// fetches its own copy back; replaced by a spare, the spare takes the departed worker's copy.
// Copies (and the holder's own saves) corrupted at their holder are refused by their checksums:
// the group restores the newest step on disk (program.persist_every_saves) and status says why.
// Every run ends with the digest of an undisturbed run. The two workers are on two hosts: each
// keeps the other's copies.
TEST_F(ProgramTest, AKilledWorkerDaemonsSavesComeBackFromItsPeersCopyAndACorruptOneIsRefused) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/ckpt.py", kCheckpointScript);
  const auto flags = [&](const std::string& name, const std::string& host) {
    return PeerCopyFlags(*cluster, p, name, host);
  };
  const auto memory_dir = [&](const std::string& name) { return MemoryDir(*cluster, name); };
  std::map<std::string, std::string> host_of = {{"w0", "h0"}, {"w1", "h1"}, {"spare", "h1"}};
  for (const char* name : {"w0", "w1"}) {
    ASSERT_TRUE(cluster->StartWorker(name, flags(name, host_of[name])).ok()) << cluster->Logs();
  }
  // Starts TAG held after every rank's save of step 8; once the survivor (rank 0) keeps the
  // victim's copy of step 8, calls `before_kill(survivor, victim)` and kills the victim's worker
  // daemon: returns {survivor, victim}.
  using BeforeKill = std::function<void(const std::string&, const std::string&)>;
  const auto kill_after_copy =
      [&](const std::string& tag, std::string* job_id, const BeforeKill& before_kill = nullptr,
          const std::string& persist_dir = "") -> std::pair<std::string, std::string> {
    v1::JobSpec spec = CheckpointJob(p, tag, 20, "after-save:8");
    if (!persist_dir.empty()) {
      spec.set_checkpoint_dir(persist_dir);
      spec.mutable_program()->set_persist_every_saves(5);
    }
    auto job = cluster->Submit(spec);
    EXPECT_TRUE(job.ok()) << job.status();
    if (!job.ok()) return {};
    *job_id = job->job_id();
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_TRUE(WaitForFile(absl::StrCat(p.out, "/", tag, "-held-", rank), kJobWait))
          << cluster->Logs();
    }
    auto running = cluster->Get(job->job_id());
    EXPECT_TRUE(running.ok()) << running.status();
    const std::string survivor = running->members(0).worker_name();
    const std::string victim = running->members(1).worker_name();
    const absl::Time until = absl::Now() + absl::Seconds(60);
    while (CommittedCopies(memory_dir(survivor), 8).empty() && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_FALSE(CommittedCopies(memory_dir(survivor), 8).empty())
        << survivor << " keeps no copy of " << victim << "'s step 8" << cluster->Logs();
    if (before_kill) before_kill(survivor, victim);
    cluster->worker(victim)->Signal(SIGKILL);
    EXPECT_TRUE(cluster->worker(victim)->Wait(absl::Seconds(30)).ok());
    return {survivor, victim};
  };
  std::map<std::string, v1::Job> ended;
  const auto wait_end = [&](const std::string& tag, const std::string& job_id) {
    auto done = cluster->WaitForEnd(job_id, kJobWait);
    ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
    ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
    ASSERT_GE(done->recovery_history_size(), 1) << done->DebugString();
    ended[tag] = *done;
  };

  std::string restarted_victim;
  {
    SCOPED_TRACE("the victim's worker restarts under its name, with empty memory");
    std::string job_id;
    const auto [survivor, victim] = kill_after_copy("again", &job_id);
    ASSERT_FALSE(victim.empty());
    ASSERT_TRUE(cluster->StartWorker(victim, flags(victim, host_of[victim])).ok())
        << cluster->Logs();
    ASSERT_NO_FATAL_FAILURE(wait_end("again", job_id));
    const v1::Recovery& r = ended["again"].recovery_history(0);
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(Restored(p, "again", r.to_generation(), rank), "8") << "rank " << rank;
    }
    EXPECT_EQ(r.resumed_from_step(), 8) << r.DebugString();
    EXPECT_EQ(r.steps_redone(), 0) << r.DebugString();
    EXPECT_EQ(r.restored_from(), "memory and peers' copies") << r.DebugString();
    EXPECT_TRUE(absl::StrContains(r.restore_detail(), victim + " from " + survivor))
        << r.DebugString();
    restarted_victim = victim;
  }
  {
    SCOPED_TRACE("a spare replaces the victim and takes its copy");
    std::string job_id;
    const auto [survivor, victim] = kill_after_copy("spare", &job_id);
    ASSERT_FALSE(victim.empty());
    ASSERT_TRUE(cluster->StartWorker("spare", flags("spare", host_of[victim])).ok())
        << cluster->Logs();
    ASSERT_NO_FATAL_FAILURE(wait_end("spare", job_id));
    const v1::Recovery& r = ended["spare"].recovery_history(0);
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(Restored(p, "spare", r.to_generation(), rank), "8") << "rank " << rank;
    }
    EXPECT_EQ(r.steps_redone(), 0) << r.DebugString();
    EXPECT_TRUE(
        absl::StrContains(r.restore_detail(), "spare took " + victim + "'s from " + survivor))
        << r.DebugString();
    // The victim comes back for the next run.
    ASSERT_TRUE(cluster->StartWorker(victim, flags(victim, host_of[victim])).ok())
        << cluster->Logs();
  }
  {
    SCOPED_TRACE("the survivor's memory is corrupted: refused, and the disk's newest step used");
    // Every copy (steps 8 and 7, say): with only the newest corrupted, the group restores the
    // other. Three workers are up now: the group may re-form on the idle one at once, so the
    // copies are corrupted before the kill. The job writes one save in 5 to disk.
    const std::string persist = absl::StrCat(cluster->dir(), "/persist");
    // The newest step on disk once each rank wrote one (the saves' newest when the fifth was
    // seen: step 5 or a little later).
    int64_t on_disk = 0;
    std::string job_id;
    const auto [survivor, victim] = kill_after_copy(
        "corrupt", &job_id,
        [&](const std::string& survivor, const std::string&) {
          on_disk = WaitForDiskSaves(persist, job_id, 2);
          ASSERT_GT(on_disk, 0) << "no save on disk" << cluster->Logs();
          // The survivor's own saves too: else the restarted victim, having joined, would take
          // the survivor's save of step 8 (a replica's state) and the disk would not be needed.
          std::vector<std::string> copies = CommittedCopies(memory_dir(survivor), -1);
          ASSERT_FALSE(copies.empty());
          for (const std::string& own : CommittedCopies(memory_dir(survivor), -1, ".slot")) {
            copies.push_back(own);
          }
          for (const std::string& copy : copies) {
            std::fstream f(copy, std::ios::in | std::ios::out | std::ios::binary);
            f.seekp(4096 + 100);
            f.put('\x5a');
          }
        },
        persist);
    ASSERT_FALSE(victim.empty());
    ASSERT_TRUE(cluster->StartWorker(victim, flags(victim, host_of[victim])).ok())
        << cluster->Logs();
    ASSERT_NO_FATAL_FAILURE(wait_end("corrupt", job_id));
    const v1::Recovery& r = ended["corrupt"].recovery_history(0);
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(Restored(p, "corrupt", r.to_generation(), rank), absl::StrCat(on_disk))
          << "rank " << rank;
    }
    EXPECT_GE(on_disk, 5);
    EXPECT_EQ(r.restored_from(), "disk") << r.DebugString();
    EXPECT_EQ(r.resumed_from_step(), on_disk) << r.DebugString();
    EXPECT_EQ(r.steps_redone(), 8 - on_disk) << r.DebugString();
    EXPECT_TRUE(absl::StrContains(r.restore_detail(), "checksum")) << r.DebugString();
    EXPECT_TRUE(absl::StrContains(r.restore_detail(), "copy of " + victim)) << r.DebugString();
    auto status = testing::RunCommand(
        {LOCKSTEP_CTL_BIN, "--coordinator=" + cluster->address(), "status", job_id},
        absl::Seconds(30));
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_TRUE(absl::StrContains(status->output, "restore: ")) << status->output;
    EXPECT_TRUE(absl::StrContains(status->output, "checksum")) << status->output;
  }
  // Undisturbed, last: every disturbed run ends with its digest.
  std::string digest;
  ASSERT_NO_FATAL_FAILURE(RunCheckpointReference(*cluster, p, 20, &digest));
  for (const char* tag : {"again", "spare", "corrupt"}) {
    EXPECT_EQ(ReadFile(absl::StrCat(p.out, "/", tag, "-final")), digest) << tag;
  }
}

// Copies and fetches cut by a kill (test hooks hold the sender with the save's data sent, the
// stream not ended): a cut copy is never committed at its peer, so a worker that lost its
// memory takes the survivor's own save (it joined) rather than restore it; a fetch cut by its
// holder's death commits nothing,
// the group re-forms and restores the newest step on disk. Both runs end with the digest of an
// undisturbed run.
TEST_F(ProgramTest, ACopyOrAFetchCutByAKillIsNeverRestoredAndTheJobEndsExact) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/ckpt.py", kCheckpointScript);
  std::map<std::string, std::string> host_of = {{"w0", "h0"}, {"w1", "h1"}};
  const auto start = [&](const std::string& name, const std::string& hooks) {
    ASSERT_TRUE(cluster
                    ->StartWorker(name, PeerCopyFlags(*cluster, p, name, host_of[name],
                                                      {"--test_hooks=" + hooks}))
                    .ok())
        << cluster->Logs();
  };
  // The members of TAG's job once every rank holds after its save of step 8.
  const auto held = [&](const std::string& tag, const std::string& job_id) {
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_TRUE(WaitForFile(absl::StrCat(p.out, "/", tag, "-held-", rank), kJobWait))
          << cluster->Logs();
    }
    auto running = cluster->Get(job_id);
    EXPECT_TRUE(running.ok()) << running.status();
    if (!running.ok() || running->members_size() != 2)
      return std::make_pair(std::string(), std::string());
    return std::make_pair(running->members(0).worker_name(), running->members(1).worker_name());
  };
  const auto wait_end = [&](const std::string& job_id) -> absl::StatusOr<v1::Job> {
    auto done = cluster->WaitForEnd(job_id, kJobWait);
    if (!done.ok()) return done.status();
    EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
    return done;
  };
  for (const char* name : {"w0", "w1"}) {
    // The fetch hook holds only the second part's fetch (of step 9).
    ASSERT_NO_FATAL_FAILURE(start(name, "checkpoint_copy_midway,checkpoint_fetch_midway@9"));
  }
  {
    SCOPED_TRACE("a worker daemon killed inside its copy to the peer");
    v1::JobSpec spec = CheckpointJob(p, "cut", 20, "after-save:8");
    spec.set_max_restarts(5);
    auto job = cluster->Submit(spec);
    ASSERT_TRUE(job.ok()) << job.status();
    const auto [survivor, victim] = held("cut", job->job_id());
    ASSERT_FALSE(victim.empty());
    // Each worker's first copy is held with its first chunk sent: none went further.
    ASSERT_TRUE(cluster->WaitForHook(victim, "checkpoint_copy_midway", kJobWait).ok())
        << cluster->Logs();
    ASSERT_TRUE(cluster->WaitForHook(survivor, "checkpoint_copy_midway", kJobWait).ok())
        << cluster->Logs();
    cluster->worker(victim)->Signal(SIGKILL);
    ASSERT_TRUE(cluster->worker(victim)->Wait(absl::Seconds(30)).ok());
    cluster->ReleaseHook(survivor, "checkpoint_copy_midway");
    // The survivor's end of the cut stream fails within moments of the kill: watched for 2 s,
    // before the victim restarts (from then on its own saves are copied to the survivor).
    const absl::Time watched = absl::Now() + absl::Seconds(2);
    do {
      ASSERT_TRUE(CommittedCopies(MemoryDir(*cluster, survivor), -1).empty())
          << "the survivor committed a copy that was cut";
      absl::SleepFor(absl::Milliseconds(50));
    } while (absl::Now() < watched);
    ASSERT_NO_FATAL_FAILURE(start(victim, "checkpoint_fetch_midway@9"));
    auto done = wait_end(job->job_id());
    ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
    ASSERT_GE(done->recovery_history_size(), 1) << done->DebugString();
    const v1::Recovery& r = done->recovery_history(0);
    // The restarted victim holds nothing and no copy of its saves was committed: having
    // joined, it takes the survivor's own save of step 8 (never the cut copy).
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(Restored(p, "cut", r.to_generation(), rank), "8") << "rank " << rank;
    }
    EXPECT_TRUE(
        absl::StrContains(r.restore_detail(), victim + " took " + survivor + "'s from " + survivor))
        << r.DebugString();
    // The survivor may hold a copy of step 8 now: the restarted victim's own save of it (the
    // one it took) is copied like any save.
  }
  {
    SCOPED_TRACE("the holder killed while a restarted worker fetches its copy from it");
    const std::string persist = absl::StrCat(cluster->dir(), "/persist");
    v1::JobSpec spec = CheckpointJob(p, "fetch", 20, "after-save:9");
    spec.set_max_restarts(5);
    spec.set_checkpoint_dir(persist);
    spec.mutable_program()->set_persist_every_saves(5);
    auto job = cluster->Submit(spec);
    ASSERT_TRUE(job.ok()) << job.status();
    const auto [survivor, victim] = held("fetch", job->job_id());
    ASSERT_FALSE(victim.empty());
    const int64_t on_disk = WaitForDiskSaves(persist, job->job_id(), 2);
    ASSERT_GE(on_disk, 5) << cluster->Logs();
    const absl::Time until = absl::Now() + kJobWait;
    while (CommittedCopies(MemoryDir(*cluster, survivor), 9).empty() && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    ASSERT_FALSE(CommittedCopies(MemoryDir(*cluster, survivor), 9).empty()) << cluster->Logs();
    cluster->worker(victim)->Signal(SIGKILL);
    ASSERT_TRUE(cluster->worker(victim)->Wait(absl::Seconds(30)).ok());
    // Restarted with empty memory: it fetches its step 9 from the survivor, which holds with
    // the data sent. Killed there: the fetch ends without its end of stream.
    ASSERT_NO_FATAL_FAILURE(start(victim, ""));
    ASSERT_TRUE(cluster->WaitForHook(survivor, "checkpoint_fetch_midway", kJobWait).ok())
        << cluster->Logs();
    cluster->worker(survivor)->Signal(SIGKILL);
    ASSERT_TRUE(cluster->worker(survivor)->Wait(absl::Seconds(30)).ok());
    // The victim's fetch fails; the part it received is not committed in its slots.
    const std::string failed =
        absl::StrCat("fetching ", victim, "'s checkpoint of step 9 from ", survivor);
    const absl::Time fetch_until = absl::Now() + kJobWait;
    while (
        !absl::StrContains(ReadFile(absl::StrCat(cluster->dir(), "/", victim, ".log")), failed) &&
        absl::Now() < fetch_until) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_TRUE(
        absl::StrContains(ReadFile(absl::StrCat(cluster->dir(), "/", victim, ".log")), failed))
        << cluster->Logs();
    EXPECT_TRUE(CommittedCopies(MemoryDir(*cluster, victim), 9, ".slot").empty())
        << "a cut fetch was committed";
    ASSERT_NO_FATAL_FAILURE(start(survivor, ""));
    auto done = wait_end(job->job_id());
    ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
    ASSERT_GE(done->recovery_history_size(), 1) << done->DebugString();
    // Both memories are gone (the survivor's with its daemon; the fetch committed nothing):
    // the newest step on disk, everywhere (a member may find that step in a copy its peer
    // kept of an older save, the rest reads the disk).
    const v1::Recovery& r = done->recovery_history(done->recovery_history_size() - 1);
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(Restored(p, "fetch", r.to_generation(), rank), absl::StrCat(on_disk))
          << "rank " << rank << " " << done->DebugString();
    }
    EXPECT_TRUE(absl::StrContains(r.restored_from(), "disk")) << r.DebugString();
    EXPECT_EQ(r.resumed_from_step(), on_disk) << r.DebugString();
  }
  std::string digest;
  ASSERT_NO_FATAL_FAILURE(RunCheckpointReference(*cluster, p, 20, &digest));
  for (const char* tag : {"cut", "fetch"}) {
    EXPECT_EQ(ReadFile(absl::StrCat(p.out, "/", tag, "-final")), digest) << tag;
  }
}

// A worker that joins a running program job (a scale-up; the same as a job growing back after
// a preemption) has nothing of its own: it takes a member's own save of the newest step from
// that member's memory, so the grown group goes on from there with no step redone.
TEST_F(ProgramTest, AWorkerThatJoinsARunningProgramJobTakesAMembersSave) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/ckpt.py", kCheckpointScript);
  ASSERT_TRUE(cluster->StartWorker("w0", PeerCopyFlags(*cluster, p, "w0", "h0")).ok())
      << cluster->Logs();
  v1::JobSpec spec = CheckpointJob(p, "grow", 20, "after-save:8");
  spec.set_min_workers(1);
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(WaitForFile(p.out + "/grow-held-0", kJobWait)) << cluster->Logs();
  ASSERT_TRUE(cluster->StartWorker("w1", PeerCopyFlags(*cluster, p, "w1", "h1")).ok())
      << cluster->Logs();
  auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
  ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
  EXPECT_EQ(done->members_size(), 2);
  ASSERT_EQ(done->recovery_history_size(), 1) << done->DebugString();
  const v1::Recovery& r = done->recovery_history(0);
  EXPECT_TRUE(r.scale_up());
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(Restored(p, "grow", r.to_generation(), rank), "8") << "rank " << rank;
  }
  EXPECT_EQ(r.resumed_from_step(), 8) << r.DebugString();
  EXPECT_EQ(r.steps_redone(), 0) << r.DebugString();
  EXPECT_TRUE(absl::StrContains(r.restore_detail(), "w1 took w0's from w0")) << r.DebugString();
  EXPECT_TRUE(absl::StartsWith(ReadFile(p.out + "/grow-final"), "20 "));
}

// Preemption of a program job (docs/scheduling.md): an urgent job of priority 10 takes one of
// its two workers; the script's processes stop, and it goes on on the other from the newest
// step in memory; when the urgent job ends it grows back, the joiner taking a member's save.
TEST_F(ProgramTest, AProgramJobShrunkForAnUrgentJobGoesOnFromMemoryAndGrowsBack) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/ckpt.py", kCheckpointScript);
  for (const char* name : {"w0", "w1"}) {
    ASSERT_TRUE(cluster->StartWorker(name, PeerCopyFlags(*cluster, p, name, name)).ok())
        << cluster->Logs();
  }
  v1::JobSpec low = CheckpointJob(p, "low", 40, "after-save:8");
  low.set_min_workers(1);
  (*low.mutable_program()->mutable_env())["STEP_SLEEP"] = "0.1";
  auto job = cluster->Submit(low);
  ASSERT_TRUE(job.ok()) << job.status();
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(WaitForFile(absl::StrCat(p.out, "/low-held-", rank), kJobWait)) << cluster->Logs();
  }
  v1::JobSpec urgent_spec = testing::SyntheticJob(1, 1, 300);
  urgent_spec.set_priority(10);
  auto urgent = cluster->Submit(urgent_spec);
  ASSERT_TRUE(urgent.ok()) << urgent.status();
  auto urgent_done = cluster->WaitForEnd(urgent->job_id(), kJobWait);
  ASSERT_TRUE(urgent_done.ok()) << urgent_done.status();
  EXPECT_EQ(urgent_done->state(), v1::JOB_STATE_SUCCEEDED) << urgent_done->reason();
  auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
  ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
  EXPECT_TRUE(absl::StartsWith(ReadFile(p.out + "/low-final"), "40 "));
  EXPECT_EQ(done->recoveries(), 0) << "preemption and growth are not failures";
  ASSERT_GE(done->recovery_history_size(), 2) << done->DebugString();
  const v1::Recovery& shrunk = done->recovery_history(0);
  EXPECT_TRUE(absl::StrContains(shrunk.reason(), "preempted by " + urgent->job_id()))
      << shrunk.reason();
  // Both ranks held after their saves of step 8: nothing redone.
  EXPECT_EQ(Restored(p, "low", shrunk.to_generation(), 0), "8");
  EXPECT_EQ(shrunk.steps_redone(), 0) << shrunk.DebugString();
  // The worker back from the urgent job joined: its own saves are of step 8, from before it
  // left; it takes the other member's save of the newest step instead, nothing redone.
  const v1::Recovery& grew = done->recovery_history(1);
  EXPECT_TRUE(grew.scale_up()) << grew.DebugString();
  EXPECT_EQ(grew.steps_redone(), 0) << grew.DebugString();
  // The newest save may be a step past the one the coordinator had heard of when it began the
  // growth (the members save before they report): never behind it.
  EXPECT_GE(grew.resumed_from_step(), grew.step_at_detection()) << grew.DebugString();
  EXPECT_TRUE(absl::StrContains(grew.restore_detail(), "took")) << grew.DebugString();
  EXPECT_EQ(done->members_size(), 2);
}

// Suspended whole for an urgent job that needs both its workers: its processes stop (SIGTERM),
// its saves stay in the workers' checkpoint memory while they run the urgent job, and it
// resumes from them once that job ends, nothing redone.
TEST_F(ProgramTest, AProgramJobSuspendedForAnUrgentJobResumesFromItsSaves) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/ckpt.py", kCheckpointScript);
  for (const char* name : {"w0", "w1"}) {
    ASSERT_TRUE(cluster->StartWorker(name, PeerCopyFlags(*cluster, p, name, name)).ok())
        << cluster->Logs();
  }
  auto job = cluster->Submit(CheckpointJob(p, "susp", 40, "after-save:8"));
  ASSERT_TRUE(job.ok()) << job.status();
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(WaitForFile(absl::StrCat(p.out, "/susp-held-", rank), kJobWait)) << cluster->Logs();
  }
  v1::JobSpec urgent_spec = testing::SyntheticJob(2, 2, 300);
  urgent_spec.set_priority(10);
  auto urgent = cluster->Submit(urgent_spec);
  ASSERT_TRUE(urgent.ok()) << urgent.status();
  auto suspended = cluster->WaitFor(
      job->job_id(), [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SUSPENDED; },
      kJobWait);
  ASSERT_TRUE(suspended.ok()) << suspended.status() << cluster->Logs();
  EXPECT_EQ(suspended->suspension().holders_size(), 2) << suspended->DebugString();
  auto urgent_done = cluster->WaitForEnd(urgent->job_id(), kJobWait);
  ASSERT_TRUE(urgent_done.ok()) << urgent_done.status();
  EXPECT_EQ(urgent_done->state(), v1::JOB_STATE_SUCCEEDED) << urgent_done->reason();
  auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
  ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
  EXPECT_TRUE(absl::StartsWith(ReadFile(p.out + "/susp-final"), "40 "));
  EXPECT_EQ(done->recoveries(), 0);
  ASSERT_EQ(done->recovery_history_size(), 1) << done->DebugString();
  const v1::Recovery& resumed = done->recovery_history(0);
  EXPECT_TRUE(absl::StartsWith(resumed.reason(), "resumed after")) << resumed.reason();
  EXPECT_TRUE(absl::StrContains(resumed.reason(), "preempted by " + urgent->job_id()))
      << resumed.reason();
  // Both ranks had saved step 8 before they were stopped: nothing redone.
  EXPECT_EQ(Restored(p, "susp", resumed.to_generation(), 0), "8");
  EXPECT_EQ(Restored(p, "susp", resumed.to_generation(), 1), "8");
  EXPECT_EQ(resumed.steps_redone(), 0) << resumed.DebugString();
}

// A save that cannot fit in the worker's --checkpoint_memory_bytes fails in the script with
// the numbers (a MemoryError it may catch); here uncaught, with exit code 1 made fatal.
TEST_F(ProgramTest, ASaveBeyondTheWorkersCheckpointMemoryFailsNamingTheNumbers) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/big.py", R"py(import torch, lockstep.torch as lt
model = torch.nn.Linear(512, 512)
ckpt = lt.Checkpointer()
assert ckpt.load(model) is None
ckpt.save(1, model)
)py");
  std::vector<std::string> flags = ProgramFlags(p);
  flags.push_back("--checkpoint_memory_bytes=65536");
  ASSERT_TRUE(cluster->StartWorker("w0", flags).ok()) << cluster->Logs();
  v1::JobSpec spec = ProgramJob(p, {"/usr/bin/python3", "big.py"}, 1, 1);
  spec.mutable_program()->add_fatal_exit_codes(1);
  auto done = RunToEnd(*cluster, spec);
  ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
  ASSERT_EQ(done->state(), v1::JOB_STATE_FAILED) << cluster->Logs();
  EXPECT_TRUE(absl::StrContains(done->reason(), "MemoryError")) << done->reason();
  EXPECT_TRUE(absl::StrContains(done->reason(), "--checkpoint_memory_bytes is 65536 bytes"))
      << done->reason();
}

// Reports as lockstep.torch does from processes that all compute on cuda:1: local rank 1 is
// on its own GPU, local rank 0 is not (every rank on one GPU, the classic mistake). The
// worker's check, without a GPU; only rank 0 is wrong, so the reason names it whichever rank
// reports first.
constexpr char kWrongGpuScript[] = R"py(import os, time
from lockstep.v1 import program_pb2, program_pb2_grpc
import grpc
stub = program_pb2_grpc.ProgramServiceStub(grpc.insecure_channel(os.environ["LOCKSTEP_AGENT_ADDRESS"]))
meta = (("x-lockstep-program", os.environ["LOCKSTEP_AGENT_TOKEN"]),)
device = 1
try:
    stub.Report(program_pb2.ProgramReportRequest(step=1, cuda_device=device), metadata=meta)
except grpc.RpcError as e:
    print("refused:", e.code().name, flush=True)
time.sleep(600)
)py";

TEST_F(ProgramTest, AProcessOnAnotherMembersGpuFailsTheJobSayingWhatToCall) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/wrong_gpu.py", kWrongGpuScript);
  ASSERT_NO_FATAL_FAILURE(StartProgramWorkers(*cluster, p, {"w0", "w1"}));
  auto done = RunToEnd(*cluster, ProgramJob(p, {"/usr/bin/python3", "wrong_gpu.py"}, 2, 2));
  ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
  EXPECT_EQ(done->state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(done->reason(),
                                "computes on cuda:1, not on its own GPU cuda:0: call "
                                "torch.cuda.set_device(local_rank)"))
      << done->reason();
  EXPECT_EQ(done->recoveries(), 0);
  ASSERT_GE(done->program_exits_size(), 1);
  EXPECT_EQ(done->program_exits(0).signal(), "SIGTERM");
}

// Prints a line, then exits 0 once the file named by its argument exists.
constexpr char kPrintThenExitScript[] = R"py(import os, sys, time
print("ready", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
)py";

// The pid of the process whose command line holds `needle` (0 if none), and its parent's.
std::pair<pid_t, pid_t> FindProcess(const std::string& needle) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string cmdline = ReadFile(entry.path() / "cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    if (!absl::StrContains(cmdline, needle)) continue;
    const std::string stat = ReadFile(entry.path() / "stat");
    // After the command's closing parenthesis: state, then the parent's pid.
    std::vector<std::string> fields = absl::StrSplit(stat.substr(stat.rfind(')') + 2), ' ');
    pid_t parent = 0;
    if (fields.size() > 1 && absl::SimpleAtoi(fields[1], &parent)) {
      return {static_cast<pid_t>(std::stoi(name)), parent};
    }
  }
  return {0, 0};
}

// The state letter of process `pid` ('Z': exited, not yet reaped), or 0 if it is gone.
char ProcessState(pid_t pid) {
  const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  const size_t close = stat.rfind(')');
  return close == std::string::npos || close + 2 >= stat.size() ? 0 : stat[close + 2];
}

// The program ends while its worker has read its output but not yet its status, and its
// supervisor exits before the worker looks again, as can happen on a loaded machine (a test
// hook holds the worker there until the supervisor is a zombie). The worker still reads the
// exit status the supervisor left in the pipe: the job succeeds, with no restart. Before, the
// worker reported "the program's supervisor ended without its status" and the group restarted.
TEST_F(ProgramTest, AnEndSeenOnlyAfterTheSupervisorExitedStillCarriesTheExitStatus) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const Programs p = MakePrograms(*cluster);
  WriteFile(p.root + "/print_then_exit.py", kPrintThenExitScript);
  std::vector<std::string> flags = ProgramFlags(p);
  flags.push_back("--test_hooks=program_output_read");
  ASSERT_TRUE(cluster->StartWorker("w0", flags).ok()) << cluster->Logs();
  const std::string go = p.out + "/go";
  auto job = cluster->Submit(ProgramJob(p, {"/usr/bin/python3", "print_then_exit.py", go}, 1, 1));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(cluster->WaitForHook("w0", "program_output_read", kJobWait).ok()) << cluster->Logs();
  const auto [script, supervisor] = FindProcess("print_then_exit.py " + go);
  ASSERT_NE(script, 0) << "the program is not running";
  WriteFile(go, "");
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (ProcessState(supervisor) != 'Z' && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(ProcessState(supervisor), 'Z')
      << "the supervisor (pid " << supervisor << ") did not exit";
  cluster->ReleaseHook("w0", "program_output_read");
  auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
  ASSERT_TRUE(done.ok()) << done.status() << cluster->Logs();
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
  EXPECT_EQ(done->recoveries(), 0) << cluster->Logs();
  EXPECT_EQ(done->generation(), 1);
  EXPECT_EQ(done->program_exits_size(), 0) << done->DebugString();
}

}  // namespace
}  // namespace lockstep
