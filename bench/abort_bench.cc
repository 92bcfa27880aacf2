// How fast an abort releases a worker, whatever the transport: the time from AbortSignal::Raise
// to the return of a call blocked on a peer that never answers (a frozen or partitioned
// process), for a Gloo collective, a Gloo group formation and a shared-memory sum. The
// collective timeout is a minute, so without the abort each call would wait that long.
// Prints a Markdown table and writes JSON. Usage: abort_bench [--trials=20] [--out=FILE]
#include <algorithm>
#include <fstream>
#include <iostream>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "tests/testing/local_store.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/shm_communicator.h"

ABSL_FLAG(int, trials, 20, "Aborts measured per kind of wait.");
ABSL_FLAG(std::string, out, "bench/results/abort_latency.json", "Where the JSON goes.");

namespace lockstep {
namespace {

using worker::AbortSignal;
using worker::Communicator;
using worker::GlooCommunicator;

constexpr std::chrono::milliseconds kTimeout(60000);

// Raises `abort` 20 ms after `blocked` started waiting (it calls `waiting()` just before its
// blocking call and `returned()` right after it); returns the time from the raise to the
// call's return, or -1 if it returned anything but ABORTED. Teardown is not timed.
using Blocked = std::function<absl::Status(std::shared_ptr<AbortSignal>,
                                           const std::function<void()>& waiting,
                                           const std::function<void()>& returned)>;
double MeasureOnce(const Blocked& blocked) {
  auto abort = std::make_shared<AbortSignal>();
  absl::Notification started;
  absl::Time raised, returned;
  std::thread raiser([&] {
    started.WaitForNotification();
    absl::SleepFor(absl::Milliseconds(20));
    raised = absl::Now();
    abort->Raise();
  });
  const absl::Status s =
      blocked(abort, [&] { started.Notify(); }, [&] { returned = absl::Now(); });
  if (!started.HasBeenNotified()) started.Notify();
  raiser.join();
  if (!absl::IsAborted(s)) return -1;
  return absl::ToDoubleMilliseconds(returned - raised);
}

// Forms a two-rank group whose rank 1 then freezes (calls nothing until released) and runs
// call(rank 0's communicator) after `waiting()`.
absl::Status WithFrozenPeer(bool shm, std::shared_ptr<AbortSignal> abort,
                            const std::function<void()>& waiting,
                            const std::function<void()>& returned,
                            const std::function<absl::Status(Communicator&)>& call) {
  coordinator::BootstrapStore store;
  static int generation = 0;
  const coordinator::StoreScope scope{"bench", ++generation};
  store.Open(scope);
  absl::Notification release;
  std::thread rank1([&] {
    auto gloo = GlooCommunicator::Create(
        1, 2, std::make_shared<testing::LocalStoreClient>(&store, scope), "127.0.0.1", kTimeout);
    if (!gloo.ok()) return;
    std::unique_ptr<Communicator> comm = *std::move(gloo);
    if (shm) comm = *worker::ShmCommunicator::Wrap(std::move(comm), 1 << 20, kTimeout);
    release.WaitForNotification();
  });
  absl::Status s;
  {
    auto gloo = GlooCommunicator::Create(
        0, 2, std::make_shared<testing::LocalStoreClient>(&store, scope), "127.0.0.1", kTimeout,
        abort);
    if (!gloo.ok()) {
      s = gloo.status();
    } else {
      std::unique_ptr<Communicator> comm = *std::move(gloo);
      if (shm) comm = *worker::ShmCommunicator::Wrap(std::move(comm), 1 << 20, kTimeout, abort);
      waiting();
      s = call(*comm);
      returned();
    }
  }
  release.Notify();
  rank1.join();
  return s;
}

struct Row {
  std::string wait;
  std::vector<double> ms;
};

}  // namespace
}  // namespace lockstep

int main(int argc, char** argv) {
  using namespace lockstep;
  absl::ParseCommandLine(argc, argv);
  const int trials = absl::GetFlag(FLAGS_trials);
  std::vector<Row> rows;
  auto run = [&](const std::string& name, const Blocked& blocked) {
    Row row{name, {}};
    for (int i = 0; i < trials; ++i) row.ms.push_back(MeasureOnce(blocked));
    rows.push_back(std::move(row));
  };
  std::vector<float> data(1 << 16, 1.0f);
  run("Gloo allreduce, peer frozen", [&](auto abort, const auto& waiting, const auto& returned) {
    return WithFrozenPeer(false, abort, waiting, returned, [&](Communicator& c) {
      return c.AllreduceSum(data.data(), data.size());
    });
  });
  run("shared-memory sum, peer frozen",
      [&](auto abort, const auto& waiting, const auto& returned) {
        return WithFrozenPeer(true, abort, waiting, returned, [&](Communicator& c) {
          return c.AllreduceSum(data.data(), 1024);
        });
      });
  run("Gloo group formation, peer missing",
      [&](auto abort, const auto& waiting, const auto& returned) {
    coordinator::BootstrapStore store;
    static int generation = 0;
    const coordinator::StoreScope scope{"bench-form", ++generation};
    store.Open(scope);
    waiting();
    absl::Status s = GlooCommunicator::Create(
                         0, 2, std::make_shared<testing::LocalStoreClient>(&store, scope, abort),
                         "127.0.0.1", kTimeout, abort)
                         .status();
    returned();
    return s;
  });

  std::cout << "Abort latency: AbortSignal::Raise to the blocked call's return (collective "
               "timeout 60 s), "
            << trials << " trials each\n\n| blocked in | median | p90 | max | not aborted |\n"
            << "|---|---|---|---|---|\n";
  std::string json = "{\"trials\": " + std::to_string(trials) + ", \"rows\": [";
  for (size_t r = 0; r < rows.size(); ++r) {
    std::vector<double> ok;
    int failed = 0;
    for (double v : rows[r].ms) (v < 0 ? ++failed : (ok.push_back(v), 0));
    std::sort(ok.begin(), ok.end());
    auto at = [&](double q) { return ok.empty() ? 0.0 : ok[std::min(ok.size() - 1, size_t(q * ok.size()))]; };
    std::cout << absl::StrFormat("| %s | %.2f ms | %.2f ms | %.2f ms | %d |\n", rows[r].wait,
                                 at(0.5), at(0.9), ok.empty() ? 0.0 : ok.back(), failed);
    absl::StrAppendFormat(&json, "%s{\"wait\": \"%s\", \"median_ms\": %.3f, \"p90_ms\": %.3f, "
                          "\"max_ms\": %.3f, \"not_aborted\": %d}",
                          r == 0 ? "" : ", ", rows[r].wait, at(0.5), at(0.9),
                          ok.empty() ? 0.0 : ok.back(), failed);
  }
  json += "]}\n";
  std::ofstream(absl::GetFlag(FLAGS_out)) << json;
  return 0;
}
