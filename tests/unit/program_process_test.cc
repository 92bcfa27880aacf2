// A program's process as its worker runs it: torchrun's environment and command line, the
// supervisor that ends the whole process group (grandchildren that ignore SIGTERM included),
// what its stderr says, and its progress reports.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "worker/program/environment.h"
#include "worker/program/supervisor.h"
#include "worker/program_generation.h"

namespace lockstep::worker {
namespace {

v1::Assignment ProgramAssignment() {
  v1::Assignment a;
  a.set_job_id("job-4-abc");
  a.set_generation(3);
  a.set_rank(5);
  a.set_world_size(8);
  a.set_local_rank(1);
  a.set_local_world_size(4);
  a.set_host_rank(1);
  a.set_host_count(2);
  a.set_restart_count(2);
  v1::JobSpec& spec = *a.mutable_spec();
  spec.set_threads_per_worker(3);
  spec.set_max_restarts(7);
  spec.mutable_program()->add_argv("/usr/bin/python3");
  spec.mutable_program()->add_argv("train.py");
  spec.mutable_program()->set_workdir("/srv/p");
  (*spec.mutable_program()->mutable_env())["OMP_NUM_THREADS"] = "6";
  (*spec.mutable_program()->mutable_env())["DATA"] = "/data";
  return a;
}

std::map<std::string, std::string> AsMap(const std::vector<std::string>& env) {
  std::map<std::string, std::string> out;
  for (const std::string& e : env) {
    const size_t eq = e.find('=');
    out[e.substr(0, eq)] = e.substr(eq + 1);
  }
  return out;
}

TEST(ProgramEnvironmentTest, IsTorchrunsAndKeepsTheWorkersSecretsOut) {
  ProgramSettings settings;
  settings.user = "trainer";
  settings.home = "/home/trainer";
  const std::map<std::string, std::string> worker_env = {
      {"PATH", "/opt/bin:/usr/bin"}, {"LANG", "C.UTF-8"}, {"LC_ALL", "C"},
      {"NCCL_SOCKET_IFNAME", "eth0"}, {"PYTHONPATH", "/opt/lockstep"},
      {"LOCKSTEP_TOKEN", "secret"}, {"LOCKSTEP_TOKEN_FILE", "/etc/lockstep/token"},
      {"AWS_SECRET_ACCESS_KEY", "x"}, {"HOME", "/root"}, {"CUDA_VISIBLE_DEVICES", "0,1"}};
  auto env = AsMap(ProgramEnvironment(ProgramAssignment(), worker_env, settings, "w5",
                                      "10.0.0.1", 29400, {{"LOCKSTEP_AGENT_TOKEN", "t"}}));
  const std::map<std::string, std::string> expected = {
      {"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
      {"GROUP_RANK", "1"}, {"GROUP_WORLD_SIZE", "2"}, {"ROLE_NAME", "default"},
      {"ROLE_RANK", "5"}, {"ROLE_WORLD_SIZE", "8"}, {"MASTER_ADDR", "10.0.0.1"},
      {"MASTER_PORT", "29400"}, {"TORCHELASTIC_RUN_ID", "job-4-abc"},
      {"TORCHELASTIC_RESTART_COUNT", "2"}, {"TORCHELASTIC_MAX_RESTARTS", "7"},
      {"TORCHELASTIC_USE_AGENT_STORE", "False"}, {"LOCKSTEP_JOB_ID", "job-4-abc"},
      {"LOCKSTEP_GENERATION", "3"}, {"LOCKSTEP_WORKER", "w5"}, {"LOCKSTEP_AGENT_TOKEN", "t"},
      // The spec's OMP_NUM_THREADS wins over threads_per_worker.
      {"OMP_NUM_THREADS", "6"}, {"DATA", "/data"},
      {"PATH", "/opt/bin:/usr/bin"}, {"LANG", "C.UTF-8"}, {"LC_ALL", "C"},
      {"NCCL_SOCKET_IFNAME", "eth0"}, {"PYTHONPATH", "/opt/lockstep"},
      {"HOME", "/home/trainer"}, {"USER", "trainer"}, {"LOGNAME", "trainer"}};
  EXPECT_EQ(env, expected);
}

// A worker run from a bundle: its launcher put the bundle's libraries first on
// LD_LIBRARY_PATH (and named them in LOCKSTEP_BUNDLE_LIB); the program gets the rest.
TEST(ProgramEnvironmentTest, ProgramsDoNotLoadTheBundlesLibraries) {
  const auto ld_path = [](const std::map<std::string, std::string>& worker_env) {
    auto env = AsMap(ProgramEnvironment(ProgramAssignment(), worker_env, ProgramSettings{}, "w5",
                                        "10.0.0.1", 1));
    return env.count("LD_LIBRARY_PATH") ? env["LD_LIBRARY_PATH"] : "(unset)";
  };
  EXPECT_EQ(ld_path({{"LOCKSTEP_BUNDLE_LIB", "/opt/b/bin/../lib"},
                     {"LD_LIBRARY_PATH", "/opt/b/bin/../lib:/usr/local/cuda/lib64:/opt/x"}}),
            "/usr/local/cuda/lib64:/opt/x");
  EXPECT_EQ(ld_path({{"LOCKSTEP_BUNDLE_LIB", "/opt/b/bin/../lib"},
                     {"LD_LIBRARY_PATH", "/opt/b/bin/../lib"}}),
            "(unset)");
  // Without a bundle, the worker's own is the program's, whatever it holds.
  EXPECT_EQ(ld_path({{"LD_LIBRARY_PATH", "/opt/b/bin/../lib:/opt/x"}}), "/opt/b/bin/../lib:/opt/x");
  EXPECT_EQ(ld_path({{"LOCKSTEP_BUNDLE_LIB", "/opt/b/bin/../lib"}}), "(unset)");
}

TEST(ProgramEnvironmentTest, GpuWorkersSeeTheirHostsGpusInLocalRankOrder) {
  v1::Assignment a = ProgramAssignment();
  a.mutable_spec()->mutable_program()->mutable_env()->erase("OMP_NUM_THREADS");
  for (const char* uuid : {"GPU-aaa", "GPU-bbb", "GPU-ccc", "GPU-ddd"}) {
    a.add_local_device_uuids(uuid);
  }
  auto env = AsMap(ProgramEnvironment(a, {}, ProgramSettings{}, "w5", "10.0.0.1", 1));
  // Device LOCAL_RANK (1) is this member's own GPU, GPU-bbb.
  EXPECT_EQ(env["CUDA_VISIBLE_DEVICES"], "GPU-aaa,GPU-bbb,GPU-ccc,GPU-ddd");
  EXPECT_EQ(env["OMP_NUM_THREADS"], "3");
  EXPECT_EQ(env["PATH"], "/usr/local/bin:/usr/bin:/bin");
}

TEST(ProgramEnvironmentTest, LocalRankArgumentIsAppendedWhenAsked) {
  v1::Assignment a = ProgramAssignment();
  EXPECT_EQ(ProgramArgv(a), (std::vector<std::string>{"/usr/bin/python3", "train.py"}));
  a.mutable_spec()->mutable_program()->set_local_rank_arg("--local_rank");
  EXPECT_EQ(ProgramArgv(a),
            (std::vector<std::string>{"/usr/bin/python3", "train.py", "--local_rank=1"}));
}

TEST(ProgramEnvironmentTest, ProgramSettingsRefuseWhatIsUnsafe) {
  EXPECT_TRUE(ResolveProgramSettings("", "", false).ok());
  EXPECT_FALSE(ResolveProgramSettings("", "", false)->root.restricted());
  auto no_root = ResolveProgramSettings("", "nobody", false);
  EXPECT_TRUE(absl::StrContains(no_root.status().message(), "--programs_root")) << no_root.status();
  auto everything = ResolveProgramSettings("/", "", true);
  EXPECT_TRUE(absl::StrContains(everything.status().message(), "\"/\"")) << everything.status();
  auto relative = ResolveProgramSettings("programs", "", true);
  EXPECT_TRUE(absl::StartsWith(relative.status().message(), "--programs_root")) << relative.status();
  auto unknown = ResolveProgramSettings("/srv/p", "no-such-user-here", true);
  EXPECT_TRUE(absl::StrContains(unknown.status().message(), "no user \"no-such-user-here\""))
      << unknown.status();
  if (geteuid() == 0) {
    auto as_root = ResolveProgramSettings("/srv/p", "", false);
    EXPECT_TRUE(absl::StrContains(as_root.status().message(), "--allow_programs_as_root"))
        << as_root.status();
    EXPECT_TRUE(ResolveProgramSettings("/srv/p", "", true).ok());
    auto nobody = ResolveProgramSettings("/srv/p", "nobody", false);
    ASSERT_TRUE(nobody.ok()) << nobody.status();
    EXPECT_TRUE(nobody->credentials.switch_user);
    EXPECT_NE(nobody->credentials.uid, 0u);
  }
}

std::string ReadAll(int fd) {
  std::string out;
  char buffer[4096];
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (absl::Now() < until) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n > 0) {
      out.append(buffer, n);
    } else if (n == 0) {
      break;
    } else {
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  return out;
}

LaunchSpec Shell(const std::string& script, absl::Duration grace = absl::Seconds(1)) {
  LaunchSpec spec;
  spec.executable = "/bin/sh";
  spec.argv = {"sh", "-c", script};
  spec.env = {"PATH=/usr/bin:/bin", "GREETING=hello"};
  spec.workdir = "/";
  spec.stop_grace = grace;
  return spec;
}

bool Gone(pid_t pid, absl::Duration timeout) {
  const absl::Time until = absl::Now() + timeout;
  while (absl::Now() < until) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

TEST(SupervisedProgramTest, ReportsTheExitCodeAndTheOutput) {
  auto program = SupervisedProgram::Launch(
      Shell("echo $GREETING from $(pwd); echo oops >&2; exit 42"));
  ASSERT_TRUE(program.ok()) << program.status();
  EXPECT_EQ(ReadAll((*program)->stdout_fd()), "hello from /\n");
  EXPECT_EQ(ReadAll((*program)->stderr_fd()), "oops\n");
  auto end = (*program)->ReadEnd();
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_FALSE(end->exec_failed);
  EXPECT_FALSE(end->signaled);
  EXPECT_EQ(end->exit_code, 42);
  EXPECT_TRUE((*program)->WaitReaped(absl::Seconds(30)));
}

TEST(SupervisedProgramTest, ReportsTheSignalThatEndedIt) {
  auto program = SupervisedProgram::Launch(Shell("kill -9 $$"));
  ASSERT_TRUE(program.ok()) << program.status();
  auto end = (*program)->ReadEnd();
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_TRUE(end->signaled);
  EXPECT_EQ(end->signal, SIGKILL);
  EXPECT_EQ(SignalName(end->signal), "SIGKILL");
}

TEST(SupervisedProgramTest, ReportsWhyExecFailed) {
  LaunchSpec spec = Shell("true");
  spec.executable = "/no/such/interpreter";
  auto program = SupervisedProgram::Launch(spec);
  ASSERT_TRUE(program.ok()) << program.status();
  auto end = (*program)->ReadEnd();
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_TRUE(end->exec_failed);
  EXPECT_EQ(end->exec_errno, ENOENT);
  spec = Shell("true");
  spec.workdir = "/no/such/dir";
  program = SupervisedProgram::Launch(spec);
  ASSERT_TRUE(program.ok()) << program.status();
  end = (*program)->ReadEnd();
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_TRUE(end->exec_failed);
  EXPECT_EQ(end->exec_errno, ENOENT);
}

// The program leaves a grandchild that ignores SIGTERM; it prints the grandchild's pid.
constexpr char kStubborn[] =
    "sh -c 'trap \"\" TERM; while true; do sleep 0.05; done' & echo $!; ";

pid_t FirstLinePid(int fd) {
  std::string line;
  char c;
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (absl::Now() < until) {
    const ssize_t n = read(fd, &c, 1);
    if (n == 1 && c == '\n') break;
    if (n == 1) {
      line += c;
    } else {
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  int pid = 0;
  EXPECT_TRUE(absl::SimpleAtoi(line, &pid)) << line;
  return pid;
}

TEST(SupervisedProgramTest, StopEndsTheWholeGroupAfterTheGrace) {
  auto program = SupervisedProgram::Launch(
      Shell(std::string(kStubborn) + "trap '' TERM; while true; do sleep 0.05; done",
            absl::Milliseconds(300)));
  ASSERT_TRUE(program.ok()) << program.status();
  const pid_t grandchild = FirstLinePid((*program)->stdout_fd());
  const pid_t main = (*program)->program_pid();
  absl::SleepFor(absl::Milliseconds(100));  // the traps are set
  const absl::Time stop = absl::Now();
  (*program)->Stop();
  EXPECT_TRUE((*program)->WaitReaped(absl::Seconds(30)));
  EXPECT_GE(absl::Now() - stop, absl::Milliseconds(250)) << "SIGKILL before the grace";
  EXPECT_TRUE(Gone(main, absl::Seconds(5)));
  EXPECT_TRUE(Gone(grandchild, absl::Seconds(5)));
  auto end = (*program)->ReadEnd();
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_TRUE(end->signaled);
  EXPECT_EQ(end->signal, SIGKILL);
}

TEST(SupervisedProgramTest, WhatTheProgramLeftBehindGoesWhenItExits) {
  auto program = SupervisedProgram::Launch(Shell(std::string(kStubborn) + "exit 0",
                                                 absl::Milliseconds(200)));
  ASSERT_TRUE(program.ok()) << program.status();
  const pid_t grandchild = FirstLinePid((*program)->stdout_fd());
  auto end = (*program)->ReadEnd();
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->exit_code, 0);
  EXPECT_TRUE((*program)->WaitReaped(absl::Seconds(30)));
  EXPECT_TRUE(Gone(grandchild, absl::Seconds(5)));
}

TEST(SupervisedProgramTest, TheGroupGoesWhenItsWorkerDies) {
  // A stand-in worker: a forked copy of this test that launches the program and writes the
  // grandchild's pid, then is killed with SIGKILL.
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t worker = fork();
  ASSERT_GE(worker, 0);
  if (worker == 0) {
    close(pipe_fds[0]);
    auto program = SupervisedProgram::Launch(
        Shell(std::string(kStubborn) + "echo $$; trap '' TERM; while true; do sleep 0.05; done",
              absl::Milliseconds(200)));
    if (!program.ok()) _exit(1);
    const pid_t grandchild = FirstLinePid((*program)->stdout_fd());
    const pid_t main = (*program)->program_pid();
    const std::string pids = absl::StrCat(main, " ", grandchild, "\n");
    (void)!write(pipe_fds[1], pids.data(), pids.size());
    pause();
    _exit(0);
  }
  close(pipe_fds[1]);
  std::string pids;
  char c;
  while (read(pipe_fds[0], &c, 1) == 1 && c != '\n') pids += c;
  close(pipe_fds[0]);
  int main_pid = 0, grandchild = 0;
  const size_t space = pids.find(' ');
  ASSERT_NE(space, std::string::npos) << pids;
  ASSERT_TRUE(absl::SimpleAtoi(pids.substr(0, space), &main_pid));
  ASSERT_TRUE(absl::SimpleAtoi(pids.substr(space + 1), &grandchild));
  kill(worker, SIGKILL);
  waitpid(worker, nullptr, 0);
  EXPECT_TRUE(Gone(main_pid, absl::Seconds(10))) << "the program outlived its worker";
  EXPECT_TRUE(Gone(grandchild, absl::Seconds(10))) << "the grandchild outlived the worker";
}

TEST(SummarizeStderrTest, NamesWhatWentWrong) {
  EXPECT_EQ(SummarizeStderr("Traceback (most recent call last):\n  File \"t.py\", line 3, in "
                            "<module>\n    main()\nValueError: bad shape\n"),
            "ValueError: bad shape");
  // The last traceback's exception, not a chained one's.
  EXPECT_EQ(SummarizeStderr("Traceback (most recent call last):\n  x\nKeyError: 'a'\n\nDuring "
                            "handling...\n\nTraceback (most recent call last):\n  y\n"
                            "RuntimeError: second\n"),
            "RuntimeError: second");
  EXPECT_EQ(SummarizeStderr("Traceback (most recent call last):\n  File \"t.py\"\n"
                            "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                            "2.00 GiB (GPU 0; 79.10 GiB total capacity)\n"),
            "CUDA out of memory: torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to "
            "allocate 2.00 GiB (GPU 0; 79.10 GiB total capacity)");
  EXPECT_EQ(SummarizeStderr("warning: x\nsegmentation fault somewhere\n\n"),
            "segmentation fault somewhere");
  EXPECT_EQ(SummarizeStderr(""), "");
}

TEST(ReportPacerTest, MarksTheFirstReportAndMeasuresSamplesPerSecond) {
  ReportPacer pacer;
  const v1::Assignment a = ProgramAssignment();
  v1::ProgramReportRequest r;
  r.set_step(10);
  r.set_samples(64);
  r.set_loss(2.5);
  r.set_has_loss(true);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  v1::ProgressReport first = pacer.Next(a, r, t0);
  EXPECT_TRUE(first.first_of_generation());
  EXPECT_EQ(first.job_id(), "job-4-abc");
  EXPECT_EQ(first.generation(), 3);
  EXPECT_EQ(first.step(), 10);
  EXPECT_EQ(first.loss(), 2.5);
  EXPECT_EQ(first.samples_per_second(), 0);
  r.set_step(14);
  r.set_has_loss(false);
  r.set_loss(0);
  v1::ProgressReport next = pacer.Next(a, r, t0 + absl::Seconds(2));
  EXPECT_FALSE(next.first_of_generation());
  EXPECT_DOUBLE_EQ(next.samples_per_second(), 64.0 * 4 / 2);
  EXPECT_EQ(next.loss(), 0);
}

}  // namespace
}  // namespace lockstep::worker
