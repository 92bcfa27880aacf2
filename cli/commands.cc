// The RPCs behind each lockstepctl command, and the exit-code policy. Rendering lives in
// format.cc and watch_printer.cc; this file decides what to call, when to retry, what to print.
#include "cli/commands.h"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cli/watch_printer.h"
#include "common/atomic_file.h"
#include "common/proto_json.h"
#include "common/grpc_status.h"
#include "common/safetensors.h"
#include "worker/train/checkpoint.h"
#include "common/status_macros.h"
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
  // Every page, newest first from the coordinator; listed oldest first.
  v1::ListJobsResponse response;
  v1::ListJobsRequest request;
  request.set_page_size(1000);
  do {
    v1::ListJobsResponse page;
    auto context = UnaryContext(options);
    LOCKSTEP_RETURN_IF_ERROR(ToAbslStatus(stub.ListJobs(context.get(), request, &page)));
    for (v1::Job& job : *page.mutable_jobs()) *response.add_jobs() = std::move(job);
    response.set_total_jobs(page.total_jobs());
    request.set_page_token(page.next_page_token());
  } while (!request.page_token().empty());
  std::reverse(response.mutable_jobs()->begin(), response.mutable_jobs()->end());
  if (options.output == OutputFormat::kJson) return PrintJson(response, false, out);
  out << FormatJobList(response, options.clock->Now());
  return absl::OkStatus();
}

absl::Status ShowJob(v1::JobService::StubInterface& stub, const std::string& job_id,
                     const CommandOptions& options, std::ostream& out) {
  LOCKSTEP_ASSIGN_OR_RETURN(v1::Job job, GetJob(stub, job_id, options));
  if (options.output == OutputFormat::kJson) return PrintJson(job, false, out);
  out << FormatJobDetail(job, options.clock->Now(), options.time_zone);
  return absl::OkStatus();
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
                              std::ostream& out) {
  absl::StatusOr<worker::CheckpointData> data = worker::ReadCheckpoint(checkpoint);
  if (!data.ok()) return data.status();
  v1::ModelManifest manifest;
  if (data->manifest.empty() || !manifest.ParseFromString(data->manifest)) {
    return absl::FailedPreconditionError(absl::StrCat(
        checkpoint, " was written by an earlier Lockstep that did not record tensor names; "
                    "export a checkpoint written by this version"));
  }
  if (const std::filesystem::path parent = std::filesystem::path(output).parent_path();
      !parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    if (ec) return ErrnoStatus(ec.value(), "creating directory", parent.string());
  }
  LOCKSTEP_RETURN_IF_ERROR(WriteSafetensors(
      output, manifest, data->params.data(), data->params.size(),
      {{"format", "pt"},
       {"lockstep_job", data->job_id},
       {"lockstep_step", absl::StrCat(data->step)},
       {"lockstep_architecture", manifest.architecture()}},
      /*with_config=*/true));
  out << "wrote " << output << " (" << manifest.tensors_size() << " tensors, "
      << data->params.size() << " parameters of " << manifest.architecture() << " at step "
      << data->step << " of " << data->job_id << ") and config.json beside it\n";
  return absl::OkStatus();
}

int RunCommand(const Invocation& invocation, v1::JobService::StubInterface& stub,
               const CommandOptions& options, std::ostream& out, std::ostream& err,
               grpc::health::v1::Health::StubInterface* health) {
  auto fail = [&err, &options](const absl::Status& status) {
    err << "lockstepctl: " << StatusLine(status) << "\n";
    // A refused TLS handshake reaches a gRPC client only as UNAVAILABLE with a low-level text.
    if (absl::IsUnavailable(status)) {
      err << (options.tls ? "lockstepctl: (TLS: --tls_ca must be the CA that signed the "
                            "coordinator's certificate, and a coordinator with a client CA "
                            "needs --tls_cert/--tls_key signed by it and not expired)\n"
                          : "lockstepctl: (if the coordinator serves TLS, pass --tls_ca, and "
                            "--tls_cert/--tls_key when it requires client certificates)\n");
    }
    err << std::flush;
    return kExitRpcError;
  };
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
    case Command::kStatus:
      status = ShowJob(stub, invocation.job_id, options, out);
      break;
    case Command::kWatch:
      return watch(invocation.job_id);
    case Command::kCancel:
      status = CancelJob(stub, invocation.job_id, options, out);
      break;
    case Command::kWorkers:
      status = ListWorkers(stub, options, out);
      break;
    case Command::kExport:
      status = ExportCheckpoint(invocation.checkpoint, invocation.export_output, out);
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
