// The coordinator's Prometheus metrics. Event metrics (recoveries and their times, queue waits,
// RPCs) are counted from what the coordinator already records: the job snapshots it saves after
// each decision, and each RPC's final status through a gRPC server interceptor. State metrics
// (jobs by state, workers by state and device, rejected clients) are read at scrape time.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/synchronization/mutex.h"
#include "grpcpp/support/server_interceptor.h"
#include "lockstep/v1/job.pb.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace lockstep::coordinator {

// What the scrape-time collector reads from the coordinator under its lock.
struct ClusterCounts {
  std::map<v1::JobState, int64_t> jobs;
  std::map<std::pair<std::string, std::string>, int64_t> workers;  // (state, device) -> count
  int64_t rejected_calls = 0;    // calls refused by the token check, ever
  int64_t rejected_clients = 0;  // distinct (peer, client) pairs remembered
};

class CoordinatorMetrics {
 public:
  // Counts what happens from `since_unix_ms` on (the process's start): a restored job's
  // earlier recoveries and queue wait were counted by the coordinator that saw them.
  CoordinatorMetrics(prometheus::Registry& registry, int64_t since_unix_ms);

  // A job's snapshot after a decision, in decision order (a stale one changes nothing): counts
  // the recoveries that began since the last one seen, times those that ended, and the queue
  // wait of a job that started.
  void ObserveJob(const v1::Job& job);
  // One finished RPC. Its `method` label is one of the methods the coordinator serves
  // (ServedMethods) or "other": a raw client may call any name at all, each answered
  // UNIMPLEMENTED, and a label value per name would grow every scrape without bound.
  void ObserveRpc(const std::string& method, grpc::StatusCode code);
  // "/package.Service/Method" for every method of the lockstep.v1 services (from their
  // descriptors), the health service and the reflection service.
  static std::set<std::string> ServedMethods();

  // For ServerBuilder::experimental().SetInterceptorCreators: observes every RPC's status.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory();

  // The state families for a ScrapeCollector.
  static std::vector<prometheus::MetricFamily> StateFamilies(const ClusterCounts& counts);

  // "failure", "scale_up" or "coordinator" (a loss the coordinator's own absence caused, or
  // its restart).
  static std::string RecoveryKind(const v1::Recovery& recovery);

 private:
  struct Seen {
    int counted = 0;  // recovery_history entries counted (when they began)
    int timed = 0;    // entries whose end was observed (or that a later one replaced)
    bool started = false;
  };

  const int64_t since_unix_ms_;
  const std::set<std::string> served_methods_;
  prometheus::Family<prometheus::Counter>& rpcs_;
  prometheus::Family<prometheus::Counter>& recoveries_;
  prometheus::Histogram& recovery_seconds_;
  prometheus::Histogram& formation_seconds_;
  prometheus::Histogram& queue_wait_seconds_;
  prometheus::Counter& steps_redone_;

  absl::Mutex mu_;
  std::map<std::string, Seen> seen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lockstep::coordinator
