// WorkerService: one Session stream per worker. A reader thread feeds the worker's messages to
// the core; the handler thread writes the queued coordinator messages. A broken stream is the
// fastest death signal: the core hears about it the moment Read fails.
#include <algorithm>
#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "coordinator/service/services.h"
#include "glog/logging.h"

namespace lockstep::coordinator {

grpc::Status WorkerServiceImpl::Session(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) {
  if (grpc::Status s = coordinator_->gate().Admit(*context, Role::kWorker); !s.ok()) return s;
  v1::WorkerMessage first;
  if (!stream->Read(&first)) return grpc::Status::CANCELLED;
  if (!first.has_register_()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the first message of a session must be register");
  }
  // Under mutual TLS a worker is who its certificate says: its name is the certificate's
  // common name, so holding the token and a certificate does not make one any worker.
  if (const auto auth = context->auth_context(); auth != nullptr && auth->IsPeerAuthenticated()) {
    const std::vector<grpc::string_ref> names = auth->FindPropertyValues("x509_common_name");
    const std::string certified = names.empty() ? "" : std::string(names[0].data(), names[0].size());
    if (certified != first.register_().name()) {
      return grpc::Status(
          grpc::StatusCode::PERMISSION_DENIED,
          absl::StrCat("register.name \"", first.register_().name(),
                       "\" is not the common name of this worker's certificate (\"", certified,
                       "\"): under mutual TLS a worker registers under the name its certificate "
                       "carries"));
    }
  }
  auto outbox = std::make_shared<SessionOutbox>(context);
  absl::StatusOr<std::string> id = coordinator_->Register(first.register_(), outbox);
  if (!id.ok()) {
    LOG(WARNING) << "refused registration of " << first.register_().name() << ": " << id.status();
    return ToGrpcStatus(id.status());
  }
  const std::string worker_id = *id;
  // Reports and heartbeats a session may send: a burst, then a steady rate. A flood (a forged
  // client; no worker sends more than a few a second) ends the session instead of taking the
  // coordinator's time.
  constexpr double kBurst = 2000, kPerSecond = 500;
  std::atomic<bool> flooded{false};
  std::thread reader([&, outbox] {
    double allowance = kBurst;
    absl::Time last = absl::Now();
    v1::WorkerMessage message;
    std::string reason = "session closed by the worker";
    int64_t refused = 0;  // reports refused on this session: logged sparingly
    while (stream->Read(&message)) {
      const absl::Time now = absl::Now();
      allowance = std::min(kBurst, allowance + kPerSecond * absl::ToDoubleSeconds(now - last));
      last = now;
      if (--allowance < 0) {
        flooded = true;
        reason = absl::StrCat("session ended: more than ", kPerSecond,
                              " messages a second (a flood)");
        LOG(WARNING) << "worker " << worker_id << ": " << reason;
        break;
      }
      absl::Status status;
      std::string job_id;
      int64_t generation = 0;
      switch (message.kind_case()) {
        case v1::WorkerMessage::kHeartbeat:
          coordinator_->Heartbeat(*outbox);  // the next tick tells the core
          break;
        case v1::WorkerMessage::kProgress:
          job_id = message.progress().job_id();
          generation = message.progress().generation();
          status = coordinator_->Call([&](Core& core, absl::Time now, Decisions* d) {
            return core.ReportProgress(worker_id, message.progress(), now, d);
          });
          break;
        case v1::WorkerMessage::kFailure:
          job_id = message.failure().job_id();
          generation = message.failure().generation();
          status = coordinator_->Call([&](Core& core, absl::Time now, Decisions* d) {
            return core.ReportFailure(worker_id, message.failure(), now, d);
          });
          // Logged once the report was a member's (the job's events record it too).
          if (status.ok()) {
            LOG(WARNING) << "worker " << worker_id << " reports failure in " << job_id << " g"
                         << generation << ": " << message.failure().message();
          }
          break;
        case v1::WorkerMessage::kResumed:
          job_id = message.resumed().job_id();
          generation = message.resumed().generation();
          status = coordinator_->Call([&](Core& core, absl::Time now, Decisions* d) {
            return core.ReportResumed(worker_id, message.resumed(), now, d);
          });
          break;
        case v1::WorkerMessage::kCheckpoint:
          job_id = message.checkpoint().job_id();
          generation = message.checkpoint().generation();
          if (!message.checkpoint().error().empty()) {
            LOG(WARNING) << "worker " << worker_id << ": checkpoint of " << job_id << " at step "
                         << message.checkpoint().step()
                         << " not written: " << message.checkpoint().error();
          }
          status = coordinator_->Call([&](Core& core, absl::Time now, Decisions* d) {
            return core.ReportCheckpoint(worker_id, message.checkpoint(), now, d);
          });
          break;
        case v1::WorkerMessage::kFinished:
          job_id = message.finished().job_id();
          generation = message.finished().generation();
          status = coordinator_->Call([&](Core& core, absl::Time now, Decisions* d) {
            return core.ReportFinished(worker_id, message.finished(), now, d);
          });
          break;
        default:
          status = absl::InvalidArgumentError("unexpected message on an established session");
      }
      if (absl::IsAborted(status)) {
        // Stale generation: fence the sender; its report changed nothing.
        outbox->Push(Core::AbortMessage(job_id, generation, std::string(status.message())));
      } else if (absl::IsNotFound(status) && job_id.empty()) {
        reason = absl::StrCat("session ended: ", status.message());
        break;
      } else if (!status.ok() && (++refused == 1 || refused % 1000 == 0)) {
        LOG(WARNING) << "worker " << worker_id << ": " << status << " (" << refused
                     << (refused == 1 ? " report" : " reports") << " refused on this session)";
      }
    }
    if (context->IsCancelled()) reason = "connection lost";
    coordinator_->Disconnect(worker_id, reason);
    // A flooded session ends with the handler's status (RESOURCE_EXHAUSTED), not cancelled.
    outbox->Close(/*cancel=*/!flooded);
  });

  v1::CoordinatorMessage out;
  while (outbox->Pop(&out)) {
    if (!stream->Write(out)) break;
  }
  // Pop fails only once the outbox is closed, which cancels the call so Read returns.
  outbox->Close();
  reader.join();
  LOG(INFO) << "session of " << worker_id << " ended";
  if (flooded) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("more than ", kPerSecond,
                                     " messages a second on one session: it was ended"));
  }
  return grpc::Status::OK;
}

}  // namespace lockstep::coordinator
