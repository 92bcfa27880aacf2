// Simulated workers for the control plane's benchmark and scale test: N Session streams on the
// real API, speaking exactly what lockstep-worker sends (register, then heartbeats every 500
// ms), driven by gRPC's callback API from a few threads so that the simulation is never what
// limits N. They never train: they record what the coordinator tells them.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/status/status.h"
#include "lockstep/v1/job.pb.h"
#include "lockstep/v1/store.grpc.pb.h"
#include "lockstep/v1/worker.grpc.pb.h"

namespace lockstep::bench {

// A job the simulated workers can hold: a tiny MLP they never train (its step timeout is an
// hour), split so that up to `max_workers` of them take a micro-shard each.
v1::JobSpec SimulatedJob(int min_workers, int max_workers);

struct SimWorkersOptions {
  int workers = 0;
  int workers_per_host = 8;     // host names "host-0000", ..., dealt round-robin
  int streams_per_channel = 64;  // Session streams per connection
};

class SimWorkers {
 public:
  // Opens every stream at once (names "sim-00000", ...) and starts the heartbeats.
  SimWorkers(const std::string& address, SimWorkersOptions options);
  // Ends every stream and waits for them.
  ~SimWorkers();

  // Each waits until its count is reached; false after `timeout`.
  bool WaitRegistered(absl::Duration timeout);
  bool WaitAssigned(int64_t generation, int count, absl::Duration timeout);
  bool WaitAborted(int64_t generation, int count, absl::Duration timeout);

  // Ends worker i's stream, as a dying worker's would end.
  void Drop(int i);

  // The bootstrap store, as members forming a group use it. Every worker holding an assignment
  // to (job_id, generation) starts a StoreService.Wait for `key` at once and returns; the
  // answers are counted (WaitStoreAnswers). StoreSet sets a key as worker i.
  int StartStoreWaits(const std::string& job_id, int64_t generation, const std::string& key,
                      absl::Duration timeout);
  absl::Status StoreSet(int i, const std::string& job_id, int64_t generation,
                        const std::string& key, const std::string& value);
  // Until `count` waits have been answered; false after `timeout`. *ok: how many were OK.
  bool WaitStoreAnswers(int count, absl::Duration timeout, int* ok);
  int size() const { return static_cast<int>(workers_.size()); }
  const std::string& host(int i) const;
  // Worker i's rank in `generation` (-1: not assigned to it).
  int RankIn(int i, int64_t generation);
  int registered();
  int ended();
  // Messages the coordinator has sent, all streams together.
  int64_t received();

  class Worker;  // one stream (sim_workers.cc)

 private:
  struct Tally {
    absl::Mutex mu;
    int registered ABSL_GUARDED_BY(mu) = 0;
    int64_t received ABSL_GUARDED_BY(mu) = 0;
    int ended ABSL_GUARDED_BY(mu) = 0;
    std::map<int64_t, int> assigned ABSL_GUARDED_BY(mu);  // generation -> workers assigned
    std::map<int64_t, int> aborted ABSL_GUARDED_BY(mu);   // generation -> workers aborted
    std::vector<std::map<int64_t, int>> ranks ABSL_GUARDED_BY(mu);  // per worker
    std::vector<std::string> session_keys ABSL_GUARDED_BY(mu);     // per worker
    int store_started ABSL_GUARDED_BY(mu) = 0;
    int store_answers ABSL_GUARDED_BY(mu) = 0;
    int store_ok ABSL_GUARDED_BY(mu) = 0;
  };
  bool WaitCount(std::map<int64_t, int> Tally::*counts, int64_t generation, int count,
                 absl::Duration timeout);

  Tally tally_;
  std::vector<std::unique_ptr<v1::WorkerService::Stub>> stubs_;
  std::vector<std::unique_ptr<v1::StoreService::Stub>> store_stubs_;  // on the same channels
  int per_channel_ = 1;
  struct StoreCall;  // one Wait in flight
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<std::string> hosts_;
  std::atomic<bool> beating_{true};
  std::thread heart_;
};

}  // namespace lockstep::bench
