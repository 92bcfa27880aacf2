// The directories a job's paths may lie in: by name on the coordinator, and through symbolic
// links on a worker's host.
#include "common/path_roots.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "coordinator/core/job_spec.h"
#include "gtest/gtest.h"

namespace lockstep {
namespace {

TEST(PathRootsTest, ParsesAbsoluteDirectoriesOnly) {
  auto roots = PathRoots::Parse(" /data, /srv//lockstep/ ");
  ASSERT_TRUE(roots.ok()) << roots.status();
  EXPECT_EQ(roots->roots(), (std::vector<std::string>{"/data", "/srv/lockstep"}));
  EXPECT_FALSE(PathRoots::Parse("").value().restricted());
  EXPECT_FALSE(PathRoots::Parse("data").ok());
  EXPECT_FALSE(PathRoots::Parse("/data/../etc").ok());
}

TEST(PathRootsTest, ChecksByComponents) {
  const PathRoots roots = PathRoots::Parse("/data").value();
  EXPECT_TRUE(roots.Check("dataset.path", "/data").ok());
  EXPECT_TRUE(roots.Check("dataset.path", "/data/mnist/./train").ok());
  EXPECT_TRUE(roots.Check("dataset.path", "").ok()) << "no path, nothing to check";
  for (const char* bad : {"/data2/x", "/etc/passwd", "/data/../etc/shadow", "data/x", "/"}) {
    absl::Status s = roots.Check("dataset.path", bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("dataset.path"), std::string::npos) << s;
  }
  EXPECT_TRUE(PathRoots().Check("dataset.path", "/anywhere/../at/all").ok()) << "unrestricted";
  EXPECT_TRUE(PathIsWithin("/x", "/"));
  EXPECT_FALSE(PathIsWithin("/datax", "/data"));
}

TEST(PathRootsTest, OnTheHostASymlinkOutOfTheRootIsRefused) {
  std::string dir = std::filesystem::temp_directory_path() / "lockstep-roots-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  std::filesystem::create_directories(dir + "/root/inside");
  std::ofstream(dir + "/root/inside/data.txt") << "ok";
  std::filesystem::create_directories(dir + "/outside");
  std::ofstream(dir + "/outside/secret") << "no";
  std::filesystem::create_symlink(dir + "/outside", dir + "/root/escape");
  std::filesystem::create_symlink(dir + "/root/inside", dir + "/root/alias");
  const PathRoots roots = PathRoots::Parse(dir + "/root").value();
  EXPECT_TRUE(roots.CheckOnHost("dataset.path", dir + "/root/inside/data.txt").ok());
  EXPECT_TRUE(roots.CheckOnHost("dataset.path", dir + "/root/alias/data.txt").ok())
      << "a link that stays inside";
  EXPECT_TRUE(roots.CheckOnHost("checkpoint_dir", dir + "/root/new/deeper").ok())
      << "a directory that does not exist yet";
  for (const std::string& bad :
       {dir + "/root/escape/secret", dir + "/root/escape", dir + "/root/escape/new-dir"}) {
    absl::Status s = roots.CheckOnHost("dataset.path", bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << bad;
    EXPECT_NE(s.message().find("outside the allowed directories"), std::string::npos) << s;
  }
  std::filesystem::remove_all(dir);
}

TEST(PathRootsTest, JobPathsGoToTheirRoots) {
  const PathRoots data = PathRoots::Parse("/data").value();
  const PathRoots checkpoints = PathRoots::Parse("/ckpt").value();
  v1::JobSpec spec;
  spec.mutable_dataset()->set_path("/data/fortunes");
  spec.set_checkpoint_dir("/ckpt/run-1");
  spec.set_output_dir("/ckpt/out");
  spec.mutable_init_from_checkpoint()->set_path("/data/pretrained.ckpt");
  EXPECT_TRUE(coordinator::CheckJobPaths(spec, data, checkpoints).ok());
  for (const auto& [field, mutate] :
       std::vector<std::pair<std::string, std::function<void(v1::JobSpec*)>>>{
           {"dataset.path", [](v1::JobSpec* s) { s->mutable_dataset()->set_path("/ckpt/x"); }},
           {"dataset.validation_path",
            [](v1::JobSpec* s) { s->mutable_dataset()->set_validation_path("/etc/passwd"); }},
           {"checkpoint_dir", [](v1::JobSpec* s) { s->set_checkpoint_dir("/data/ckpt"); }},
           {"output_dir", [](v1::JobSpec* s) { s->set_output_dir("/tmp/../etc"); }},
           {"init_from_checkpoint.path",
            [](v1::JobSpec* s) { s->mutable_init_from_checkpoint()->set_path("/root/x"); }}}) {
    v1::JobSpec bad = spec;
    mutate(&bad);
    absl::Status s = coordinator::CheckJobPaths(bad, data, checkpoints);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(s.message().find(field), std::string::npos) << s;
  }
}

// The daemons' flags always give roots: the defaults are Lockstep's directories and the
// examples' Debian data; an empty flag is refused naming it ("/" allows any path, on purpose).
TEST(PathRootsTest, DaemonFlagsHaveSecureDefaultsAndRefuseEmptyRoots) {
  PathRoots data, checkpoints;
  ASSERT_TRUE(ParseRootFlags(kDefaultDataRoots, kDefaultCheckpointRoots, &data, &checkpoints).ok());
  EXPECT_TRUE(data.Check("dataset.path", "/usr/share/datasets/fashion-mnist").ok());
  EXPECT_TRUE(data.Check("dataset.path", "/usr/share/games/fortunes").ok());
  EXPECT_FALSE(data.Check("dataset.path", "/etc/shadow").ok());
  EXPECT_TRUE(checkpoints.Check("checkpoint_dir", "/var/lib/lockstep/checkpoints/run").ok());
  EXPECT_FALSE(checkpoints.Check("checkpoint_dir", "/root/run").ok());
  EXPECT_FALSE(data.allows_any_path());
  for (const auto& [d, c, flag] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"", "/ckpt", "--data_root"}, {"/data", " , ", "--checkpoint_root"}}) {
    absl::Status s = ParseRootFlags(d, c, &data, &checkpoints);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << flag;
    EXPECT_NE(s.message().find(flag), std::string::npos) << s;
    EXPECT_NE(s.message().find("\"/\" for any path"), std::string::npos) << s;
  }
  ASSERT_TRUE(ParseRootFlags("/", "/", &data, &checkpoints).ok());
  EXPECT_TRUE(data.allows_any_path());
  EXPECT_TRUE(data.Check("dataset.path", "/etc/shadow").ok());
}

}  // namespace
}  // namespace lockstep
