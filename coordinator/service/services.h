// The coordinator's gRPC services: thin shells that validate, call the Coordinator, and reply.
#pragma once

#include "coordinator/service/coordinator.h"
#include "coordinator/service/strand_pool.h"
#include "grpcpp/server_builder.h"
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

// Worker sessions on gRPC's completion-queue API: a fixed set of threads whatever the number of
// workers. Each session lives on one of `queues` queues, one thread each; kSessionThreads more
// carry the sessions' reports to the core, each session's in its order.
//
// Why several queues: Debian's gRPC is built with its debug checks, and a completion scans the
// list of every operation pending on its queue. With one queue (the callback API's) that makes
// each message cost O(workers), and a fan-out to N workers O(N^2).
//
// Use: RegisterService(service()) and AddQueues(builder) before BuildAndStart, Start() after
// it; Stop() after the server's Shutdown. The destructor stops too, so the server must be shut
// down or destroyed before this object is (declare the server after it).
class WorkerServiceImpl final {
 public:
  static constexpr int kSessionThreads = 4;
  static constexpr int kDefaultQueues = 16;
  struct Hub;

  explicit WorkerServiceImpl(Coordinator* coordinator, int queues = kDefaultQueues);
  ~WorkerServiceImpl();
  WorkerServiceImpl(const WorkerServiceImpl&) = delete;
  WorkerServiceImpl& operator=(const WorkerServiceImpl&) = delete;

  grpc::Service* service();
  void AddQueues(grpc::ServerBuilder& builder);
  void Start();
  // Waits up to `grace` for the sessions to end (the server's Shutdown cancels them), then
  // stops the queues; a session that ends later starts no operation.
  void Stop(absl::Duration grace);

 private:
  const std::unique_ptr<Hub> hub_;
  const int queue_count_;
};

// The bootstrap store. Set answers at once; Get and Wait are on the callback API and hold no
// thread while they wait (a generation's members wait for their peers' keys together).
class StoreServiceImpl final
    : public v1::StoreService::WithCallbackMethod_Get<
          v1::StoreService::WithCallbackMethod_Wait<v1::StoreService::Service>> {
 public:
  explicit StoreServiceImpl(Coordinator* coordinator) : coordinator_(coordinator) {}
  grpc::Status Set(grpc::ServerContext* context, const v1::StoreSetRequest* request,
                   v1::StoreSetResponse* response) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* context,
                                const v1::StoreGetRequest* request,
                                v1::StoreGetResponse* response) override;
  grpc::ServerUnaryReactor* Wait(grpc::CallbackServerContext* context,
                                 const v1::StoreWaitRequest* request,
                                 v1::StoreWaitResponse* response) override;

 private:
  Coordinator* const coordinator_;
};

}  // namespace lockstep::coordinator
