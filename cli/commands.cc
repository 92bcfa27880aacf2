// The RPCs behind each lockstepctl command, and the exit-code policy. Rendering lives in
// format.cc and watch_printer.cc; this file decides what to call, when to retry, what to print.
#include "cli/commands.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <unordered_set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cli/watch_printer.h"
#include "common/atomic_file.h"
#include "common/checkpoint.h"
#include "common/coordinators.h"
#include "common/grpc_options.h"
#include "common/grpc_status.h"
#include "common/proto_json.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "common/tls.h"
#include "common/utf8.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/client_context.h"

namespace lockstep::cli {
namespace {

// A context whose deadline is the unary timeout from now. set_deadline takes only
// std::chrono::system_clock time points; absl::ToChronoTime produces one.
std::unique_ptr<grpc::ClientContext> UnaryContext(const CommandOptions& options) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + options.rpc_timeout));
  return context;
}

absl::Status PrintJson(const google::protobuf::Message& message, bool one_line, std::ostream& out) {
  LOCKSTEP_ASSIGN_OR_RETURN(std::string json, ToJson(message, /*multiline=*/!one_line));
  out << json << std::flush;
  return absl::OkStatus();
}

absl::StatusOr<v1::Job> GetJob(v1::JobService::StubInterface& stub, const std::string& job_id,
                               const CommandOptions& options) {
  v1::GetJobRequest request;
  request.set_job_id(job_id);
  v1::Job job;
  auto context = UnaryContext(options);
  LOCKSTEP_RETURN_IF_ERROR(ToAbslStatus(stub.GetJob(context.get(), request, &job)));
  return job;
}

// The outcome of one WatchJob stream.
struct StreamResult {
  absl::Status status;
  bool delivered = false;  // at least one new event arrived
};

}  // namespace

absl::Status SubmitJob(v1::JobService::StubInterface& stub, const v1::JobSpec& spec,
                       const CommandOptions& options, std::ostream& out, bool one_line,
                       v1::Job* job) {
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  v1::Job reply;
  // Not retried: a submit whose reply was lost may have created the job already.
  auto context = UnaryContext(options);
  LOCKSTEP_RETURN_IF_ERROR(ToAbslStatus(stub.SubmitJob(context.get(), request, &reply)));
  if (options.output == OutputFormat::kJson) {
    LOCKSTEP_RETURN_IF_ERROR(PrintJson(reply, one_line, out));
  } else {
    out << reply.job_id() << "\n" << std::flush;
  }
  if (job != nullptr) *job = std::move(reply);
  return absl::OkStatus();
}

absl::Status ListJobs(v1::JobService::StubInterface& stub, const CommandOptions& options,
                      std::ostream& out) {
  // Every page, newest first from the coordinator; listed oldest first. The coordinator's pages
  // walk back through the jobs, each holding at least one, so a repeated token or job, or an
  // empty page that is not the last, means the next request would go on forever.
  v1::ListJobsResponse response;
  v1::ListJobsRequest request;
  request.set_page_size(1000);
  std::unordered_set<std::string> tokens;
  std::unordered_set<std::string> job_ids;
  for (int pages = 1;; ++pages) {
    v1::ListJobsResponse page;
    auto context = UnaryContext(options);
    LOCKSTEP_RETURN_IF_ERROR(ToAbslStatus(stub.ListJobs(context.get(), request, &page)));
    for (v1::Job& job : *page.mutable_jobs()) {
      if (!job_ids.insert(job.job_id()).second) {
        return absl::InternalError(absl::StrCat("the coordinator listed job ",
                                                EscapeForTerminal(job.job_id()), " twice (page ",
                                                pages, "); stopped following its pages"));
      }
      *response.add_jobs() = std::move(job);
    }
    response.set_total_jobs(page.total_jobs());
    if (page.next_page_token().empty()) break;
    if (page.jobs_size() == 0) {
      return absl::InternalError(absl::StrCat("the coordinator sent page ", pages,
                                              " without jobs but with a next page token; "
                                              "stopped following its pages"));
    }
    if (!tokens.insert(page.next_page_token()).second) {
      return absl::InternalError(absl::StrCat(
          "the coordinator repeated the page token \"", EscapeForTerminal(page.next_page_token()),
          "\" (page ", pages, "); stopped following its pages"));
    }
    if (pages >= kMaxListPages) {
      return absl::InternalError(absl::StrCat("the coordinator sent more than ", kMaxListPages,
                                              " pages of jobs; stopped following them"));
    }
    request.set_page_token(page.next_page_token());
  }
  std::reverse(response.mutable_jobs()->begin(), response.mutable_jobs()->end());
  if (options.output == OutputFormat::kJson) return PrintJson(response, false, out);
  out << FormatJobList(response, options.clock->Now());
  return absl::OkStatus();
}

absl::Status ListQueue(v1::JobService::StubInterface& stub, const CommandOptions& options,
                       std::ostream& out) {
  v1::ListJobsRequest request;
  request.set_queue(true);
  request.set_page_size(1000);
  v1::ListJobsResponse queue;
  auto context = UnaryContext(options);
  LOCKSTEP_RETURN_IF_ERROR(ToAbslStatus(stub.ListJobs(context.get(), request, &queue)));
  if (options.output == OutputFormat::kJson) return PrintJson(queue, false, out);
  out << FormatQueue(queue, options.clock->Now());
  return absl::OkStatus();
}

absl::Status ShowJob(v1::JobService::StubInterface& stub, const std::string& job_id,
                     const CommandOptions& options, std::ostream& out) {
  LOCKSTEP_ASSIGN_OR_RETURN(v1::Job job, GetJob(stub, job_id, options));
  if (options.output == OutputFormat::kJson) return PrintJson(job, false, out);
  out << FormatJobDetail(job, options.clock->Now(), options.time_zone);
  return absl::OkStatus();
}

absl::Status ShowLogs(v1::JobService::StubInterface& stub, const std::string& job_id, int32_t rank,
                      int64_t generation, bool follow, const CommandOptions& options,
                      std::ostream& out, absl::Duration poll) {
  v1::GetJobLogsRequest request;
  request.set_job_id(job_id);
  if (rank >= 0) request.set_rank(rank);
  request.set_generation(generation);
  int64_t shown_generation = 0;
  bool noted_gap = false;
  for (;;) {
    // Whether the job has ended is asked before the lines: whatever it wrote is in by then.
    bool ended = !follow;
    if (follow) {
      LOCKSTEP_ASSIGN_OR_RETURN(v1::Job job, GetJob(stub, job_id, options));
      ended = IsTerminal(job.state());
    }
    for (;;) {
      v1::JobLogs logs;
      auto context = UnaryContext(options);
      LOCKSTEP_RETURN_IF_ERROR(ToAbslStatus(stub.GetJobLogs(context.get(), request, &logs)));
      if (!noted_gap && logs.first_sequence() > request.from_sequence() &&
          options.output == OutputFormat::kTable) {
        out << "(" << logs.first_sequence() - request.from_sequence()
            << " older lines are no longer kept)\n";
      }
      noted_gap = true;
      for (const v1::LogLine& line : logs.lines()) {
        if (options.output == OutputFormat::kJson) {
          LOCKSTEP_RETURN_IF_ERROR(PrintJson(line, /*one_line=*/true, out));
          continue;
        }
        if (line.generation() != shown_generation) {
          out << "--- generation " << line.generation() << " ---\n";
          shown_generation = line.generation();
        }
        out << "[default" << line.rank() << "]:" << EscapeForTerminal(line.text()) << "\n";
      }
      out << std::flush;
      const bool more = logs.next_sequence() > request.from_sequence() && logs.lines_size() > 0;
      request.set_from_sequence(logs.next_sequence());
      if (!more) break;
    }
    if (ended) return absl::OkStatus();
    options.sleep(poll);
  }
}

absl::Status CancelJob(v1::JobService::StubInterface& stub, const std::string& job_id,
                       const CommandOptions& options, std::ostream& out) {
  v1::CancelJobRequest request;
  request.set_job_id(job_id);
  v1::Job job;
  auto context = UnaryContext(options);
  LOCKSTEP_RETURN_IF_ERROR(ToAbslStatus(stub.CancelJob(context.get(), request, &job)));
  if (options.output == OutputFormat::kJson) return PrintJson(job, false, out);
  if (job.state() == v1::JOB_STATE_CANCELLED) {
    out << "cancelled " << job.job_id() << "\n";
  } else {
    // The coordinator may finish the cancel asynchronously (workers are told first).
    out << "cancel requested for " << job.job_id() << " (state " << JobStateName(job.state())
        << ")\n";
  }
  return absl::OkStatus();
}

absl::Status SuspendJob(v1::JobService::StubInterface& stub, const std::string& job_id,
                        const CommandOptions& options, std::ostream& out) {
  v1::SuspendJobRequest request;
  request.set_job_id(job_id);
  v1::Job job;
  auto context = UnaryContext(options);
  LOCKSTEP_RETURN_IF_ERROR(ToAbslStatus(stub.SuspendJob(context.get(), request, &job)));
  if (options.output == OutputFormat::kJson) return PrintJson(job, false, out);
  out << "suspended " << job.job_id() << ": " << EscapeForTerminal(job.reason()) << "\n";
  return absl::OkStatus();
}

absl::Status ResumeJob(v1::JobService::StubInterface& stub, const std::string& job_id,
                       const CommandOptions& options, std::ostream& out) {
  v1::ResumeJobRequest request;
  request.set_job_id(job_id);
  v1::Job job;
  auto context = UnaryContext(options);
  LOCKSTEP_RETURN_IF_ERROR(ToAbslStatus(stub.ResumeJob(context.get(), request, &job)));
  if (options.output == OutputFormat::kJson) return PrintJson(job, false, out);
  out << "resumed " << job.job_id() << " (state " << JobStateName(job.state())
      << "): " << EscapeForTerminal(job.reason()) << "\n";
  return absl::OkStatus();
}

absl::Status ListWorkers(v1::JobService::StubInterface& stub, const CommandOptions& options,
                         std::ostream& out) {
  v1::ListWorkersResponse response;
  auto context = UnaryContext(options);
  LOCKSTEP_RETURN_IF_ERROR(
      ToAbslStatus(stub.ListWorkers(context.get(), v1::ListWorkersRequest(), &response)));
  if (options.output == OutputFormat::kJson) return PrintJson(response, false, out);
  out << FormatWorkerList(response, options.clock->Now());
  return absl::OkStatus();
}

absl::Status CheckHealth(grpc::health::v1::Health::StubInterface& stub,
                         const CommandOptions& options, std::ostream& out) {
  grpc::health::v1::HealthCheckResponse response;
  auto context = UnaryContext(options);
  LOCKSTEP_RETURN_IF_ERROR(
      ToAbslStatus(stub.Check(context.get(), grpc::health::v1::HealthCheckRequest(), &response)));
  const std::string name =
      grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
  if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat("coordinator health: ", name));
  }
  if (options.output == OutputFormat::kJson) return PrintJson(response, false, out);
  out << name << "\n";
  return absl::OkStatus();
}

absl::StatusOr<v1::Job> WatchJob(v1::JobService::StubInterface& stub, const std::string& job_id,
                                 const CommandOptions& options, std::ostream& out,
                                 std::ostream& err) {
  WatchPrinter printer(options.output, options.live_progress, options.clock, options.time_zone,
                       out);
  std::optional<v1::Job> last_job;
  int64_t last_sequence = -1;  // highest event sequence printed; the next stream starts after it
  int retries = 0;
  absl::Duration backoff = options.initial_backoff;

  // Reads one stream to its end. Events at or below last_sequence (a server replaying more than
  // asked) are skipped, so no event prints twice across reconnects.
  auto read_stream = [&]() {
    StreamResult result;
    grpc::ClientContext context;
    v1::WatchJobRequest request;
    request.set_job_id(job_id);
    request.set_from_sequence(last_sequence + 1);
    std::unique_ptr<grpc::ClientReaderInterface<v1::JobEvent>> reader =
        stub.WatchJob(&context, request);
    v1::JobEvent event;
    while (reader->Read(&event)) {
      if (last_job.has_value() &&
          event.job().submit_time_unix_ms() != last_job->submit_time_unix_ms()) {
        // Same id, different job: a coordinator that lost its state reused the id. Following
        // it would report another job's result as this one's.
        context.TryCancel();
        while (reader->Read(&event)) {
        }
        reader->Finish();
        result.status = absl::NotFoundError(
            absl::StrCat("job ", job_id, " no longer exists (the coordinator lost its state and ",
                         "the id now names a job submitted at another time)"));
        return result;
      }
      if (event.sequence() <= last_sequence) continue;
      last_sequence = event.sequence();
      result.delivered = true;
      if (event.job().job_id().empty()) event.mutable_job()->set_job_id(job_id);
      printer.OnEvent(event);
      last_job = event.job();
    }
    result.status = ToAbslStatus(reader->Finish());
    return result;
  };

  while (true) {
    StreamResult result = read_stream();
    absl::Status status = std::move(result.status);
    if (status.ok() && (!last_job.has_value() || !IsTerminal(last_job->state()))) {
      // The stream ends when the job finishes; if it ended without saying so, ask directly.
      absl::StatusOr<v1::Job> job = GetJob(stub, job_id, options);
      if (!job.ok()) {
        status = job.status();
      } else if (IsTerminal(job->state())) {
        last_job = *std::move(job);
      } else {
        status = absl::UnavailableError(
            absl::StrCat("watch stream ended while ", job_id, " is ", JobStateName(job->state())));
      }
    }
    if (status.ok()) break;
    if (result.delivered) {
      retries = 0;
      backoff = options.initial_backoff;
    }
    if (!absl::IsUnavailable(status) || retries >= options.max_watch_retries) {
      printer.BreakLine();
      return status;
    }
    ++retries;
    printer.BreakLine();
    err << "lockstepctl: watch interrupted (" << StatusLine(status) << "); retrying in "
        << ShortDuration(backoff) << " (" << retries << "/" << options.max_watch_retries << ")\n"
        << std::flush;
    options.sleep(backoff);
    backoff = std::min(backoff * 2, options.max_backoff);
  }
  printer.Finish(*last_job);
  return *std::move(last_job);
}

absl::Status ExportCheckpoint(const std::string& checkpoint, const std::string& output,
                              std::ostream& out, bool force) {
  absl::StatusOr<CheckpointData> data = ReadCheckpoint(checkpoint);
  if (!data.ok()) return data.status();
  if (data->manifest.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(checkpoint,
                     " was written by an earlier Lockstep that did not record tensor names; "
                     "export a checkpoint written by this version"));
  }
  v1::ModelManifest manifest;
  bool parsed = false;
  {
    // Protobuf logs a text that is not UTF-8 in a string field as an error of its own before
    // failing the parse; the DATA_LOSS below is the one message the user needs.
    google::protobuf::LogSilencer quiet;
    parsed = manifest.ParseFromString(data->manifest);
  }
  if (!parsed) {
    return absl::DataLossError(absl::StrCat(checkpoint, ": its model manifest does not parse"));
  }
  // Everything taken from the checkpoint is checked before any output is touched: the header
  // (tensor names and shapes against the parameters it holds, the metadata) and the config.
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"lockstep_job", data->job_id},
      {"lockstep_step", absl::StrCat(data->step)},
      {"lockstep_architecture", manifest.architecture()}};
  if (absl::Status fits = CheckManifest(manifest, data->params.size()); !fits.ok()) {
    return absl::DataLossError(absl::StrCat(checkpoint, ": its model manifest does not describe ",
                                            "its parameters: ", fits.message()));
  }
  if (absl::StatusOr<std::string> header =
          SafetensorsHeader(manifest, data->params.size(), metadata);
      !header.ok()) {
    return absl::DataLossError(absl::StrCat(checkpoint, ": ", header.status().message()));
  }
  if (!manifest.config_json().empty()) {
    google::protobuf::Struct config;
    if (!google::protobuf::util::JsonStringToMessage(manifest.config_json(), &config).ok()) {
      return absl::DataLossError(
          absl::StrCat(checkpoint, ": its model configuration is not a JSON object"));
    }
  }
  if (const std::filesystem::path parent = std::filesystem::path(output).parent_path();
      !parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    if (ec) return ErrnoStatus(ec.value(), "creating directory", parent.string());
  }
  absl::Status written = WriteSafetensors(
      output, manifest, data->params.data(), data->params.size(), metadata,
      /*with_config=*/true, force ? ExistingOutput::kReplace : ExistingOutput::kRefuse);
  if (absl::IsAlreadyExists(written)) {
    return absl::AlreadyExistsError(
        absl::StrCat(written.message(), "; pass --force to replace it (export writes ", output,
                     manifest.config_json().empty() ? "" : " and config.json beside it", ")"));
  }
  LOCKSTEP_RETURN_IF_ERROR(written);
  // The job id and architecture are the file's words: escaped before they reach a terminal.
  out << "wrote " << output << " (" << manifest.tensors_size() << " tensors, "
      << data->params.size() << " parameters of " << EscapeForTerminal(manifest.architecture())
      << " at step " << data->step << " of " << EscapeForTerminal(data->job_id) << ")"
      << (manifest.config_json().empty() ? "" : absl::StrCat(" and ", ConfigJsonPathFor(output)))
      << "\n";
  return absl::OkStatus();
}

std::string UnavailableHint(const absl::Status& status, bool tls, bool client_cert) {
  // gRPC 1.51 over OpenSSL 3 says, under "failed to connect to all addresses; last error":
  //   "Connection refused" (nothing listens), "Ssl handshake failed: ... certificate verify
  //   failed" (the coordinator's certificate is not signed by --tls_ca, or has expired),
  //   "Peer name X is not in peer certificate", "wrong version number" (TLS to a plaintext
  //   port), and "Socket closed" when the coordinator hung up: a plaintext client at a TLS
  //   port, or, under TLS 1.3, a coordinator that refused the client's certificate (or its
  //   absence) after the client had finished its side of the handshake. When the refusal
  //   arrives during the handshake (TLS 1.2) it names an alert: "alert bad certificate",
  //   "certificate required", "unknown ca", "certificate expired". BoringSSL builds spell the
  //   same reasons in capitals with underscores, hence the normalisation.
  std::string text = absl::AsciiStrToLower(status.message());
  std::replace(text.begin(), text.end(), '_', ' ');
  auto has = [&text](absl::string_view what) { return absl::StrContains(text, what); };
  if (has("this coordinator is a standby")) return "";  // it names the leader itself
  if (has("connection refused") || has("dns resolution failed") ||
      has("name or service not known")) {
    return "(nothing answers at that address: is the coordinator running, and is --coordinator "
           "(or $LOCKSTEP_COORDINATOR) right?)";
  }
  if (!tls) {
    // A TLS coordinator hangs up on a plaintext client ("Socket closed").
    return "(if the coordinator serves TLS, pass --tls_ca, and --tls_cert/--tls_key when it "
           "requires client certificates)";
  }
  if (has("wrong version number") || has("packet length too long")) {
    return "(TLS: the coordinator answered in plaintext: it serves no TLS at that address; drop "
           "--tls_ca/--tls_cert/--tls_key or check --coordinator)";
  }
  if (has("peer name") && has("is not in peer certificate")) {
    return "(TLS: the coordinator's certificate does not name the address dialled; pass "
           "--tls_server_name with a name it holds, or dial that name)";
  }
  if (has("certificate verify failed")) {
    return "(TLS: the coordinator's certificate is not trusted: --tls_ca must be the CA that "
           "signed it, and it must not have expired)";
  }
  if (has("alert bad certificate") || has("certificate required") || has("unknown ca") ||
      has("certificate expired") || has("certificate unknown") || has("certificate revoked") ||
      has("unsupported certificate") || has("socket closed") || has("connection reset")) {
    return client_cert
               ? "(TLS: the coordinator refused this client's certificate: --tls_cert/--tls_key "
                 "must be signed by the CA the coordinator was given for its clients, and not "
                 "expired)"
               : "(TLS: the coordinator requires a client certificate: pass --tls_cert and "
                 "--tls_key, signed by the CA it was given for its clients)";
  }
  return "(TLS: --tls_ca must be the CA that signed the coordinator's certificate, and a "
         "coordinator with a client CA needs --tls_cert/--tls_key signed by it and not "
         "expired)";
}

std::string PlaintextTokenWarning(const std::string& coordinator, const std::string& token,
                                  bool tls) {
  if (token.empty() || tls || IsLoopbackAddress(coordinator)) return "";
  return absl::StrCat("lockstepctl: warning: sending the token to ", coordinator,
                      " without TLS: anyone on the network path can read it (pass --tls_ca "
                      "to use TLS)");
}

std::shared_ptr<grpc::Channel> LeaderChannel(const std::vector<std::string>& coordinators,
                                             const ClientAuth& auth, absl::Duration timeout) {
  if (coordinators.size() == 1) return MakeChannel(coordinators.front(), auth);
  const absl::Duration probe = std::min(timeout, absl::Seconds(2));
  // The channel to `address` and the leader its health check named ("" when none).
  struct Probe {
    std::shared_ptr<grpc::Channel> channel;
    bool answers = false;  // serving, or answering (a refused token, say)
    std::string leader;
  };
  auto ask = [&](const std::string& address) {
    Probe p{MakeChannel(address, auth)};
    auto health = grpc::health::v1::Health::NewStub(p.channel);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + probe));
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status =
        health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
    p.leader = LeaderNamedBy(context);
    p.answers = p.leader.empty() && status.error_code() != grpc::StatusCode::UNAVAILABLE &&
                status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED;
    return p;
  };
  std::set<std::string> asked;
  std::string first_named;  // the leader a standby named first, for the command's error
  for (const std::string& address : coordinators) {
    if (!asked.insert(address).second) continue;
    Probe p = ask(address);
    // The command's call gets the same answer as the health check.
    if (p.answers) return p.channel;
    // The leader a standby names, if this client can reach it (a container's or a host's
    // name may not resolve here); else the next address, which may be the leader itself.
    if (!p.leader.empty() && asked.insert(p.leader).second) {
      if (first_named.empty()) first_named = p.leader;
      Probe named = ask(p.leader);
      if (named.answers) return named.channel;
    }
  }
  return MakeChannel(first_named.empty() ? coordinators.front() : first_named, auth);
}

int RunCommand(const Invocation& invocation, v1::JobService::StubInterface& stub,
               const CommandOptions& options, std::ostream& out, std::ostream& err,
               grpc::health::v1::Health::StubInterface* health) {
  auto fail = [&err, &options](const absl::Status& status) {
    err << "lockstepctl: " << StatusLine(status) << "\n";
    // A refused TLS handshake reaches a gRPC client only as UNAVAILABLE with a low-level text.
    if (absl::IsUnavailable(status)) {
      const std::string hint = UnavailableHint(status, options.tls, options.tls_client_cert);
      if (!hint.empty()) err << "lockstepctl: " << hint << "\n";
    }
    err << std::flush;
    return kExitRpcError;
  };
  // Once, before the first call that carries the token (help and export make none).
  if (invocation.command != Command::kHelp && invocation.command != Command::kExport) {
    if (const std::string warning =
            PlaintextTokenWarning(invocation.coordinator, invocation.token, options.tls);
        !warning.empty()) {
      err << warning << "\n" << std::flush;
    }
  }
  auto watch = [&](const std::string& job_id) {
    absl::StatusOr<v1::Job> job = WatchJob(stub, job_id, options, out, err);
    if (!job.ok()) return fail(job.status());
    return job->state() == v1::JOB_STATE_SUCCEEDED ? kExitOk : kExitJobFailed;
  };

  absl::Status status;
  switch (invocation.command) {
    case Command::kHelp:
      out << HelpText();
      return kExitOk;
    case Command::kSubmit: {
      v1::Job job;
      status = SubmitJob(stub, invocation.spec, options, out, /*one_line=*/invocation.watch, &job);
      if (status.ok() && invocation.watch) return watch(job.job_id());
      break;
    }
    case Command::kList:
      status = ListJobs(stub, options, out);
      break;
    case Command::kQueue:
      status = ListQueue(stub, options, out);
      break;
    case Command::kStatus:
      status = ShowJob(stub, invocation.job_id, options, out);
      break;
    case Command::kWatch:
      return watch(invocation.job_id);
    case Command::kCancel:
      status = CancelJob(stub, invocation.job_id, options, out);
      break;
    case Command::kSuspend:
      status = SuspendJob(stub, invocation.job_id, options, out);
      break;
    case Command::kResume:
      status = ResumeJob(stub, invocation.job_id, options, out);
      break;
    case Command::kLogs:
      status = ShowLogs(stub, invocation.job_id, invocation.rank, invocation.generation,
                        invocation.follow, options, out);
      break;
    case Command::kWorkers:
      status = ListWorkers(stub, options, out);
      break;
    case Command::kExport:
      status =
          ExportCheckpoint(invocation.checkpoint, invocation.export_output, out, invocation.force);
      if (!status.ok()) {
        err << "lockstepctl: " << StatusLine(status) << "\n" << std::flush;
        return kExitFileError;
      }
      break;
    case Command::kHealth:
      status = health != nullptr ? CheckHealth(*health, options, out)
                                 : absl::InternalError("no health stub");
      break;
  }
  return status.ok() ? kExitOk : fail(status);
}

}  // namespace lockstep::cli
