#include "coordinator/service/metrics.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/support/status_code_enum.h"
#include "lockstep/v1/job.pb.h"
#include "lockstep/v1/store.pb.h"
#include "lockstep/v1/worker.pb.h"

namespace lockstep::coordinator {
namespace {

double Seconds(int64_t from_ms, int64_t to_ms) {
  return static_cast<double>(std::max<int64_t>(0, to_ms - from_ms)) / 1e3;
}

std::string CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::OK: return "OK";
    case grpc::CANCELLED: return "CANCELLED";
    case grpc::UNKNOWN: return "UNKNOWN";
    case grpc::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::NOT_FOUND: return "NOT_FOUND";
    case grpc::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::UNAUTHENTICATED: return "UNAUTHENTICATED";
    case grpc::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::ABORTED: return "ABORTED";
    case grpc::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::INTERNAL: return "INTERNAL";
    case grpc::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::DATA_LOSS: return "DATA_LOSS";
    default: return "OTHER";
  }
}

std::string StateName(v1::JobState state) {
  switch (state) {
    case v1::JOB_STATE_PENDING: return "pending";
    case v1::JOB_STATE_RUNNING: return "running";
    case v1::JOB_STATE_RECONFIGURING: return "reconfiguring";
    case v1::JOB_STATE_SUCCEEDED: return "succeeded";
    case v1::JOB_STATE_FAILED: return "failed";
    case v1::JOB_STATE_CANCELLED: return "cancelled";
    case v1::JOB_STATE_SUSPENDED: return "suspended";
    default: return "unspecified";
  }
}

class RpcInterceptor : public grpc::experimental::Interceptor {
 public:
  RpcInterceptor(CoordinatorMetrics* metrics, std::string method)
      : metrics_(metrics), method_(std::move(method)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      metrics_->ObserveRpc(method_, methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  CoordinatorMetrics* const metrics_;
  const std::string method_;
};

class RpcInterceptorFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcInterceptorFactory(CoordinatorMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RpcInterceptor(metrics_, info->method() != nullptr ? info->method() : "");
  }

 private:
  CoordinatorMetrics* const metrics_;
};

}  // namespace

CoordinatorMetrics::CoordinatorMetrics(prometheus::Registry& registry, int64_t since_unix_ms)
    : since_unix_ms_(since_unix_ms),
      served_methods_(ServedMethods()),
      rpcs_(prometheus::BuildCounter()
                .Name("lockstep_coordinator_rpcs_total")
                .Help("RPCs the coordinator answered, by method and status code")
                .Register(registry)),
      recoveries_(prometheus::BuildCounter()
                      .Name("lockstep_coordinator_recoveries_total")
                      .Help("Re-formations of a job's group, by kind (failure: a member was "
                            "lost or failed; scale_up: spare workers joined; coordinator: the "
                            "coordinator's restart or absence)")
                      .Register(registry)),
      recovery_seconds_(SecondsHistogram(
          registry, "lockstep_coordinator_recovery_seconds",
          "From the detection of a failure to the first step of the new generation")),
      formation_seconds_(SecondsHistogram(
          registry, "lockstep_coordinator_generation_formation_seconds",
          "From the detection of a failure to the new generation's assignment")),
      queue_wait_seconds_(SecondsHistogram(registry, "lockstep_coordinator_queue_wait_seconds",
                                           "From a job's submission to its first generation")),
      steps_redone_(prometheus::BuildCounter()
                        .Name("lockstep_coordinator_steps_redone_total")
                        .Help("Committed steps trained again after recoveries")
                        .Register(registry)
                        .Add({})) {
  for (const char* kind : {"failure", "scale_up", "coordinator"}) {
    recoveries_.Add({{"kind", kind}});
  }
}

std::string CoordinatorMetrics::RecoveryKind(const v1::Recovery& recovery) {
  if (recovery.scale_up()) return "scale_up";
  if (recovery.coordinator_caused() || absl::StartsWith(recovery.reason(), "coordinator restarted")) {
    return "coordinator";
  }
  return "failure";
}

void CoordinatorMetrics::ObserveJob(const v1::Job& job) {
  absl::MutexLock lock(&mu_);
  const int size = job.recovery_history_size();
  auto [it, first_sight] = seen_.try_emplace(job.job_id());
  Seen& seen = it->second;
  if (first_sight) {
    // What happened before this process started (a restored job's history) is not counted.
    int before = 0;
    while (before < size && job.recovery_history(before).detect_unix_ms() < since_unix_ms_) {
      ++before;
    }
    seen.counted = seen.timed = before;
    seen.started = job.start_time_unix_ms() > 0 && job.start_time_unix_ms() < since_unix_ms_;
  }
  for (; seen.counted < size; ++seen.counted) {
    recoveries_.Add({{"kind", RecoveryKind(job.recovery_history(seen.counted))}}).Increment();
  }
  for (; seen.timed < size; ++seen.timed) {
    const v1::Recovery& r = job.recovery_history(seen.timed);
    if (r.first_step_unix_ms() > 0) {
      recovery_seconds_.Observe(Seconds(r.detect_unix_ms(), r.first_step_unix_ms()));
      if (r.reformed_unix_ms() > 0) {
        formation_seconds_.Observe(Seconds(r.detect_unix_ms(), r.reformed_unix_ms()));
      }
      steps_redone_.Increment(static_cast<double>(r.steps_redone()));
    } else if (seen.timed == size - 1) {
      break;  // still open
    }
    // else: a later re-formation replaced it before its first step
  }
  if (!seen.started && job.start_time_unix_ms() > 0) {
    seen.started = true;
    queue_wait_seconds_.Observe(Seconds(job.submit_time_unix_ms(), job.start_time_unix_ms()));
  }
  if (job.state() == v1::JOB_STATE_SUCCEEDED || job.state() == v1::JOB_STATE_FAILED ||
      job.state() == v1::JOB_STATE_CANCELLED) {
    seen_.erase(it);  // its history is final
  }
}

std::set<std::string> CoordinatorMetrics::ServedMethods() {
  std::set<std::string> methods = {
      // gRPC's own health service (no protobuf descriptor: gRPC encodes it itself) and the
      // reflection service (--grpc_reflection).
      "/grpc.health.v1.Health/Check",
      "/grpc.health.v1.Health/Watch",
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
  };
  // Every service of the coordinator's protos, from the descriptors the generated code
  // registers (reached through one message of each file, so that the file is linked in): a
  // method added to them is counted by name without a change here.
  for (const google::protobuf::FileDescriptor* file :
       {v1::JobEvent::descriptor()->file(), v1::WorkerMessage::descriptor()->file(),
        v1::StoreSetRequest::descriptor()->file()}) {
    for (int s = 0; s < file->service_count(); ++s) {
      const google::protobuf::ServiceDescriptor* service = file->service(s);
      for (int m = 0; m < service->method_count(); ++m) {
        methods.insert(absl::StrCat("/", service->full_name(), "/", service->method(m)->name()));
      }
    }
  }
  return methods;
}

void CoordinatorMetrics::ObserveRpc(const std::string& method, grpc::StatusCode code) {
  const bool served = served_methods_.count(method) > 0;
  rpcs_.Add({{"method", served ? method : "other"}, {"code", CodeName(code)}}).Increment();
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
CoordinatorMetrics::InterceptorFactory() {
  return std::make_unique<RpcInterceptorFactory>(this);
}

std::vector<prometheus::MetricFamily> CoordinatorMetrics::StateFamilies(
    const ClusterCounts& counts) {
  std::vector<std::pair<Labels, double>> jobs;
  for (v1::JobState state : {v1::JOB_STATE_PENDING, v1::JOB_STATE_RUNNING,
                             v1::JOB_STATE_RECONFIGURING, v1::JOB_STATE_SUCCEEDED,
                             v1::JOB_STATE_FAILED, v1::JOB_STATE_CANCELLED,
                             v1::JOB_STATE_SUSPENDED}) {
    auto it = counts.jobs.find(state);
    jobs.push_back({{{"state", StateName(state)}},
                    static_cast<double>(it == counts.jobs.end() ? 0 : it->second)});
  }
  std::vector<std::pair<Labels, double>> workers;
  for (const auto& [key, n] : counts.workers) {
    workers.push_back({{{"state", key.first}, {"device", key.second}}, static_cast<double>(n)});
  }
  auto pending = counts.jobs.find(v1::JOB_STATE_PENDING);
  return {
      GaugeFamily("lockstep_coordinator_jobs", "Jobs by state", jobs),
      GaugeFamily("lockstep_coordinator_workers", "Registered workers by state and device",
                  workers),
      GaugeFamily("lockstep_coordinator_queue_length", "Jobs waiting for workers",
                  {{{}, static_cast<double>(pending == counts.jobs.end() ? 0 : pending->second)}}),
      CounterFamily("lockstep_coordinator_rejected_calls_total",
                    "Calls refused by the token check",
                    {{{}, static_cast<double>(counts.rejected_calls)}}),
      GaugeFamily("lockstep_coordinator_rejected_clients",
                  "Distinct rejected clients (peer host and client name) remembered",
                  {{{}, static_cast<double>(counts.rejected_clients)}}),
  };
}

}  // namespace lockstep::coordinator
