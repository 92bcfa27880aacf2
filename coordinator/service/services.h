// The coordinator's gRPC services: thin shells that validate, call the Coordinator, and reply.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "coordinator/service/coordinator.h"
#include "coordinator/service/strand_pool.h"
#include "grpcpp/server_builder.h"
#include "lockstep/v1/job.grpc.pb.h"
#include "lockstep/v1/store.grpc.pb.h"
#include "lockstep/v1/worker.grpc.pb.h"

namespace lockstep::coordinator {

// The user-facing API. WatchJob is on the callback API and holds no thread while its job is
// quiet: a watch is woken by the coordinator's job-change notifications (Coordinator::WatchJobs)
// and fetches the new events on a small pool of its own, since gRPC's callback threads must not
// wait for the coordinator's lock. The rest are synchronous.
//
// Use: RegisterService(this) before BuildAndStart. The server must be shut down or destroyed
// before this object is (declare the server after it); the coordinator must outlive it.
class JobServiceImpl final
    : public v1::JobService::WithCallbackMethod_WatchJob<v1::JobService::Service> {
 public:
  // Threads that fetch the watches' events, whatever the number of watches.
  static constexpr int kWatchThreads = 2;
  class Watch;

  explicit JobServiceImpl(Coordinator* coordinator);
  ~JobServiceImpl() override;
  JobServiceImpl(const JobServiceImpl&) = delete;
  JobServiceImpl& operator=(const JobServiceImpl&) = delete;

  grpc::Status SubmitJob(grpc::ServerContext* context, const v1::SubmitJobRequest* request,
                         v1::Job* response) override;
  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                      v1::Job* response) override;
  grpc::Status ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest* request,
                        v1::ListJobsResponse* response) override;
  grpc::Status CancelJob(grpc::ServerContext* context, const v1::CancelJobRequest* request,
                         v1::Job* response) override;
  grpc::Status SuspendJob(grpc::ServerContext* context, const v1::SuspendJobRequest* request,
                          v1::Job* response) override;
  grpc::Status ResumeJob(grpc::ServerContext* context, const v1::ResumeJobRequest* request,
                         v1::Job* response) override;
  // The job's events from from_sequence on, as they happen; the stream ends OK once the job
  // has ended and every event was sent. INVALID_ARGUMENT, NOT_FOUND for an unknown job,
  // CANCELLED when the client goes.
  grpc::ServerWriteReactor<v1::JobEvent>* WatchJob(grpc::CallbackServerContext* context,
                                                   const v1::WatchJobRequest* request) override;
  grpc::Status ListWorkers(grpc::ServerContext* context, const v1::ListWorkersRequest* request,
                           v1::ListWorkersResponse* response) override;
  grpc::Status GetTrainingCurve(grpc::ServerContext* context,
                                const v1::GetTrainingCurveRequest* request,
                                v1::TrainingCurve* response) override;
  grpc::Status GetJobLogs(grpc::ServerContext* context, const v1::GetJobLogsRequest* request,
                          v1::JobLogs* response) override;

 private:
  // The coordinator's notification (on the deciding thread): wakes the job's watches.
  void JobChanged(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);
  // A watch that is over (its OnDone) leaves the index.
  void Forget(const std::string& job_id, const Watch* watch) ABSL_LOCKS_EXCLUDED(mu_);

  Coordinator* const coordinator_;
  absl::Mutex mu_;
  // The live watches by job id; each holds itself alive until its OnDone, this index too.
  std::multimap<std::string, std::shared_ptr<Watch>> watches_ ABSL_GUARDED_BY(mu_);
  Coordinator::JobWatchId watch_id_ = 0;
  // Last: destroyed first, running the fetches still posted while the rest is intact.
  StrandPool fetches_{kWatchThreads};
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
  // A session that has not sent its register message this long after it opened is ended with
  // DEADLINE_EXCEEDED.
  static constexpr absl::Duration kRegisterTimeout = absl::Seconds(10);
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
  grpc::Status Add(grpc::ServerContext* context, const v1::StoreAddRequest* request,
                   v1::StoreAddResponse* response) override;
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
