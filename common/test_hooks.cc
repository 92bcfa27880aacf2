// Test hooks: a process-wide table of armed names, and a file barrier per hook.
#include "common/test_hooks.h"

#include <unistd.h>

#include <filesystem>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "glog/logging.h"

namespace lockstep::test_hooks {
namespace {

constexpr absl::Duration kMaxHold = absl::Seconds(120);

struct Table {
  absl::Mutex mu;
  std::string dir ABSL_GUARDED_BY(mu);
  // name -> value to hold at (-1: any).
  std::map<std::string, int64_t> armed ABSL_GUARDED_BY(mu);
};

Table& GetTable() {
  static Table* table = new Table;
  return *table;
}

std::atomic<bool> g_any_armed{false};

}  // namespace

absl::Status Arm(const std::string& spec, const std::string& dir) {
  if (spec.empty()) return absl::OkStatus();
  if (dir.empty()) return absl::InvalidArgumentError("--test_hooks needs --test_hooks_dir");
  Table& table = GetTable();
  absl::MutexLock lock(&table.mu);
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    std::vector<std::string> parts = absl::StrSplit(item, '@');
    int64_t value = -1;
    if (parts.size() > 2 || parts[0].empty() ||
        (parts.size() == 2 && (!absl::SimpleAtoi(parts[1], &value) || value < 0))) {
      return absl::InvalidArgumentError(
          absl::StrCat("--test_hooks: \"", item, "\" is not NAME or NAME@N"));
    }
    table.armed[parts[0]] = value;
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("--test_hooks_dir ", dir, ": ", ec.message()));
  table.dir = dir;
  g_any_armed = true;
  return absl::OkStatus();
}

bool Reach(const char* name, int64_t value, const std::atomic<bool>* abort) {
  if (!g_any_armed.load(std::memory_order_relaxed)) return false;
  Table& table = GetTable();
  std::string dir;
  {
    absl::MutexLock lock(&table.mu);
    auto it = table.armed.find(name);
    if (it == table.armed.end() || (it->second >= 0 && it->second != value)) return false;
    table.armed.erase(it);
    dir = table.dir;
  }
  const std::string base = absl::StrCat(dir, "/", name);
  LOG(WARNING) << "test hook " << name << (value >= 0 ? absl::StrCat("@", value) : "")
               << " reached: holding until " << base << ".release";
  if (absl::Status s = WriteFileAtomically(base + ".reached", absl::StrCat(getpid(), "\n"),
                                           Durability::kVisible);
      !s.ok()) {
    LOG(ERROR) << "test hook " << name << ": " << s;
  }
  const absl::Time until = absl::Now() + kMaxHold;
  while (absl::Now() < until && !std::filesystem::exists(base + ".release")) {
    if (abort != nullptr && abort->load()) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  LOG(WARNING) << "test hook " << name << " released";
  return true;
}

}  // namespace lockstep::test_hooks
