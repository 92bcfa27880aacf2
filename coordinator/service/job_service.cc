// JobService: the user-facing API.
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

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

grpc::Status JobServiceImpl::SuspendJob(grpc::ServerContext* context,
                                        const v1::SuspendJobRequest* request, v1::Job* response) {
  if (grpc::Status s = coordinator_->gate().Admit(*context, Role::kOperator); !s.ok()) return s;
  if (auto s = RequireJobId(request->job_id()); !s.ok()) return s;
  absl::StatusOr<v1::Job> job = coordinator_->Call([&](Core& core, absl::Time now, Decisions* d) {
    return core.SuspendJob(request->job_id(), now, d);
  });
  if (!job.ok()) return ToGrpcStatus(job.status());
  LOG(INFO) << "suspended " << job->job_id();
  *response = *std::move(job);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::ResumeJob(grpc::ServerContext* context,
                                       const v1::ResumeJobRequest* request, v1::Job* response) {
  if (grpc::Status s = coordinator_->gate().Admit(*context, Role::kOperator); !s.ok()) return s;
  if (auto s = RequireJobId(request->job_id()); !s.ok()) return s;
  absl::StatusOr<v1::Job> job = coordinator_->Call([&](Core& core, absl::Time now, Decisions* d) {
    return core.ResumeJob(request->job_id(), now, d);
  });
  if (!job.ok()) return ToGrpcStatus(job.status());
  LOG(INFO) << "resumed " << job->job_id();
  *response = *std::move(job);
  return grpc::Status::OK;
}

// One WatchJob stream. It holds no thread while its job is quiet: the coordinator's change
// notification (Changed) posts a fetch of the new events to the watch's strand, and gRPC's
// callbacks write them one at a time. One batch at most is held: the next fetch waits until the
// last batch is written, so a client that stops reading holds its stream (until it goes) but
// no growing queue. After each batch it looks again, so events that came meanwhile are sent
// even without a new notification.
//
// Threads: Changed from the deciding thread, Fetch on the strand, the reactions on gRPC's
// callback threads; each decides under mu_ what to do next (Advance) and does it after
// unlocking (Run), since a gRPC call may run a reaction at once, on this thread.
class JobServiceImpl::Watch final : public grpc::ServerWriteReactor<v1::JobEvent>,
                                    public std::enable_shared_from_this<Watch> {
 public:
  Watch(JobServiceImpl* service, std::string job_id, int64_t from)
      : service_(service),
        job_id_(std::move(job_id)),
        strand_(service->fetches_.NewStrand()),
        next_(from) {}

  // Holds itself until OnDone. With `refused`, the stream ends with it at once; else the first
  // fetch starts (the caller has put the watch in the service's index already, so that no
  // change is missed between the two).
  void Start(grpc::Status refused) {
    self_ = shared_from_this();
    Next next;
    {
      absl::MutexLock lock(&mu_);
      if (!refused.ok()) {
        ended_ = true;
        end_status_ = std::move(refused);
      } else {
        changed_ = true;
      }
      next = Advance();
    }
    Run(next);
  }

  void Changed() {
    Next next;
    {
      absl::MutexLock lock(&mu_);
      changed_ = true;
      next = Advance();
    }
    Run(next);
  }

  void OnWriteDone(bool ok) override {
    Next next;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) cancelled_ = true;  // the stream broke: the client is gone
      next = Advance();
    }
    Run(next);
  }

  void OnCancel() override {
    Next next;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      next = Advance();  // waits for a write or a fetch in flight, which then finishes
    }
    Run(next);
  }

  void OnDone() override {
    std::shared_ptr<Watch> hold = std::move(self_);  // last: this may go with it
    service_->Forget(job_id_, this);
  }

 private:
  enum class Next { kNothing, kWrite, kFinish, kFetch };

  // The next step, decided under mu_: a cancel finishes (once nothing is in flight), then the
  // held events are written, then an ended job finishes, then a change is fetched.
  Next Advance() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finish_called_ || writing_ || fetching_) return Next::kNothing;
    if (cancelled_) {
      finish_called_ = true;
      end_status_ = grpc::Status::CANCELLED;
      return Next::kFinish;
    }
    if (!pending_.empty()) {
      out_ = std::move(pending_.front());
      pending_.pop_front();
      writing_ = true;
      return Next::kWrite;
    }
    if (ended_) {
      finish_called_ = true;
      return Next::kFinish;
    }
    if (changed_) {
      changed_ = false;
      fetching_ = true;
      return Next::kFetch;
    }
    return Next::kNothing;
  }

  // Outside mu_. out_ and end_status_ are not touched by others meanwhile: writing_ and
  // finish_called_ keep them.
  void Run(Next next) {
    switch (next) {
      case Next::kWrite:
        StartWrite(&out_);
        break;
      case Next::kFinish:
        Finish(end_status_);
        break;
      case Next::kFetch:
        service_->fetches_.Post(strand_, [self = shared_from_this()] { self->Fetch(); });
        break;
      case Next::kNothing:
        break;
    }
  }

  // On the strand: the events since the last one taken, without waiting (the coordinator's
  // lock is taken here, never on a gRPC thread).
  void Fetch() {
    int64_t from = 0;
    {
      absl::MutexLock lock(&mu_);
      from = next_;
    }
    bool finished = false;
    absl::StatusOr<std::vector<v1::JobEvent>> events =
        service_->coordinator_->WaitEvents(job_id_, from, absl::ZeroDuration(), &finished);
    Next next;
    {
      absl::MutexLock lock(&mu_);
      fetching_ = false;
      if (!events.ok()) {
        ended_ = true;
        end_status_ = ToGrpcStatus(events.status());
      } else if (events->empty()) {
        // The job has ended and every event was sent.
        ended_ = finished;
      } else {
        for (v1::JobEvent& event : *events) {
          next_ = event.sequence() + 1;
          pending_.push_back(std::move(event));
        }
        changed_ = true;  // look again once these are written
      }
      next = Advance();
    }
    Run(next);
  }

  JobServiceImpl* const service_;
  const std::string job_id_;
  const std::shared_ptr<StrandPool::Strand> strand_;
  std::shared_ptr<Watch> self_;  // from Start until OnDone

  absl::Mutex mu_;
  int64_t next_ ABSL_GUARDED_BY(mu_);  // the sequence of the next event to fetch
  std::deque<v1::JobEvent> pending_ ABSL_GUARDED_BY(mu_);  // fetched, not yet written
  v1::JobEvent out_;                                       // the write in flight while writing_
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool fetching_ ABSL_GUARDED_BY(mu_) = false;
  bool changed_ ABSL_GUARDED_BY(mu_) = false;    // there may be events to fetch
  bool ended_ ABSL_GUARDED_BY(mu_) = false;      // finish with end_status_ once written
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;  // the client went
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status end_status_;  // set under mu_ before finish_called_, read after
};

JobServiceImpl::JobServiceImpl(Coordinator* coordinator) : coordinator_(coordinator) {
  watch_id_ = coordinator_->WatchJobs([this](const std::string& job_id) { JobChanged(job_id); });
}

JobServiceImpl::~JobServiceImpl() { coordinator_->UnwatchJobs(watch_id_); }

grpc::ServerWriteReactor<v1::JobEvent>* JobServiceImpl::WatchJob(
    grpc::CallbackServerContext* context, const v1::WatchJobRequest* request) {
  grpc::Status status = coordinator_->gate().Admit(*context, Role::kOperator);
  if (status.ok()) status = RequireJobId(request->job_id());
  if (status.ok() && request->from_sequence() < 0) {
    status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "from_sequence: must be >= 0");
  }
  auto watch = std::make_shared<Watch>(this, request->job_id(), request->from_sequence());
  if (status.ok()) {
    absl::MutexLock lock(&mu_);
    watches_.emplace(request->job_id(), watch);
  }
  watch->Start(std::move(status));
  return watch.get();
}

void JobServiceImpl::JobChanged(const std::string& job_id) {
  std::vector<std::shared_ptr<Watch>> woken;
  {
    absl::MutexLock lock(&mu_);
    auto [begin, end] = watches_.equal_range(job_id);
    for (auto it = begin; it != end; ++it) woken.push_back(it->second);
  }
  for (const std::shared_ptr<Watch>& watch : woken) watch->Changed();
}

void JobServiceImpl::Forget(const std::string& job_id, const Watch* watch) {
  std::shared_ptr<Watch> last;  // released after mu_
  absl::MutexLock lock(&mu_);
  auto [begin, end] = watches_.equal_range(job_id);
  for (auto it = begin; it != end; ++it) {
    if (it->second.get() == watch) {
      last = std::move(it->second);
      watches_.erase(it);
      break;
    }
  }
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

grpc::Status JobServiceImpl::GetJobLogs(grpc::ServerContext* context,
                                        const v1::GetJobLogsRequest* request,
                                        v1::JobLogs* response) {
  if (grpc::Status s = coordinator_->gate().Admit(*context, Role::kOperator); !s.ok()) return s;
  if (auto s = RequireJobId(request->job_id()); !s.ok()) return s;
  if (request->from_sequence() < 0 || request->max_lines() < 0 || request->generation() < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "from_sequence, max_lines and generation: must be >= 0");
  }
  absl::StatusOr<v1::JobLogs> logs = coordinator_->JobLogs(*request);
  if (!logs.ok()) return ToGrpcStatus(logs.status());
  *response = *std::move(logs);
  return grpc::Status::OK;
}

}  // namespace lockstep::coordinator
