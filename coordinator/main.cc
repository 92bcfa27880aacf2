// lockstep-coordinator: job queue, worker registry, rendezvous and recovery for one cluster.
#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "common/auth.h"
#include "common/grpc_options.h"
#include "common/metrics.h"
#include "common/path_roots.h"
#include "common/status_macros.h"
#include "common/test_hooks.h"
#include "common/tls.h"
#include "coordinator/dashboard/dashboard.h"
#include "coordinator/service/services.h"
#include "coordinator/service/standby_server.h"
#include "coordinator/store/etcd_client.h"
#include "coordinator/store/etcd_job_store.h"
#include "coordinator/store/leadership.h"
#include "glog/logging.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/server_interceptor.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7070",
          "Address to serve on; port 0 lets the OS pick (see --port_file).");
ABSL_FLAG(std::string, state_dir, "",
          "Directory for durable coordinator state (created if missing).");
ABSL_FLAG(std::string, state_backend, "file",
          "Where jobs and the cluster id are kept: \"file\" (--state_dir, one coordinator) or "
          "\"etcd\" (--etcd_endpoints: coordinators on several hosts, one leads and the others "
          "stand by).");
ABSL_FLAG(std::string, etcd_endpoints, "",
          "With --state_backend=etcd: the etcd members, comma-separated http://HOST:PORT, or "
          "https://HOST:PORT with --etcd_tls_ca.");
ABSL_FLAG(std::string, etcd_tls_ca, "",
          "With https:// etcd endpoints: the CA certificate (PEM) that signed etcd's.");
ABSL_FLAG(std::string, etcd_tls_cert, "",
          "With https:// etcd endpoints: this coordinator's client certificate (PEM), for an etcd "
          "that requires one (--client-cert-auth); with --etcd_tls_key.");
ABSL_FLAG(std::string, etcd_tls_key, "", "The private key (PEM) of --etcd_tls_cert.");
ABSL_FLAG(std::string, etcd_prefix, "/lockstep/",
          "With --state_backend=etcd: the prefix of every key this cluster keeps in etcd.");
ABSL_FLAG(int64_t, leader_lease_seconds, 2,
          "With --state_backend=etcd: the leader's lease; a standby takes over within about this "
          "long of the leader's death.");
ABSL_FLAG(std::string, advertise_address, "",
          "With --state_backend=etcd: the address standbys name when this coordinator leads "
          "(default: --listen with its port, the host's name for 0.0.0.0 or [::]).");
ABSL_FLAG(std::string, port_file, "",
          "If set, the selected port is written to this file once serving.");
ABSL_FLAG(std::string, token_file, "",
          "File holding the shared token every client must send (default: $LOCKSTEP_TOKEN_FILE, "
          "else $LOCKSTEP_TOKEN, else none: every client that can connect is trusted).");
ABSL_FLAG(std::string, worker_token_file, "",
          "File holding the workers' own token (default: $LOCKSTEP_WORKER_TOKEN_FILE, else "
          "$LOCKSTEP_WORKER_TOKEN, else none). With it, workers must use this token and "
          "operators (lockstepctl, the Python client, the dashboard) the --token_file one: a "
          "worker cannot submit or cancel jobs, an operator cannot join as a worker.");
ABSL_FLAG(std::string, tls_cert, "",
          "TLS: the coordinator's certificate chain (PEM; default $LOCKSTEP_TLS_CERT). Without "
          "it the API is plaintext.");
ABSL_FLAG(std::string, tls_key, "",
          "TLS: the private key of --tls_cert (default $LOCKSTEP_TLS_KEY).");
ABSL_FLAG(std::string, tls_ca, "",
          "Mutual TLS: require every client (workers, lockstepctl) to present a certificate "
          "signed by this CA (PEM; default $LOCKSTEP_TLS_CA).");
ABSL_FLAG(std::string, metrics_listen, "",
          "Serve Prometheus metrics (GET /metrics) on HOST:PORT, e.g. 0.0.0.0:9090; empty: off. "
          "Port 0 lets the OS pick (see --metrics_port_file).");
ABSL_FLAG(std::string, metrics_port_file, "",
          "If set, the metrics port is written to this file once serving.");
ABSL_FLAG(std::string, http_listen, "",
          "Serve the web dashboard on HOST:PORT, e.g. 127.0.0.1:8080; empty: off. HTTPS with "
          "--tls_cert and --tls_key when they are set. Port 0 lets the OS pick (see "
          "--http_port_file).");
ABSL_FLAG(std::string, http_port_file, "",
          "If set, the dashboard's port is written to this file once serving.");
ABSL_FLAG(std::string, data_root, lockstep::kDefaultDataRoots,
          "Comma-separated directories jobs may read data from (dataset.path, "
          "dataset.validation_path, init_from_checkpoint.path); a spec outside them is refused "
          "naming the field. \"/\": anywhere (a warning at start). The workers check the same "
          "with their own --data_root.");
ABSL_FLAG(std::string, checkpoint_root, lockstep::kDefaultCheckpointRoots,
          "Comma-separated directories jobs may write checkpoints and outputs to "
          "(checkpoint_dir, output_dir) and resume from; \"/\": anywhere.");
ABSL_FLAG(bool, grpc_reflection, false,
          "Serve gRPC server reflection (the API's schema, for grpcurl and the like), to "
          "callers with the operators' token.");
ABSL_FLAG(int64_t, heartbeat_timeout_ms, 5000,
          "Silence after which a worker is declared lost (jobs may set their own).");
ABSL_FLAG(int64_t, priority_aging_ms, 300000,
          "A queued job's priority grows by one for each this long it has waited (up to 1000), "
          "so that higher-priority jobs cannot starve it (0: never). Only the queue's order "
          "ages; preemption goes by the priorities jobs declared.");
ABSL_FLAG(int64_t, restart_grace_ms, 5000,
          "After a restart, how long a running job waits for the members of its last generation "
          "to register again before it re-forms without them (it re-forms at once when they are "
          "all back).");
ABSL_FLAG(std::string, test_hooks, "",
          "For tests only: hook points where the coordinator holds until a test releases it "
          "(NAME or NAME@N, comma-separated; see common/test_hooks.h).");
ABSL_FLAG(std::string, test_hooks_dir, "", "For tests only: where --test_hooks' files go.");

namespace {

// How often the core's timers run (heartbeat silence, step stalls, rendezvous); the core also
// uses it to notice that the coordinator itself was away.
constexpr absl::Duration kTickInterval = absl::Milliseconds(100);

// Set by SIGINT/SIGTERM; the main loop polls it (nothing else is async-signal-safe).
volatile std::sig_atomic_t g_stop_requested = 0;
void RequestStop(int) { g_stop_requested = 1; }

// Every worker holds a connection, and a service starts with a soft limit of 1,024 open files
// (systemd's default), which would cap a cluster at about a thousand workers: the soft limit
// is raised to the hard one. Returns the limit in force.
rlim_t RaiseOpenFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    // Linux refuses more than fs.nr_open (1,048,576 by default), infinity included.
    raised.rlim_cur = std::min<rlim_t>(limit.rlim_max, 1 << 20);
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  return limit.rlim_cur;
}

// gRPC's reflection library adds its plugin to every ServerBuilder as soon as it is loaded (a
// static initializer), so the library being linked served reflection, to anyone, whatever
// --grpc_reflection said. Off, this option takes the plugin out of the builder again.
class ReflectionOption final : public grpc::ServerBuilderOption {
 public:
  explicit ReflectionOption(bool enabled) : enabled_(enabled) {}
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    if (enabled_) return;
    plugins->erase(
        std::remove_if(plugins->begin(), plugins->end(),
                       [](const std::unique_ptr<grpc::ServerBuilderPlugin>& plugin) {
                         return dynamic_cast<grpc::reflection::ProtoServerReflectionPlugin*>(
                                    plugin.get()) != nullptr;
                       }),
        plugins->end());
  }

 private:
  const bool enabled_;
};

// Reflection is gRPC's service, not ours, so no handler of ours admits its callers: this
// interceptor does, with the operators' token, and ends any other call UNAUTHENTICATED as soon
// as its metadata arrives, before the service reads a request.
constexpr char kReflectionMethod[] =
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";

class ReflectionGate final : public grpc::experimental::Interceptor {
 public:
  ReflectionGate(lockstep::coordinator::ClientGate* gate, grpc::experimental::ServerRpcInfo* info)
      : gate_(gate), info_(info) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      refused_ = gate_->Admit(*info_->server_context(), lockstep::coordinator::Role::kOperator);
      if (!refused_.ok()) {
        // The C core's cancel is the one that carries a status to the client.
        grpc_call_cancel_with_status(info_->server_context()->c_call(),
                                     static_cast<grpc_status_code>(refused_.error_code()),
                                     refused_.error_message().c_str(), nullptr);
      }
    }
    if (!refused_.ok() &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      methods->ModifySendStatus(refused_);  // what the interceptors after this one count
    }
    methods->Proceed();
  }

 private:
  lockstep::coordinator::ClientGate* const gate_;
  grpc::experimental::ServerRpcInfo* const info_;
  grpc::Status refused_;
};

class ReflectionGateFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit ReflectionGateFactory(lockstep::coordinator::ClientGate* gate) : gate_(gate) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    if (info->method() == nullptr || std::string(info->method()) != kReflectionMethod) {
      return nullptr;
    }
    return new ReflectionGate(gate_, info);
  }

 private:
  lockstep::coordinator::ClientGate* const gate_;
};

// Process-wide settings before anything else runs.
void PrepareProcess() {
  // Debian's abseil is built with its debug checks, which record the order in which mutexes are
  // taken in one global graph behind one spin lock. The coordinator holds a mutex per worker
  // session (10,000 at scale), and keeping that graph was 3-5% of its CPU at 10,000 workers.
  // The lock order is stated in each class's comment instead.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // A peer that closes its connection mid-write (HTTP, TLS) must not kill the process.
  std::signal(SIGPIPE, SIG_IGN);
  // Large blocks (gRPC's buffers for big messages, store values) come from their own mappings
  // and go back to the system when freed. By default glibc raises this threshold after freeing
  // a large block, after which they come from the heap and stay resident: a client's burst of
  // 1 MiB messages left the coordinator hundreds of MiB larger for good.
  mallopt(M_MMAP_THRESHOLD, 256 << 10);
  if (const rlim_t files = RaiseOpenFileLimit(); files < 4096) {
    LOG(WARNING) << "at most " << files
                 << " open files (ulimit -n): each worker holds one, so this coordinator serves "
                    "fewer than that many workers; raise the hard limit (LimitNOFILE= in its "
                    "systemd unit)";
  }
}

// The operators' token and the workers' own (empty: none).
struct Tokens {
  std::string operators;
  std::string workers;
};

absl::StatusOr<Tokens> ReadTokens() {
  absl::StatusOr<std::string> token = lockstep::ResolveToken(absl::GetFlag(FLAGS_token_file));
  if (!token.ok()) return token.status();
  if (token->empty()) {
    LOG(WARNING) << "no token configured: any client that can reach " << absl::GetFlag(FLAGS_listen)
                 << " may submit jobs and join as a worker";
  }
  absl::StatusOr<std::string> worker_token =
      lockstep::ResolveToken(absl::GetFlag(FLAGS_worker_token_file), "LOCKSTEP_WORKER_TOKEN");
  if (!worker_token.ok()) {
    return absl::Status(worker_token.status().code(),
                        absl::StrCat("--worker_token_file: ", worker_token.status().message()));
  }
  if (!worker_token->empty() && (token->empty() || *worker_token == *token)) {
    return absl::InvalidArgumentError(
        "--worker_token_file: the workers' token must differ from the operators' "
        "(--token_file), and needs one");
  }
  if (!worker_token->empty()) {
    LOG(INFO) << "roles: workers and operators have tokens of their own";
  }
  return Tokens{*std::move(token), *std::move(worker_token)};
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ApiCredentials(
    const lockstep::TlsFiles& tls) {
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      lockstep::MakeServerCredentials(tls);
  if (!credentials.ok()) return credentials.status();
  if (tls.any()) {
    LOG(INFO) << "TLS on the API" << (tls.ca.empty() ? "" : ", client certificates required");
  } else if (!lockstep::IsLoopbackAddress(absl::GetFlag(FLAGS_listen))) {
    LOG(WARNING) << "serving " << absl::GetFlag(FLAGS_listen)
                 << " beyond loopback without TLS: tokens and jobs cross the network in the "
                    "clear (--tls_cert, --tls_key, --tls_ca)";
  }
  return credentials;
}

// The core's options from the flags; `cluster_id` suffixes every job id.
absl::StatusOr<lockstep::coordinator::CoreOptions> CoreOptionsFromFlags(
    const std::string& cluster_id) {
  if (absl::GetFlag(FLAGS_heartbeat_timeout_ms) <= 0) {
    return absl::InvalidArgumentError("--heartbeat_timeout_ms must be > 0");
  }
  if (absl::GetFlag(FLAGS_priority_aging_ms) < 0) {
    return absl::InvalidArgumentError("--priority_aging_ms must be >= 0 (0: no aging)");
  }
  if (absl::GetFlag(FLAGS_restart_grace_ms) < 0) {
    return absl::InvalidArgumentError("--restart_grace_ms must be >= 0");
  }
  lockstep::coordinator::CoreOptions options;
  options.heartbeat_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms));
  options.tick_interval = kTickInterval;
  options.restart_grace = absl::Milliseconds(absl::GetFlag(FLAGS_restart_grace_ms));
  options.priority_aging = absl::Milliseconds(absl::GetFlag(FLAGS_priority_aging_ms));
  LOCKSTEP_RETURN_IF_ERROR(
      lockstep::ParseRootFlags(absl::GetFlag(FLAGS_data_root), absl::GetFlag(FLAGS_checkpoint_root),
                               &options.data_roots, &options.checkpoint_roots));
  if (options.data_roots.allows_any_path() || options.checkpoint_roots.allows_any_path()) {
    LOG(WARNING) << "a --data_root or --checkpoint_root of \"/\": jobs may name any path the "
                    "workers can read or write";
  }
  LOG(INFO) << "jobs read data in " << options.data_roots.Describe()
            << " and write checkpoints and outputs in " << options.checkpoint_roots.Describe();
  options.job_id_suffix = cluster_id;
  return options;
}

// --state_backend=etcd: the client, and the leadership once this coordinator has won it.
struct Etcd {
  std::unique_ptr<lockstep::coordinator::EtcdClient> client;
  std::string prefix;
  std::unique_ptr<lockstep::coordinator::Leadership> leadership;
};

// The state backend's flags checked, etcd connected, and the cluster's id.
absl::StatusOr<std::string> OpenStateBackend(const std::string& state_dir, Etcd& etcd) {
  const std::string backend = absl::GetFlag(FLAGS_state_backend);
  lockstep::TlsFiles etcd_tls;
  etcd_tls.flags = "--etcd_tls";
  etcd_tls.ca = absl::GetFlag(FLAGS_etcd_tls_ca);
  etcd_tls.cert = absl::GetFlag(FLAGS_etcd_tls_cert);
  etcd_tls.key = absl::GetFlag(FLAGS_etcd_tls_key);
  if (backend == "file") {
    if (!absl::GetFlag(FLAGS_etcd_endpoints).empty()) {
      return absl::InvalidArgumentError("--etcd_endpoints needs --state_backend=etcd");
    }
    if (etcd_tls.any()) return absl::InvalidArgumentError("--etcd_tls_* need --state_backend=etcd");
    if (!state_dir.empty()) {  // after the flags are known good: bad flags leave no directory
      std::error_code ec;
      std::filesystem::create_directories(state_dir, ec);
      if (ec) {
        return absl::FailedPreconditionError(
            absl::StrCat("cannot create --state_dir ", state_dir, ": ", ec.message()));
      }
    }
    absl::StatusOr<std::string> cluster_id = lockstep::coordinator::ClusterId(state_dir);
    if (!cluster_id.ok()) {
      return absl::Status(cluster_id.status().code(),
                          absl::StrCat("--state_dir: ", cluster_id.status().message()));
    }
    return cluster_id;
  }
  if (backend != "etcd") {
    return absl::InvalidArgumentError(
        absl::StrCat("--state_backend=", backend, ": not \"file\" or \"etcd\""));
  }
  if (!state_dir.empty()) {
    return absl::InvalidArgumentError(
        "--state_dir is the file backend's: with --state_backend=etcd the state is in etcd");
  }
  if (absl::GetFlag(FLAGS_leader_lease_seconds) < 1) {
    return absl::InvalidArgumentError("--leader_lease_seconds must be >= 1");
  }
  etcd.prefix = absl::GetFlag(FLAGS_etcd_prefix);
  if (etcd.prefix.empty() || etcd.prefix[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("--etcd_prefix '", etcd.prefix, "' must start with /"));
  }
  if (etcd.prefix.back() != '/') etcd.prefix += '/';
  // The TLS files' own errors name their flags (Connect checks them again).
  if (absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
          lockstep::MakeChannelCredentials(etcd_tls);
      !credentials.ok()) {
    return credentials.status();
  }
  absl::StatusOr<std::unique_ptr<lockstep::coordinator::EtcdClient>> client =
      lockstep::coordinator::EtcdClient::Connect(absl::GetFlag(FLAGS_etcd_endpoints), etcd.prefix,
                                                 absl::Seconds(5), etcd_tls);
  if (!client.ok()) {
    return absl::Status(client.status().code(),
                        absl::StrCat("--etcd_endpoints: ", client.status().message()));
  }
  etcd.client = *std::move(client);
  absl::StatusOr<std::string> cluster_id =
      lockstep::coordinator::EtcdClusterId(etcd.client.get(), etcd.prefix);
  if (!cluster_id.ok()) {
    return absl::Status(cluster_id.status().code(),
                        absl::StrCat("--etcd_prefix: ", cluster_id.status().message()));
  }
  return cluster_id;
}

// What standbys tell callers when this coordinator leads.
std::string AdvertisedAddress(int port) {
  if (std::string flag = absl::GetFlag(FLAGS_advertise_address); !flag.empty()) return flag;
  std::string host = absl::GetFlag(FLAGS_listen);
  host = host.substr(0, host.rfind(':'));
  if (host == "0.0.0.0" || host == "[::]" || host.empty()) {
    char name[256] = {};
    if (gethostname(name, sizeof(name) - 1) == 0) host = name;
    LOG(WARNING) << "standbys will name this coordinator " << host << ":" << port
                 << " when it leads; set --advertise_address if workers and clients reach it "
                    "by another name";
  }
  return absl::StrCat(host, ":", port);
}

// Stands by, answering every call with the leader's address, until this coordinator leads
// (then the standby's port is free for the real server) or is asked to stop (null).
absl::StatusOr<std::unique_ptr<lockstep::coordinator::Leadership>> StandBy(
    Etcd& etcd, const std::shared_ptr<grpc::ServerCredentials>& credentials, int* port) {
  absl::StatusOr<std::unique_ptr<lockstep::coordinator::StandbyServer>> standby =
      lockstep::coordinator::StandbyServer::Start(absl::GetFlag(FLAGS_listen), credentials, port);
  if (!standby.ok()) return standby.status();
  if (const std::string file = absl::GetFlag(FLAGS_port_file); !file.empty()) {
    if (absl::Status s = lockstep::WriteFileAtomically(file, absl::StrCat(*port, "\n"),
                                                       lockstep::Durability::kVisible);
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("--port_file: ", s.message()));
    }
  }
  lockstep::coordinator::LeadershipOptions options;
  options.prefix = etcd.prefix;
  options.address = AdvertisedAddress(*port);
  options.ttl = absl::Seconds(absl::GetFlag(FLAGS_leader_lease_seconds));
  LOG(INFO) << "standing by on port " << *port << " for the leadership of " << etcd.prefix
            << " in etcd (" << etcd.client->endpoints() << ")";
  auto on_standby = [&standby](const std::string& leader, const std::string& why) {
    (*standby)->SetLeader(leader, why);
    if (!leader.empty()) {
      LOG(INFO) << "standing by: the leader is " << leader;
    } else {
      LOG(WARNING) << "standing by, no leader known: " << why;
    }
  };
  // A deposed leader stops at once: it may hold sessions and decisions that are no longer its
  // own. Its supervisor (systemd, compose) starts it again, as a standby.
  auto on_lost = [](const std::string& reason) {
    // Tests hold a deposed leader here, still serving, to see that workers pass it over.
    lockstep::test_hooks::Reach("step_down");
    LOG(ERROR) << "stepping down: " << reason << "; exiting (status 3)";
    std::_Exit(3);
  };
  absl::StatusOr<std::unique_ptr<lockstep::coordinator::Leadership>> won =
      lockstep::coordinator::Leadership::Campaign(etcd.client.get(), options, on_standby, on_lost,
                                                  [] { return g_stop_requested != 0; });
  (*standby)->Stop();
  if (!won.ok()) {
    if (absl::IsCancelled(won.status())) return nullptr;
    return won.status();
  }
  LOG(INFO) << "leading as " << options.address << " (term " << (*won)->term() << ")";
  return won;
}

// Jobs survive a restart when there is a state directory or etcd.
absl::StatusOr<std::unique_ptr<lockstep::coordinator::JobStore>> OpenJobStore(
    const std::string& state_dir, Etcd& etcd) {
  if (etcd.leadership != nullptr) {
    return std::make_unique<lockstep::coordinator::EtcdJobStore>(etcd.client.get(), etcd.prefix,
                                                                 etcd.leadership.get());
  }
  if (state_dir.empty()) {
    LOG(WARNING) << "no --state_dir: jobs are kept in memory only and lost on restart";
    return std::make_unique<lockstep::coordinator::InMemoryJobStore>();
  }
  auto opened = lockstep::coordinator::FileJobStore::Open(state_dir);
  if (!opened.ok()) {
    return absl::Status(opened.status().code(),
                        absl::StrCat("--state_dir: ", opened.status().message()));
  }
  return std::unique_ptr<lockstep::coordinator::JobStore>(*std::move(opened));
}

// The Prometheus endpoint (--metrics_listen), or null without one.
struct Metrics {
  std::unique_ptr<lockstep::MetricsEndpoint> endpoint;
  std::unique_ptr<lockstep::coordinator::CoordinatorMetrics> coordinator;
};

absl::Status StartMetrics(lockstep::coordinator::Coordinator& coordinator, Metrics& metrics) {
  absl::StatusOr<std::unique_ptr<lockstep::MetricsEndpoint>> started = lockstep::StartMetricsFlag(
      absl::GetFlag(FLAGS_metrics_listen), absl::GetFlag(FLAGS_metrics_port_file));
  if (!started.ok()) return started.status();
  if (*started == nullptr) return absl::OkStatus();
  metrics.endpoint = *std::move(started);
  metrics.coordinator = std::make_unique<lockstep::coordinator::CoordinatorMetrics>(
      metrics.endpoint->registry(), absl::ToUnixMillis(absl::Now()));
  coordinator.set_metrics(metrics.coordinator.get());
  metrics.endpoint->Add(std::make_shared<lockstep::ScrapeCollector>([&coordinator] {
    return lockstep::coordinator::CoordinatorMetrics::StateFamilies(coordinator.Counts());
  }));
  return absl::OkStatus();
}

// The dashboard (--http_listen), or null without one.
absl::StatusOr<std::unique_ptr<lockstep::coordinator::Dashboard>> StartDashboard(
    lockstep::coordinator::Coordinator& coordinator, const lockstep::TlsFiles& tls,
    bool has_token) {
  const std::string address = absl::GetFlag(FLAGS_http_listen);
  if (address.empty()) return nullptr;
  absl::StatusOr<std::unique_ptr<lockstep::coordinator::Dashboard>> started =
      lockstep::coordinator::Dashboard::Start(address, absl::GetFlag(FLAGS_http_port_file),
                                              &coordinator, tls);
  if (!started.ok()) {
    return absl::Status(started.status().code(),
                        absl::StrCat("--http_listen: ", started.status().message()));
  }
  LOG(INFO) << "dashboard on port " << (*started)->port()
            << (tls.cert.empty() ? " (HTTP)" : " (HTTPS)")
            << (has_token ? "; it asks for the token" : "");
  if (tls.cert.empty() && !lockstep::IsLoopbackAddress(address)) {
    LOG(WARNING) << "dashboard on " << address
                 << " beyond loopback without TLS: its token crosses the network in the clear";
  }
  return started;
}

// The gRPC server of the three services, listening; its port in *port.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(
    lockstep::coordinator::Coordinator& coordinator,
    const std::shared_ptr<grpc::ServerCredentials>& credentials,
    lockstep::coordinator::JobServiceImpl& jobs, lockstep::coordinator::WorkerServiceImpl& workers,
    lockstep::coordinator::StoreServiceImpl& store,
    lockstep::coordinator::CoordinatorMetrics* metrics, const std::string& listen, int* port) {
  grpc::EnableDefaultHealthCheckService(true);
  const bool reflection = absl::GetFlag(FLAGS_grpc_reflection);
  if (reflection) {
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    LOG(INFO) << "gRPC server reflection on, for callers with the operators' token";
  }
  grpc::ServerBuilder builder;
  lockstep::ConfigureServer(builder);
  builder.SetOption(std::make_unique<ReflectionOption>(reflection));
  builder.AddListeningPort(listen, credentials, port);
  builder.RegisterService(&jobs);
  builder.RegisterService(workers.service());
  workers.AddQueues(builder);
  builder.RegisterService(&store);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(lockstep::MalformedRequestInterceptorFactory());
  if (reflection) creators.push_back(std::make_unique<ReflectionGateFactory>(&coordinator.gate()));
  if (metrics != nullptr) creators.push_back(metrics->InterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(creators));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", listen, " (address in use or invalid?)"));
  }
  LOG(INFO) << "lockstep-coordinator serving on port " << *port;
  if (const std::string file = absl::GetFlag(FLAGS_port_file); !file.empty()) {
    if (absl::Status s = lockstep::WriteFileAtomically(file, absl::StrCat(*port, "\n"),
                                                       lockstep::Durability::kVisible);
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("--port_file: ", s.message()));
    }
  }
  return server;
}

}  // namespace

// Every error before serving is logged as it is and exits with 1.
int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "lockstep-coordinator --listen=HOST:PORT [--state_dir=DIR | --state_backend=etcd "
      "--etcd_endpoints=URL,...] [--port_file=FILE]");
  absl::ParseCommandLine(argc, argv);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  PrepareProcess();
  Etcd etcd;
  auto fail = [&etcd](const absl::Status& s) {
    LOG(ERROR) << s.message();
    // A leader that cannot serve hands the leadership on at once, not after its lease.
    if (etcd.leadership != nullptr) etcd.leadership->Resign();
    return 1;
  };
  const std::string state_dir = absl::GetFlag(FLAGS_state_dir);
  absl::StatusOr<std::string> cluster_id = OpenStateBackend(state_dir, etcd);
  if (!cluster_id.ok()) return fail(cluster_id.status());
  absl::StatusOr<lockstep::coordinator::CoreOptions> options = CoreOptionsFromFlags(*cluster_id);
  if (!options.ok()) return fail(options.status());
  if (absl::Status s = lockstep::test_hooks::Arm(absl::GetFlag(FLAGS_test_hooks),
                                                 absl::GetFlag(FLAGS_test_hooks_dir));
      !s.ok()) {
    return fail(s);
  }
  absl::StatusOr<Tokens> tokens = ReadTokens();
  if (!tokens.ok()) return fail(tokens.status());
  const lockstep::TlsFiles tls = lockstep::ServerTlsFiles(
      absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_ca));
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = ApiCredentials(tls);
  if (!credentials.ok()) return fail(credentials.status());
  std::signal(SIGINT, RequestStop);
  std::signal(SIGTERM, RequestStop);
  std::string listen = absl::GetFlag(FLAGS_listen);
  int port = 0;
  if (etcd.client != nullptr) {
    absl::StatusOr<std::unique_ptr<lockstep::coordinator::Leadership>> won =
        StandBy(etcd, *credentials, &port);
    if (!won.ok()) return fail(won.status());
    if (*won == nullptr) return 0;  // stopped while standing by
    etcd.leadership = *std::move(won);
    listen = absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);  // the standby's port
  }
  const std::string state_name =
      etcd.client != nullptr ? absl::StrCat("etcd ", etcd.prefix) : state_dir;
  absl::StatusOr<std::unique_ptr<lockstep::coordinator::JobStore>> job_store =
      OpenJobStore(state_dir, etcd);
  if (!job_store.ok()) return fail(job_store.status());
  lockstep::coordinator::Coordinator coordinator(
      *options, lockstep::RealClock::Get(), job_store->get(), tokens->operators, tokens->workers);
  if (etcd.leadership != nullptr) coordinator.set_term(etcd.leadership->term());
  // Metrics before the jobs are restored: a restart's re-formations are counted.
  Metrics metrics;
  if (absl::Status s = StartMetrics(coordinator, metrics); !s.ok()) return fail(s);
  absl::StatusOr<int> restored = coordinator.Restore();
  if (!restored.ok()) {
    return fail(absl::Status(
        restored.status().code(),
        absl::StrCat("cannot load the jobs in ", state_name, ": ", restored.status().ToString())));
  }
  if (*restored > 0) {
    LOG(INFO) << "restored " << *restored << " unfinished job(s) from " << state_name
              << "; they resume as workers register";
  }
  absl::StatusOr<std::unique_ptr<lockstep::coordinator::Dashboard>> dashboard =
      StartDashboard(coordinator, tls, !tokens->operators.empty());
  if (!dashboard.ok()) return fail(dashboard.status());
  lockstep::coordinator::JobServiceImpl jobs(&coordinator);
  lockstep::coordinator::WorkerServiceImpl workers(&coordinator);
  lockstep::coordinator::StoreServiceImpl store(&coordinator);
  absl::StatusOr<std::unique_ptr<grpc::Server>> server = StartServer(
      coordinator, *credentials, jobs, workers, store, metrics.coordinator.get(), listen, &port);
  if (!server.ok()) return fail(server.status());

  // Sessions start only now: every return above leaves before any exists.
  workers.Start();
  while (!g_stop_requested) {
    coordinator.Tick();
    coordinator.WaitForTick(kTickInterval);
  }
  LOG(INFO) << "shutting down";
  dashboard->reset();
  coordinator.Shutdown();
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  workers.Stop(absl::Seconds(2));
  // Last: a standby takes over at once, and nothing of this one's is left to write.
  if (etcd.leadership != nullptr) etcd.leadership->Resign();
  return 0;
}
