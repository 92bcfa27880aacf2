// JobService: the user-facing API.
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "coordinator/service/services.h"
#include "glog/logging.h"

namespace lockstep::coordinator {
namespace {

grpc::Status RequireJobId(const std::string& job_id) {
  if (job_id.empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id: required");
  }
  return grpc::Status::OK;
}

}  // namespace

grpc::Status JobServiceImpl::SubmitJob(grpc::ServerContext* context,
                                       const v1::SubmitJobRequest* request, v1::Job* response) {
  if (grpc::Status s = coordinator_->gate().Admit(*context, Role::kOperator); !s.ok()) return s;
  absl::StatusOr<v1::Job> job = coordinator_->Call([&](Core& core, absl::Time now, Decisions* d) {
    return core.SubmitJob(request->spec(), now, d, /*schedule=*/false);
  });
  // Starting it (assignments to every member) is the tick's work, not the caller's wait.
  if (job.ok()) coordinator_->TickSoon();
  if (!job.ok()) {
    LOG(INFO) << "refused job spec: " << job.status();
    return ToGrpcStatus(job.status());
  }
  LOG(INFO) << "submitted " << job->job_id() << " (" << job->spec().name() << ")";
  *response = *std::move(job);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                                    v1::Job* response) {
  if (grpc::Status s = coordinator_->gate().Admit(*context, Role::kOperator); !s.ok()) return s;
  if (auto s = RequireJobId(request->job_id()); !s.ok()) return s;
  absl::StatusOr<v1::Job> job = coordinator_->Call(
      [&](Core& core, absl::Time, Decisions*) { return core.GetJob(request->job_id()); });
  if (!job.ok()) return ToGrpcStatus(job.status());
  *response = *std::move(job);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::ListJobs(grpc::ServerContext* context,
                                      const v1::ListJobsRequest* request,
                                      v1::ListJobsResponse* response) {
  if (grpc::Status s = coordinator_->gate().Admit(*context, Role::kOperator); !s.ok()) return s;
  absl::StatusOr<v1::ListJobsResponse> page = coordinator_->Call(
      [&](Core& core, absl::Time, Decisions*) { return core.ListJobs(*request); });
  if (!page.ok()) return ToGrpcStatus(page.status());
  *response = *std::move(page);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::CancelJob(grpc::ServerContext* context,
                                       const v1::CancelJobRequest* request, v1::Job* response) {
  if (grpc::Status s = coordinator_->gate().Admit(*context, Role::kOperator); !s.ok()) return s;
  if (auto s = RequireJobId(request->job_id()); !s.ok()) return s;
  absl::StatusOr<v1::Job> job = coordinator_->Call([&](Core& core, absl::Time now, Decisions* d) {
    return core.CancelJob(request->job_id(), now, d);
  });
  if (!job.ok()) return ToGrpcStatus(job.status());
  LOG(INFO) << "cancelled " << job->job_id();
  *response = *std::move(job);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::WatchJob(grpc::ServerContext* context,
                                      const v1::WatchJobRequest* request,
                                      grpc::ServerWriter<v1::JobEvent>* writer) {
  if (grpc::Status s = coordinator_->gate().Admit(*context, Role::kOperator); !s.ok()) return s;
  if (auto s = RequireJobId(request->job_id()); !s.ok()) return s;
  if (request->from_sequence() < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "from_sequence: must be >= 0");
  }
  int64_t next = request->from_sequence();
  while (!context->IsCancelled()) {
    bool finished = false;
    absl::StatusOr<std::vector<v1::JobEvent>> events =
        coordinator_->WaitEvents(request->job_id(), next, absl::Milliseconds(500), &finished);
    if (!events.ok()) return ToGrpcStatus(events.status());
    for (const v1::JobEvent& event : *events) {
      if (!writer->Write(event)) return grpc::Status::CANCELLED;
      next = event.sequence() + 1;
    }
    if (finished && events->empty()) return grpc::Status::OK;
  }
  return grpc::Status::CANCELLED;
}

grpc::Status JobServiceImpl::ListWorkers(grpc::ServerContext* context,
                                         const v1::ListWorkersRequest*,
                                         v1::ListWorkersResponse* response) {
  if (grpc::Status s = coordinator_->gate().Admit(*context, Role::kOperator); !s.ok()) return s;
  *response = coordinator_->Workers();
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::GetTrainingCurve(grpc::ServerContext* context,
                                              const v1::GetTrainingCurveRequest* request,
                                              v1::TrainingCurve* response) {
  if (grpc::Status s = coordinator_->gate().Admit(*context, Role::kOperator); !s.ok()) return s;
  if (auto s = RequireJobId(request->job_id()); !s.ok()) return s;
  absl::StatusOr<v1::TrainingCurve> curve = coordinator_->Call(
      [&](Core& core, absl::Time, Decisions*) { return core.GetTrainingCurve(request->job_id()); });
  if (!curve.ok()) return ToGrpcStatus(curve.status());
  *response = *std::move(curve);
  return grpc::Status::OK;
}

}  // namespace lockstep::coordinator
