// The coordinator's gRPC services: thin shells that validate, call the Coordinator, and reply.
#pragma once

#include "coordinator/service/coordinator.h"
#include "coordinator/service/strand_pool.h"
#include "lockstep/v1/job.grpc.pb.h"
#include "lockstep/v1/store.grpc.pb.h"
#include "lockstep/v1/worker.grpc.pb.h"

namespace lockstep::coordinator {

class JobServiceImpl final : public v1::JobService::Service {
 public:
  explicit JobServiceImpl(Coordinator* coordinator) : coordinator_(coordinator) {}
  grpc::Status SubmitJob(grpc::ServerContext* context, const v1::SubmitJobRequest* request,
                         v1::Job* response) override;
  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                      v1::Job* response) override;
  grpc::Status ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest* request,
                        v1::ListJobsResponse* response) override;
  grpc::Status CancelJob(grpc::ServerContext* context, const v1::CancelJobRequest* request,
                         v1::Job* response) override;
  grpc::Status WatchJob(grpc::ServerContext* context, const v1::WatchJobRequest* request,
                        grpc::ServerWriter<v1::JobEvent>* writer) override;
  grpc::Status ListWorkers(grpc::ServerContext* context, const v1::ListWorkersRequest* request,
                           v1::ListWorkersResponse* response) override;
  grpc::Status GetTrainingCurve(grpc::ServerContext* context,
                                const v1::GetTrainingCurveRequest* request,
                                v1::TrainingCurve* response) override;

 private:
  Coordinator* const coordinator_;
};

// Worker sessions on gRPC's callback API: a fixed set of threads whatever the number of
// workers (gRPC's own, plus kSessionThreads that carry reports to the core in each session's
// order).
class WorkerServiceImpl final : public v1::WorkerService::CallbackService {
 public:
  static constexpr int kSessionThreads = 4;

  explicit WorkerServiceImpl(Coordinator* coordinator);
  grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>* Session(
      grpc::CallbackServerContext* context) override;

 private:
  Coordinator* const coordinator_;
  // Destroyed after the server stopped (it is declared before the server): the sessions still
  // ending post their last tasks here.
  StrandPool strands_;
};

class StoreServiceImpl final : public v1::StoreService::Service {
 public:
  explicit StoreServiceImpl(Coordinator* coordinator) : coordinator_(coordinator) {}
  grpc::Status Set(grpc::ServerContext* context, const v1::StoreSetRequest* request,
                   v1::StoreSetResponse* response) override;
  grpc::Status Get(grpc::ServerContext* context, const v1::StoreGetRequest* request,
                   v1::StoreGetResponse* response) override;
  grpc::Status Wait(grpc::ServerContext* context, const v1::StoreWaitRequest* request,
                    v1::StoreWaitResponse* response) override;

 private:
  Coordinator* const coordinator_;
};

}  // namespace lockstep::coordinator
