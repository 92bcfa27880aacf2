// The commands of lockstepctl. Each takes the JobService stub and the output stream, so a test can
// drive it with a fake stub (JobService::StubInterface) and a std::ostringstream.
#pragma once

#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cli/format.h"
#include "cli/invocation.h"
#include "common/auth.h"
#include "common/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "lockstep/v1/job.grpc.pb.h"

namespace lockstep::cli {

// How the commands talk and print. The defaults are the real process's.
struct CommandOptions {
  OutputFormat output = OutputFormat::kTable;
  // The channel speaks TLS (--tls_ca): an unreachable coordinator's message then says what to
  // check, and a plaintext client's says that the coordinator may require TLS.
  bool tls = false;
  // The channel presents a client certificate (--tls_cert/--tls_key), for the hint above.
  bool tls_client_cert = false;
  // Deadline of each unary RPC. The watch stream has none: it lasts as long as the job.
  absl::Duration rpc_timeout = absl::Seconds(10);
  // watch: rewrite a single progress line with '\r' (stdout is a terminal). Otherwise progress
  // is printed at most once per second, plus the last one.
  bool live_progress = false;
  // watch: how often a stream broken with UNAVAILABLE is reopened before giving up, and the
  // backoff between attempts (doubling from the initial value up to the maximum). The count
  // starts over whenever an attempt delivers an event.
  int max_watch_retries = 5;
  absl::Duration initial_backoff = absl::Milliseconds(500);
  absl::Duration max_backoff = absl::Seconds(8);
  // Time source (throttling, ages) and the wait between watch attempts; injected for tests.
  Clock* clock = RealClock::Get();
  std::function<void(absl::Duration)> sleep = [](absl::Duration d) { absl::SleepFor(d); };
  absl::TimeZone time_zone = absl::LocalTimeZone();
};

// The most pages `list` follows (10^8 jobs in the full pages of 1000 it asks for): a bound on a
// server that pages in circles with ever new tokens.
inline constexpr int kMaxListPages = 100'000;

// Each command below returns the RPC's status (or INTERNAL if the reply cannot be printed) and
// prints nothing when it fails; the caller prints the error line.

// Submits `spec`. Table: prints the new job id. JSON: prints the Job (one line when `one_line`,
// for a JSON Lines stream that a watch continues). `*job` receives the reply when not null.
absl::Status SubmitJob(v1::JobService::StubInterface& stub, const v1::JobSpec& spec,
                       const CommandOptions& options, std::ostream& out, bool one_line = false,
                       v1::Job* job = nullptr);

// Table: the job list (JOB NAME STATE STEP LOSS WORKERS AGE/DURATION). JSON: ListJobsResponse.
// Follows every page; INTERNAL when the coordinator repeats a page token or a job, sends a page
// with no job that is not the last, or sends more than kMaxListPages pages.
absl::Status ListJobs(v1::JobService::StubInterface& stub, const CommandOptions& options,
                      std::ostream& out);

// Table: the multi-line status block. JSON: the Job.
absl::Status ShowJob(v1::JobService::StubInterface& stub, const std::string& job_id,
                     const CommandOptions& options, std::ostream& out);

// Table: one line on what the cancel did. JSON: the Job after the cancel.
absl::Status CancelJob(v1::JobService::StubInterface& stub, const std::string& job_id,
                       const CommandOptions& options, std::ostream& out);

// Table: one line on what the suspend or resume did (the job's state and why). JSON: the Job.
absl::Status SuspendJob(v1::JobService::StubInterface& stub, const std::string& job_id,
                        const CommandOptions& options, std::ostream& out);
absl::Status ResumeJob(v1::JobService::StubInterface& stub, const std::string& job_id,
                       const CommandOptions& options, std::ostream& out);

// Table: WORKER NAME HOST DEVICE STATE JOB LAST HEARTBEAT, then the clients the coordinator
// rejected (missing or wrong token). JSON: ListWorkersResponse.
// The queue in the order its jobs will start.
absl::Status ListQueue(v1::JobService::StubInterface& stub, const CommandOptions& options,
                       std::ostream& out);
absl::Status ListWorkers(v1::JobService::StubInterface& stub, const CommandOptions& options,
                         std::ostream& out);

// Asks the coordinator's gRPC health service. Table: "SERVING". JSON: the response. Anything but
// SERVING is UNAVAILABLE.
absl::Status CheckHealth(grpc::health::v1::Health::StubInterface& stub,
                         const CommandOptions& options, std::ostream& out);

// Follows the job's event stream until it ends and returns the finished job (the caller maps its
// state to the exit code). Table: event lines, progress and the final summary. JSON: one JSON
// document per event per line. A stream broken with UNAVAILABLE is reopened from the next
// sequence number (see CommandOptions); notes on that go to `err`. Returns the RPC error that
// ended the watch otherwise, e.g. NOT_FOUND for an unknown job.
absl::StatusOr<v1::Job> WatchJob(v1::JobService::StubInterface& stub, const std::string& job_id,
                                 const CommandOptions& options, std::ostream& out,
                                 std::ostream& err);

// A program job's output. Table: each line as "[default<rank>]:<text>" (torchrun's --tee
// prefix; control bytes escaped), with a "--- generation G ---" line where the generation
// changes and a note when the coordinator no longer holds the oldest lines. JSON: one LogLine
// per line. `follow`: asks again every `poll` until the job has ended and every line is out.
absl::Status ShowLogs(v1::JobService::StubInterface& stub, const std::string& job_id, int32_t rank,
                      int64_t generation, bool follow, const CommandOptions& options,
                      std::ostream& out, absl::Duration poll = absl::Milliseconds(500));

// export: the checkpoint file's parameters as safetensors at `output`, and the model's
// config.json beside it (creating the directory). The checkpoint is untrusted input: it is read
// and checked whole before any output is touched. NOT_FOUND for a missing checkpoint; DATA_LOSS
// naming it for a damaged or inconsistent one (bad lengths, a manifest whose tensors do not
// tile the parameters, repeated or reserved tensor names, a configuration that is not JSON);
// FAILED_PRECONDITION for one without tensor names. Existing output files are not replaced
// unless `force` (ALREADY_EXISTS naming the file and --force); with it both are replaced
// atomically. INVALID_ARGUMENT when `output` is a directory or named config.json; the system's
// error for the output otherwise.
absl::Status ExportCheckpoint(const std::string& checkpoint, const std::string& output,
                              std::ostream& out, bool force = false);

// The hint printed under an UNAVAILABLE error: what to check, chosen from gRPC's text for the
// failure (gRPC 1.51 reports every refused TLS handshake as UNAVAILABLE, with OpenSSL's reason
// or just "Socket closed" in the message). `tls`: the channel speaks TLS; `client_cert`: it
// presents a client certificate.
std::string UnavailableHint(const absl::Status& status, bool tls, bool client_cert);

// The warning printed before a command that sends `token` to `coordinator` in plaintext beyond
// loopback, where anyone on the path can read it; empty otherwise (no token, TLS, loopback).
std::string PlaintextTokenWarning(const std::string& coordinator, const std::string& token,
                                  bool tls);

// The channel to the coordinator that leads among `coordinators` (--coordinator, split). One
// address: that one. Several: each is asked in turn (gRPC's health check, at most `timeout`
// each, each address once) and the first that serves is used, or the leader a standby names
// when it answers from here (else the next address); when none answers, the leader a standby
// named first (or else the first address), whose error the command then reports.
std::shared_ptr<grpc::Channel> LeaderChannel(const std::vector<std::string>& coordinators,
                                             const ClientAuth& auth, absl::Duration timeout);

// Runs a checked invocation and returns the process exit code (see invocation.h): errors are
// printed to `err` as "lockstepctl: CODE: message". `health` serves the health command.
int RunCommand(const Invocation& invocation, v1::JobService::StubInterface& stub,
               const CommandOptions& options, std::ostream& out, std::ostream& err,
               grpc::health::v1::Health::StubInterface* health = nullptr);

}  // namespace lockstep::cli
