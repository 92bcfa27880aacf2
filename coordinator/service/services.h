// The coordinator's gRPC services: thin shells that validate, call the Coordinator, and reply.
#pragma once

#include "coordinator/service/coordinator.h"
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

class WorkerServiceImpl final : public v1::WorkerService::Service {
 public:
  explicit WorkerServiceImpl(Coordinator* coordinator) : coordinator_(coordinator) {}
  grpc::Status Session(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) override;

 private:
  Coordinator* const coordinator_;
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
