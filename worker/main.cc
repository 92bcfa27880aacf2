// lockstep-worker: owns one device and trains the shards the coordinator assigns to it.
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "common/coordinators.h"
#include "common/metrics.h"
#include "common/path_roots.h"
#include "common/status_macros.h"
#include "common/test_hooks.h"
#include "common/tls_flags.h"
#include "glog/logging.h"
#include "worker/agent.h"
#include "worker/comm/shm_communicator.h"
#include "worker/data/dataset.h"
#include "worker/device/backend.h"
#include "worker/device/device.h"
#include "worker/metrics.h"
#include "worker/program/checkpoint_memory.h"
#include "worker/program/checkpoint_peer.h"
#include "worker/program/warm_start.h"
#include "worker/program_service.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070",
          "Coordinator address, HOST:PORT; or several, comma-separated (coordinators on etcd): "
          "the worker registers with the one that leads.");
ABSL_FLAG(std::string, device, "cpu", "Device this worker owns: cpu or cuda:N.");
ABSL_FLAG(std::string, name, "", "Worker name, unique in the cluster (default HOST-PID).");
ABSL_FLAG(std::string, host, "", "Host name reported to the coordinator (default gethostname).");
ABSL_FLAG(std::string, data_cache_dir, "/dev/shm/lockstep-cache",
          "Where decoded data sets are cached and shared by this host's workers (empty: off).");
ABSL_FLAG(std::string, data_root, lockstep::kDefaultDataRoots,
          "Comma-separated directories jobs may read data from on this host (symbolic links "
          "resolved); a job that names anything else fails naming the field. \"/\": anywhere.");
ABSL_FLAG(std::string, checkpoint_root, lockstep::kDefaultCheckpointRoots,
          "Comma-separated directories jobs may write checkpoints and outputs to (and resume "
          "from); \"/\": anywhere.");
ABSL_FLAG(bool, shared_memory_collectives, true,
          "Sum gradients through shared memory when all ranks of a group run on this host "
          "(Gloo over TCP otherwise).");
ABSL_FLAG(std::string, token_file, "",
          "File holding the coordinator's token (default: $LOCKSTEP_TOKEN_FILE, else "
          "$LOCKSTEP_TOKEN, else none). A rejected token stops the worker (exit code 3).");
ABSL_FLAG(absl::Duration, give_up_after, absl::ZeroDuration(),
          "Exit (code 4) after this long without a session with the coordinator, so that a "
          "service manager logs it and backs off; 0 retries forever.");
ABSL_FLAG(absl::Duration, keep_training_without_coordinator, absl::Seconds(60),
          "A group that has trained a step goes on training when this worker's coordinator "
          "goes (a restart, a failover, etcd down) until a coordinator keeps or stops it, at "
          "most this long; 0 stops it at once, as soon as the session ends.");
ABSL_FLAG(absl::Duration, name_conflict_timeout, absl::Seconds(15),
          "Exit (code 5) when the coordinator has refused this worker's --name this long in a "
          "row: another live worker holds it (a restarted worker's previous session is "
          "declared lost sooner, within the heartbeat timeout).");
ABSL_FLAG(std::string, status_file, "",
          "Write the worker's state here on every change (first word: connecting, registered, "
          "rejected, unreachable or stopped); for health checks.");
ABSL_FLAG(std::string, programs_root, "",
          "Run program jobs (the user's own script, JobSpec.program) whose workdir and script "
          "resolve, through symbolic links, inside these comma-separated directories; empty: "
          "this worker runs no programs. Whoever can submit jobs can then run code here.");
ABSL_FLAG(std::string, program_user, "",
          "Run programs as this user (the worker must run as root to switch; default: the "
          "worker's own user, which must not be root without --allow_programs_as_root).");
ABSL_FLAG(bool, program_warm_start, true,
          "Start a Python program's next generation in an interpreter parked ahead, with "
          "--program_preload imported (a restart then skips Python's start and `import torch`).");
ABSL_FLAG(std::string, program_preload, "torch,torch.distributed,torch.nn.parallel,lockstep.torch",
          "Modules a parked interpreter imports (comma-separated; one that fails to import is "
          "left to the script).");
ABSL_FLAG(int64_t, checkpoint_memory_bytes, int64_t{4} << 30,
          "Memory a program job's lockstep.torch.Checkpointer may use on this worker (its two "
          "newest saves, and the copies kept of checkpoint peers' saves; 0: none). A save that "
          "does not fit fails, naming the numbers.");
ABSL_FLAG(absl::Duration, checkpoint_copy_interval, absl::Milliseconds(500),
          "At most one copy of a program job's newest lockstep.torch save to its checkpoint peer "
          "per this interval (and a quarter of the time): what a lost worker's peer copy may lag "
          "behind its saves.");
ABSL_FLAG(std::string, checkpoint_memory_dir, "/dev/shm",
          "A tmpfs where programs' checkpoint slots live (in a directory of this worker's own).");
ABSL_FLAG(bool, allow_programs_as_root, false,
          "Let programs run as root (a worker running as root without --program_user, or "
          "--program_user=root).");
ABSL_FLAG(std::string, comm_address, "",
          "Address peers use for collectives (default: the local address that routes to the "
          "coordinator).");

ABSL_FLAG(std::string, metrics_listen, "",
          "Serve Prometheus metrics (GET /metrics) on HOST:PORT, e.g. 0.0.0.0:9100; empty: off. "
          "Port 0 lets the OS pick (see --metrics_port_file).");
ABSL_FLAG(std::string, metrics_port_file, "",
          "If set, the metrics port is written to this file once serving.");
ABSL_FLAG(std::string, test_hooks, "",
          "For tests only: hook points where the worker holds until a test releases it "
          "(NAME or NAME@N, comma-separated; see common/test_hooks.h).");
ABSL_FLAG(std::string, test_hooks_dir, "", "For tests only: where --test_hooks' files go.");

namespace {

volatile std::sig_atomic_t g_stop_requested = 0;
void RequestStop(int) { g_stop_requested = 1; }

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

// The local address of the interface that routes to the coordinator: a connected UDP socket
// sends nothing, but the kernel picks the source address.
std::string LocalAddressTowards(const std::string& target) {
  std::string host = target;
  if (size_t colon = target.rfind(':'); colon != std::string::npos) host = target.substr(0, colon);
  if (!host.empty() && host.front() == '[') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || res == nullptr) return "127.0.0.1";
  std::string result = "127.0.0.1";
  int fd = socket(res->ai_family, SOCK_DGRAM, 0);
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    char text[INET6_ADDRSTRLEN] = {};
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      const void* addr =
          local.ss_family == AF_INET6
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
              : &reinterpret_cast<sockaddr_in*>(&local)->sin_addr;
      if (inet_ntop(local.ss_family, addr, text, sizeof(text)) != nullptr) result = text;
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  return result;
}

// --data_root and --checkpoint_root into `options`, warning about what they leave open.
absl::Status RootsFromFlags(lockstep::worker::AgentOptions& options) {
  LOCKSTEP_RETURN_IF_ERROR(
      lockstep::ParseRootFlags(absl::GetFlag(FLAGS_data_root), absl::GetFlag(FLAGS_checkpoint_root),
                               &options.data_roots, &options.checkpoint_roots));
  if (geteuid() == 0) {
    LOG(WARNING) << "running as root: jobs read and write inside --data_root ("
                 << options.data_roots.Describe() << ") and --checkpoint_root ("
                 << options.checkpoint_roots.Describe()
                 << ") with root's rights; run workers as an unprivileged user (the lockstep "
                    "user of deploy/systemd and the images)";
  }
  if (options.data_roots.allows_any_path() || options.checkpoint_roots.allows_any_path()) {
    LOG(WARNING) << "a root of \"/\": jobs may read or write any path this worker can";
  }
  return absl::OkStatus();
}

// The Prometheus endpoint (--metrics_listen) and the runs' metrics on it; empty without one.
struct WorkerMetricsEndpoint {
  std::unique_ptr<lockstep::MetricsEndpoint> endpoint;
  std::unique_ptr<lockstep::worker::WorkerMetrics> worker;
};

absl::Status StartMetrics(const std::string& name, const std::string& device,
                          WorkerMetricsEndpoint& metrics) {
  absl::StatusOr<std::unique_ptr<lockstep::MetricsEndpoint>> started = lockstep::StartMetricsFlag(
      absl::GetFlag(FLAGS_metrics_listen), absl::GetFlag(FLAGS_metrics_port_file));
  if (!started.ok()) return started.status();
  if (*started == nullptr) return absl::OkStatus();
  metrics.endpoint = *std::move(started);
  metrics.worker =
      std::make_unique<lockstep::worker::WorkerMetrics>(metrics.endpoint->registry(), name, device);
  metrics.endpoint->Add(
      std::make_shared<lockstep::ScrapeCollector>(lockstep::worker::WorkerMetrics::MemoryFamilies));
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "lockstep-worker --coordinator=HOST:PORT[,HOST:PORT...] --device=cpu [--name=NAME]");
  absl::ParseCommandLine(argc, argv);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);

  lockstep::worker::AgentOptions options;
  options.coordinator = absl::GetFlag(FLAGS_coordinator);
  if (options.coordinator.empty()) {
    LOG(ERROR) << "--coordinator is required (HOST:PORT)";
    return 2;
  }
  absl::StatusOr<std::vector<std::string>> coordinators =
      lockstep::SplitCoordinators(options.coordinator);
  if (!coordinators.ok()) {
    LOG(ERROR) << coordinators.status().message();
    return 2;
  }
  absl::StatusOr<lockstep::worker::DeviceInfo> device =
      lockstep::worker::OpenDevice(absl::GetFlag(FLAGS_device));
  if (!device.ok()) {
    LOG(ERROR) << device.status().message();
    return 2;
  }
  if (device->cuda_index >= 0) {
    LOG(INFO) << "--device=" << device->device << ": " << device->name << ", "
              << device->free_memory_bytes / (1 << 20) << " MiB free of "
              << device->total_memory_bytes / (1 << 20) << " MiB";
  }
  absl::StatusOr<std::unique_ptr<lockstep::worker::DeviceBackend>> backend =
      lockstep::worker::MakeDeviceBackend(*device);
  if (!backend.ok()) {
    LOG(ERROR) << backend.status().message();
    return 2;
  }
  options.device = *std::move(backend);
  options.host = absl::GetFlag(FLAGS_host).empty() ? HostName() : absl::GetFlag(FLAGS_host);
  options.name = absl::GetFlag(FLAGS_name).empty() ? absl::StrCat(options.host, "-", getpid())
                                                   : absl::GetFlag(FLAGS_name);
  options.comm_address = absl::GetFlag(FLAGS_comm_address).empty()
                             ? LocalAddressTowards(coordinators->front())
                             : absl::GetFlag(FLAGS_comm_address);
  options.shared_memory_collectives = absl::GetFlag(FLAGS_shared_memory_collectives);
  if (absl::Status s = RootsFromFlags(options); !s.ok()) {
    LOG(ERROR) << s.message();
    return 2;
  }
  absl::StatusOr<lockstep::worker::ProgramSettings> programs =
      lockstep::worker::ResolveProgramSettings(absl::GetFlag(FLAGS_programs_root),
                                               absl::GetFlag(FLAGS_program_user),
                                               absl::GetFlag(FLAGS_allow_programs_as_root));
  if (!programs.ok()) {
    LOG(ERROR) << programs.status().message();
    return 2;
  }
  options.programs = *std::move(programs);
  std::unique_ptr<lockstep::worker::ProgramServer> program_server;
  std::unique_ptr<lockstep::worker::WarmStarts> warm_starts;
  std::unique_ptr<lockstep::worker::CheckpointMemory> checkpoint_memory;
  std::unique_ptr<lockstep::worker::CheckpointPeerServer> checkpoint_peers;
  if (options.programs.root.restricted()) {
    absl::StatusOr<std::unique_ptr<lockstep::worker::ProgramServer>> started =
        lockstep::worker::ProgramServer::Start();
    if (!started.ok()) {
      LOG(ERROR) << "--programs_root: " << started.status().message();
      return 2;
    }
    program_server = *std::move(started);
    options.program_server = program_server.get();
    if (const int64_t bytes = absl::GetFlag(FLAGS_checkpoint_memory_bytes); bytes > 0) {
      const lockstep::worker::ProgramCredentials& c = options.programs.credentials;
      absl::StatusOr<std::unique_ptr<lockstep::worker::CheckpointMemory>> memory =
          lockstep::worker::CheckpointMemory::Create(
              absl::GetFlag(FLAGS_checkpoint_memory_dir), options.name, bytes,
              c.switch_user ? c.uid : static_cast<uid_t>(-1),
              c.switch_user ? c.gid : static_cast<gid_t>(-1));
      if (!memory.ok()) {
        LOG(ERROR) << "--checkpoint_memory_dir: " << memory.status().message();
        return 2;
      }
      checkpoint_memory = *std::move(memory);
      options.checkpoint_memory = checkpoint_memory.get();
      // Copies of the saves to and from checkpoint peers, on the collectives' address.
      absl::StatusOr<std::unique_ptr<lockstep::worker::CheckpointPeerServer>> peers =
          lockstep::worker::CheckpointPeerServer::Start(options.comm_address,
                                                        checkpoint_memory.get());
      if (!peers.ok()) {
        LOG(ERROR) << "--comm_address: " << peers.status().message();
        return 2;
      }
      checkpoint_peers = *std::move(peers);
      options.checkpoint_peers = checkpoint_peers.get();
      options.checkpoint_copy_interval = absl::GetFlag(FLAGS_checkpoint_copy_interval);
    } else if (bytes < 0) {
      LOG(ERROR) << "--checkpoint_memory_bytes: must be >= 0, got " << bytes;
      return 2;
    }
    if (absl::GetFlag(FLAGS_program_warm_start)) {
      warm_starts = std::make_unique<lockstep::worker::WarmStarts>(
          absl::StrSplit(absl::GetFlag(FLAGS_program_preload), ',', absl::SkipWhitespace()));
      options.warm_starts = warm_starts.get();
    }
    LOG(INFO) << "runs programs from " << options.programs.root.Describe() << " as "
              << (options.programs.user.empty() ? "this worker's user" : options.programs.user);
  }
  absl::StatusOr<std::string> token = lockstep::ResolveToken(absl::GetFlag(FLAGS_token_file));
  if (!token.ok()) {
    LOG(ERROR) << token.status().message();
    return 2;
  }
  options.token = *std::move(token);
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      lockstep::MakeChannelCredentials(lockstep::ClientTlsFilesFromFlags());
  if (!credentials.ok()) {
    LOG(ERROR) << credentials.status().message();
    return 2;
  }
  options.credentials = *std::move(credentials);
  options.tls_server_name = lockstep::ClientTlsFilesFromFlags().server_name;
  options.give_up_after = absl::GetFlag(FLAGS_give_up_after);
  if (options.give_up_after < absl::ZeroDuration()) {
    LOG(ERROR) << "--give_up_after must be >= 0";
    return 2;
  }
  options.keep_training_for = absl::GetFlag(FLAGS_keep_training_without_coordinator);
  if (options.keep_training_for < absl::ZeroDuration()) {
    LOG(ERROR) << "--keep_training_without_coordinator must be >= 0";
    return 2;
  }
  options.name_conflict_timeout = absl::GetFlag(FLAGS_name_conflict_timeout);
  options.status_file = absl::GetFlag(FLAGS_status_file);
  if (absl::Status s = lockstep::test_hooks::Arm(absl::GetFlag(FLAGS_test_hooks),
                                                 absl::GetFlag(FLAGS_test_hooks_dir));
      !s.ok()) {
    LOG(ERROR) << s.message();
    return 2;
  }
  // Segment names left in /dev/shm by workers killed while setting one up.
  lockstep::worker::ShmCommunicator::SweepStaleSegments();
  lockstep::worker::SetDatasetCacheDir(absl::GetFlag(FLAGS_data_cache_dir));
  LOG(INFO) << "lockstep-worker " << options.name << " on " << options.host << " device "
            << device->device << ", collectives on " << options.comm_address;

  WorkerMetricsEndpoint metrics;
  if (absl::Status s = StartMetrics(options.name, device->device, metrics); !s.ok()) {
    LOG(ERROR) << s.message();
    return 2;
  }
  options.metrics = metrics.worker.get();

  std::signal(SIGPIPE, SIG_IGN);
  std::signal(SIGINT, RequestStop);
  std::signal(SIGTERM, RequestStop);
  lockstep::worker::Agent agent(options);
  std::thread watcher([&] {
    while (!g_stop_requested) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    agent.Stop();
  });
  const absl::Status ended = agent.Run();
  g_stop_requested = 1;
  watcher.join();
  if (absl::IsUnauthenticated(ended) || absl::IsPermissionDenied(ended)) {
    LOG(ERROR) << ended.message();
    return 3;
  }
  if (absl::IsInvalidArgument(ended)) {
    LOG(ERROR) << ended.message();
    return 2;
  }
  if (absl::IsAlreadyExists(ended)) {
    LOG(ERROR) << ended.message();
    return 5;
  }
  if (!ended.ok()) {
    LOG(ERROR) << ended.message();
    return 4;
  }
  LOG(INFO) << "stopped";
  return 0;
}
