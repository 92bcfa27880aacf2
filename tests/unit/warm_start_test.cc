// Warm starts (worker/program/warm_start.h): a script run in a parked interpreter sees exactly
// what it sees started cold (environment, argv, workdir, sys.path[0], __main__), a launch that
// differs starts cold, and a parked interpreter that died or was discarded is never used. The
// script runs at its start's priority (the imports ran niced, in a thread of their own).
#include "worker/program/warm_start.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace lockstep::worker {
namespace {

// Writes what a script can tell of how it was started to argv[1].
constexpr char kProbe[] = R"py(import os, sys
lines = ["%s=%s" % kv for kv in sorted(os.environ.items())]
lines += ["ARGV=%r" % (sys.argv,), "CWD=" + os.getcwd(), "PATH0=" + sys.path[0],
          "NAME=" + __name__, "FILE=" + __file__,
          "MAIN=%s" % (sys.modules["__main__"].__dict__ is globals()),
          "SPEC=%r" % (__spec__ is None or __spec__.name,), "NICE=%d" % os.nice(0),
          "SCHED=%d" % os.sched_getscheduler(0)]
out = sys.argv[-1]
with open(out + ".tmp", "w") as f:
    f.write("\n".join(lines) + "\n")
os.rename(out + ".tmp", out)
)py";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class WarmStartsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/lockstep-warm-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    std::filesystem::create_directories(dir_ + "/pkg");
    std::ofstream(dir_ + "/probe.py") << kProbe;
    std::ofstream(dir_ + "/pkg/__init__.py") << "";
    std::ofstream(dir_ + "/pkg/__main__.py") << kProbe;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // A launch of generation `generation` writing to `out`, as ProgramGeneration makes one.
  LaunchSpec Launch(int generation, const std::vector<std::string>& args,
                    const std::string& out) const {
    LaunchSpec spec;
    spec.executable = "/usr/bin/python3";
    spec.argv = {"python3"};
    spec.argv.insert(spec.argv.end(), args.begin(), args.end());
    spec.argv.push_back(out);
    spec.env = {"PATH=/usr/bin:/bin", "LANG=C.UTF-8", "OMP_NUM_THREADS=1", "SETTING=ä b",
                absl::StrCat("RANK=", generation - 1), absl::StrCat("MASTER_PORT=", 29400 + generation),
                absl::StrCat("LOCKSTEP_GENERATION=", generation), "LOCKSTEP_AGENT_TOKEN=secret"};
    spec.workdir = dir_;
    spec.stop_grace = absl::Seconds(2);
    return spec;
  }

  static int Run(std::unique_ptr<SupervisedProgram> program) {
    absl::StatusOr<ProcessEnd> end = program->ReadEnd();
    EXPECT_TRUE(end.ok()) << end.status();
    EXPECT_TRUE(program->WaitReaped(absl::Seconds(30)));
    return end.ok() && !end->signaled && !end->exec_failed ? end->exit_code : -1;
  }

  static bool WaitParked(const WarmStarts& warm) {
    const absl::Time until = absl::Now() + absl::Seconds(60);
    while (warm.parked_pid() < 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
    return warm.parked_pid() >= 0;
  }

  // Runs `args` cold and warm (parked for generation 1, run as generation 2): what each saw.
  std::pair<std::string, std::string> ColdAndWarm(const std::vector<std::string>& args) {
    auto cold = SupervisedProgram::Launch(Launch(2, args, dir_ + "/cold.txt"));
    EXPECT_TRUE(cold.ok()) << cold.status();
    if (!cold.ok()) return {};
    EXPECT_EQ(Run(*std::move(cold)), 0);
    WarmStarts warm({"json"});
    warm.Park(Launch(1, args, dir_ + "/unused.txt"), "job-1");
    EXPECT_TRUE(WaitParked(warm));
    std::unique_ptr<SupervisedProgram> started = warm.Start(Launch(2, args, dir_ + "/warm.txt"));
    EXPECT_NE(started, nullptr);
    if (started == nullptr) return {};
    EXPECT_EQ(Run(std::move(started)), 0);
    EXPECT_EQ(warm.warm_starts(), 1);
    return {ReadFile(dir_ + "/cold.txt"),
            absl::StrReplaceAll(ReadFile(dir_ + "/warm.txt"), {{"warm.txt", "cold.txt"}})};
  }

  std::string dir_;
};

TEST_F(WarmStartsTest, AScriptSeesWhatItSeesStartedCold) {
  auto [cold, warm] = ColdAndWarm({"probe.py", "--epochs=2"});
  ASSERT_FALSE(cold.empty());
  EXPECT_NE(cold.find("LOCKSTEP_GENERATION=2\n"), std::string::npos) << cold;
  EXPECT_NE(cold.find("NAME=__main__\n"), std::string::npos) << cold;
  EXPECT_EQ(warm, cold);
}

TEST_F(WarmStartsTest, AModuleSeesWhatItSeesStartedCold) {
  auto [cold, warm] = ColdAndWarm({"-m", "pkg", "--epochs=2"});
  ASSERT_FALSE(cold.empty());
  EXPECT_EQ(warm, cold);
}

TEST_F(WarmStartsTest, ALaunchThatDiffersStartsColdAndWhatWasParkedGoes) {
  WarmStarts warm({});
  warm.Park(Launch(1, {"probe.py"}, dir_ + "/a.txt"), "job-1");
  ASSERT_TRUE(WaitParked(warm));
  LaunchSpec other = Launch(2, {"probe.py"}, dir_ + "/b.txt");
  other.env.push_back("EXTRA=1");  // a variable Python could read while starting
  EXPECT_EQ(warm.Start(other), nullptr);
  EXPECT_EQ(warm.parked_pid(), -1);
  EXPECT_EQ(warm.warm_starts(), 0);
}

TEST_F(WarmStartsTest, AParkedInterpreterThatDiedIsNotUsed) {
  WarmStarts warm({});
  warm.Park(Launch(1, {"probe.py"}, dir_ + "/a.txt"), "job-1");
  ASSERT_TRUE(WaitParked(warm));
  ASSERT_EQ(kill(warm.parked_pid(), SIGKILL), 0);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(warm.Start(Launch(2, {"probe.py"}, dir_ + "/b.txt")), nullptr);
  EXPECT_EQ(warm.warm_starts(), 0);
}

TEST_F(WarmStartsTest, OnlyItsOwnJobsEndDiscardsWhatIsParked) {
  WarmStarts warm({});
  warm.Park(Launch(1, {"probe.py"}, dir_ + "/a.txt"), "job-1");
  ASSERT_TRUE(WaitParked(warm));
  const pid_t parked = warm.parked_pid();
  warm.Discard("job-2");
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(warm.parked_pid(), parked);
  warm.Discard("job-1");
  EXPECT_EQ(warm.parked_pid(), -1);
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (kill(parked, 0) == 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_NE(kill(parked, 0), 0) << "the discarded interpreter still runs";
  // A park requested for a job that ends before it is done never stays.
  warm.Park(Launch(1, {"probe.py"}, dir_ + "/a.txt"), "job-3");
  warm.Discard("job-3");
  absl::SleepFor(absl::Seconds(1));
  EXPECT_EQ(warm.parked_pid(), -1);
}

TEST_F(WarmStartsTest, AnEnvironmentLargerThanTheHandoffStartsColdAndRunsNothing) {
  // 1.6 MB of environment (each variable under execve's 128 KiB), more than the handoff pipe
  // holds (1 MiB): written whole or not at all, so not at all.
  LaunchSpec big = Launch(1, {"probe.py"}, dir_ + "/big.txt");
  for (int i = 0; i < 16; ++i) {
    big.env.push_back(absl::StrCat("BIG", i, "=", std::string(100 << 10, 'x')));
  }
  WarmStarts warm({});
  warm.Park(big, "job-1");
  ASSERT_TRUE(WaitParked(warm));
  const pid_t parked = warm.parked_pid();
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_EQ(kill(parked, 0), 0) << "the parked interpreter did not start";
  EXPECT_EQ(warm.Start(big), nullptr);
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/big.txt")) << "a partial handoff ran";
}

TEST_F(WarmStartsTest, OnlyAnInterpreterWithAScriptOrAModuleRunsWarm) {
  LaunchSpec spec = Launch(1, {"probe.py"}, "out");
  EXPECT_TRUE(WarmStarts::KeyOf(spec).has_value());
  // Per-generation variables are not part of the key; the rest is.
  LaunchSpec next = Launch(7, {"probe.py"}, "out");
  EXPECT_EQ(WarmStarts::KeyOf(next), WarmStarts::KeyOf(spec));
  next.workdir = "/";
  EXPECT_NE(WarmStarts::KeyOf(next), WarmStarts::KeyOf(spec));
  for (const std::vector<std::string>& argv : std::vector<std::vector<std::string>>{
           {"python3", "-u", "probe.py"}, {"python3", "-c", "print(1)"}, {"python3"},
           {"python3", "app.pyz"}, {"python3", "probe.pyc"},
           {"python3", "-m"}, {"python3", "-m", "-x"}}) {
    spec.argv = argv;
    EXPECT_FALSE(WarmStarts::KeyOf(spec).has_value()) << argv[1 % argv.size()];
  }
  spec.argv = {"python3", "-m", "pkg"};
  EXPECT_TRUE(WarmStarts::KeyOf(spec).has_value());
  spec.executable = "/bin/sh";
  spec.argv = {"sh", "run.sh"};
  EXPECT_FALSE(WarmStarts::KeyOf(spec).has_value());
}

}  // namespace
}  // namespace lockstep::worker
