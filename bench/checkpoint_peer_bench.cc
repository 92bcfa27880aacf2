// The peer copy of program jobs' lockstep.torch checkpoints (worker/program/checkpoint_peer.h):
// two workers' checkpoint memories on this host's tmpfs, their CheckpointPeerServers on
// loopback, and the real code paths between them. For states of 100 MB and 1 GB: the copy of
// a committed save to the peer (what follows every save, in the background), and the fetch of
// it back into a worker whose memory was lost (what a restarted worker or a spare waits for
// before its process starts); each read, streamed, checked and committed. Median and best of
// --reps. Prints a Markdown table and writes JSON.
// Usage: checkpoint_peer_bench [--sizes_mb=100,1024] [--reps=3] [--dir=/dev/shm] [--out=FILE]
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "worker/program/checkpoint_memory.h"
#include "worker/program/checkpoint_peer.h"

ABSL_FLAG(std::string, sizes_mb, "100,1024", "State sizes in MB (10^6 bytes).");
ABSL_FLAG(int, reps, 3, "Copies and fetches measured per size.");
ABSL_FLAG(std::string, dir, "/dev/shm", "The tmpfs the checkpoint memories live in.");
ABSL_FLAG(std::string, out, "bench/results/checkpoint_peer_bench.json", "Where the JSON goes.");

namespace lockstep::worker {
namespace {

constexpr uid_t kOwn = static_cast<uid_t>(-1);  // the slots stay this process's
constexpr gid_t kOwnGroup = static_cast<gid_t>(-1);

// A committed save of `bytes` in the job's own slot, as lockstep.torch.Checkpointer leaves it.
void WriteSave(const std::string& path, uint64_t sequence, int64_t step, size_t bytes) {
  std::vector<char> payload(bytes);
  for (size_t i = 0; i < bytes; i += 4096) payload[i] = static_cast<char>(i / 4096 + step);
  const int fd = open(path.c_str(), O_RDWR);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = pwrite(fd, payload.data() + done, bytes - done,
                             static_cast<off_t>(kCheckpointSlotHeaderBytes + done));
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  uint64_t header[5];
  std::memcpy(&header[0], kCheckpointSlotMagic, 8);
  header[1] = sequence;
  header[2] = static_cast<uint64_t>(step);
  header[3] = bytes;
  header[4] = XXH3_64bits(payload.data(), bytes);
  (void)!pwrite(fd, header, sizeof header, 0);
  close(fd);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int Run() {
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  std::string root = absl::StrCat(absl::GetFlag(FLAGS_dir), "/lockstep-peer-bench-XXXXXX");
  if (mkdtemp(root.data()) == nullptr) {
    std::cerr << "cannot create a directory under " << absl::GetFlag(FLAGS_dir) << "\n";
    return 1;
  }
  struct Row {
    int64_t mb;
    double copy_ms, copy_best_ms, fetch_ms, fetch_best_ms;
  };
  std::vector<Row> rows;
  for (absl::string_view text : absl::StrSplit(absl::GetFlag(FLAGS_sizes_mb), ',')) {
    int64_t mb = 0;
    if (!absl::SimpleAtoi(text, &mb) || mb <= 0) {
      std::cerr << "--sizes_mb: not a size: " << text << "\n";
      return 2;
    }
    const size_t bytes = static_cast<size_t>(mb) * 1000 * 1000;
    const int64_t limit = static_cast<int64_t>(bytes) * 5;
    auto holder = CheckpointMemory::Create(root, "holder", limit, kOwn, kOwnGroup);
    auto source = CheckpointMemory::Create(root, "source", limit, kOwn, kOwnGroup);
    if (!holder.ok() || !source.ok()) {
      std::cerr << "checkpoint memory: " << holder.status() << " " << source.status() << "\n";
      return 1;
    }
    auto server = CheckpointPeerServer::Start("127.0.0.1", holder->get());
    if (!server.ok()) {
      std::cerr << server.status() << "\n";
      return 1;
    }
    auto serves = (*server)->Serve("bench", "secret");
    auto slots = (*source)->Slots("bench", kCheckpointSlotHeaderBytes + bytes);
    if (!slots.ok()) {
      std::cerr << slots.status() << "\n";
      return 1;
    }
    std::vector<double> copies, fetches;
    CheckpointReplicator replicator(source->get(), "bench", "source", "holder",
                                    (*server)->address(), "secret", absl::ZeroDuration());
    for (int rep = 1; rep <= reps; ++rep) {
      WriteSave((*slots)[rep % 2], rep, rep, bytes);
      replicator.Wake();
      if (!replicator.WaitCopied(rep, absl::Minutes(10)) || replicator.stats().last_step != rep) {
        std::cerr << "the copy of step " << rep << " failed (see the log)\n";
        return 1;
      }
      // The copy's own time (the follower may wait before it, bounding its share of the time).
      copies.push_back(absl::ToDoubleMilliseconds(replicator.stats().last_time));
      // A new worker's memory each time: the fetch lands in slots of its own.
      auto fresh = CheckpointMemory::Create(root, "fresh", limit, kOwn, kOwnGroup);
      const absl::Time fetch_start = absl::Now();
      auto fetched = FetchCheckpoint(fresh->get(), (*server)->address(), "holder", "secret",
                                     "bench", "source", rep);
      if (!fetched.ok()) {
        std::cerr << fetched.status() << "\n";
        return 1;
      }
      fetches.push_back(absl::ToDoubleMilliseconds(absl::Now() - fetch_start));
    }
    rows.push_back({mb, Median(copies), *std::min_element(copies.begin(), copies.end()),
                    Median(fetches), *std::min_element(fetches.begin(), fetches.end())});
  }
  std::filesystem::remove_all(root);
  std::cout << "| state | copy to the peer (median / best) | GB/s | fetch back (median / best) "
               "| GB/s |\n|---|---|---|---|---|\n";
  std::ofstream json(absl::GetFlag(FLAGS_out));
  json << "{\"reps\": " << reps << ", \"rows\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const double gb = static_cast<double>(r.mb) / 1000.0;
    std::cout << absl::StrFormat("| %d MB | %.0f / %.0f ms | %.2f | %.0f / %.0f ms | %.2f |\n",
                                 r.mb, r.copy_ms, r.copy_best_ms, gb / (r.copy_ms / 1000),
                                 r.fetch_ms, r.fetch_best_ms, gb / (r.fetch_ms / 1000));
    json << (i ? ", " : "")
         << absl::StrFormat("{\"mb\": %d, \"copy_ms\": %.1f, \"copy_best_ms\": %.1f, "
                            "\"fetch_ms\": %.1f, \"fetch_best_ms\": %.1f}",
                            r.mb, r.copy_ms, r.copy_best_ms, r.fetch_ms, r.fetch_best_ms);
  }
  json << "]}\n";
  return 0;
}

}  // namespace
}  // namespace lockstep::worker

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return lockstep::worker::Run();
}
