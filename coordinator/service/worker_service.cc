// WorkerService: one Session stream per worker, on gRPC's completion-queue API, so the
// coordinator's thread count does not grow with its workers. Completions run on the queues'
// threads and never block: a heartbeat is recorded on the spot (an atomic on the outbox), and
// every message that needs the core is posted to the session's strand (StrandPool), which keeps
// the worker's order. Writes leave the outbox one at a time. A broken stream is the fastest
// death signal: the core hears about it as soon as the read fails.
#include <algorithm>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/utf8.h"
#include "coordinator/service/services.h"
#include "glog/logging.h"
#include "grpcpp/alarm.h"

namespace lockstep::coordinator {
namespace {

// Reports and heartbeats a session may send: a burst, then a steady rate. A flood (a forged
// client; no worker sends more than a few a second) ends the session instead of taking the
// coordinator's time.
constexpr double kBurst = 2000, kPerSecond = 500;
// Messages a session may have queued for its worker. A worker holds one or two at most (an
// assignment, an abort). The queue grows only while writes stall, when the connection stops
// draining (a congested network, a stalled process): a client that merely does not call Read
// does not stall them, its gRPC transport keeps reading into its own memory. A session whose
// queue reaches this is ended instead of growing with every fan-out.
constexpr size_t kMaxQueuedMessages = 1024;
// A session whose register message has not arrived this long after the call was accepted is
// ended: an open stream holds a call, a connection and a descriptor, and one that never
// registers (silent, or a forged client) would hold them for good. A worker registers as soon
// as its stream is open, so this is seconds of slack for a loaded machine.
constexpr absl::Duration kRegisterTimeout = WorkerServiceImpl::kRegisterTimeout;

// One queued gRPC operation of a session. The queue's thread calls Proceed with the outcome; a
// started operation holds its session (keep), so a session lives until its last one returns.
struct QueueTag {
  virtual ~QueueTag() = default;
  virtual void Proceed(bool ok) = 0;
};

}  // namespace

// What the sessions share: the service, the queues, and the strands.
struct WorkerServiceImpl::Hub {
  explicit Hub(Coordinator* c) : coordinator(c) {}
  Coordinator* const coordinator;
  v1::WorkerService::AsyncService service;
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues;
  std::vector<std::thread> threads;
  // Operations start under a reader lock and only while the queues run: a session's last
  // strand task may end it after Stop, and then starts nothing.
  absl::Mutex ops_mu;
  bool stopped ABSL_GUARDED_BY(ops_mu) = false;
  absl::Mutex live_mu;
  int live ABSL_GUARDED_BY(live_mu) = 0;  // sessions in existence, waiting ones included
  // Last: destroyed first, running the tasks still posted while the rest is intact.
  StrandPool strands{kSessionThreads};
};

namespace {

// The life of a session: Await asks gRPC for the next call on one queue; once accepted, it
// admits the caller and reads the register message, which the strand registers with the
// coordinator; reads go on until the stream ends or floods, and End finishes the call once no
// write is in flight.
//
// Threads: the queue's thread runs the completions (OnAccepted, OnRead, OnWrite), which never
// block and never take the coordinator's lock. Push and Close come from any thread, the
// coordinator's lock held or not. The strand's tasks run on the pool, one at a time.
class WorkerSession final : public SessionOutbox,
                            public std::enable_shared_from_this<WorkerSession> {
 public:
  using Hub = WorkerServiceImpl::Hub;

  WorkerSession(Hub* hub, grpc::ServerCompletionQueue* queue)
      : hub_(hub),
        queue_(queue),
        coordinator_(hub->coordinator),
        strand_(hub->strands.NewStrand()),
        stream_(&context_) {
    absl::MutexLock lock(&hub_->live_mu);
    ++hub_->live;
  }
  ~WorkerSession() override {
    absl::MutexLock lock(&hub_->live_mu);
    --hub_->live;
  }

  // Waits for the next worker on `queue`.
  static void Await(Hub* hub, grpc::ServerCompletionQueue* queue) {
    auto session = std::make_shared<WorkerSession>(hub, queue);
    WorkerSession* s = session.get();
    s->StartOp(&s->accepted_, [s] {
      s->hub_->service.RequestSession(&s->context_, &s->stream_, s->queue_, s->queue_,
                                      &s->accepted_);
    });
  }

  void Push(v1::CoordinatorMessage message) override {
    bool overflow = false;
    {
      absl::MutexLock lock(&mu_);
      if (closed_) return;
      overflow = messages_.size() >= kMaxQueuedMessages;
      if (!overflow) {
        messages_.push_back(std::move(message));
        if (writing_) return;
        writing_ = true;
        out_ = std::move(messages_.front());
        messages_.pop_front();
      }
    }
    if (!overflow) return StartWrite();  // Finish waits for its completion (writing_)
    const std::string reason = absl::StrCat("session ended: the worker read none of the last ",
                                            kMaxQueuedMessages, " messages");
    Post([reason](WorkerSession& s) {
      LOG(WARNING) << "worker " << s.worker_id_ << ": " << reason;
      s.Disconnect(reason);
    });
    End(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, reason), /*cancel=*/true);
  }

  void Close() override {
    End(grpc::Status(grpc::StatusCode::CANCELLED, "the coordinator closed this session"),
        /*cancel=*/true);
  }

 private:
  struct Op final : QueueTag {
    Op(WorkerSession* s, void (WorkerSession::*f)(bool)) : session(s), on_done(f) {}
    void Proceed(bool ok) override {
      std::shared_ptr<WorkerSession> hold = std::move(keep);
      (session->*on_done)(ok);
    }
    WorkerSession* const session;
    void (WorkerSession::*const on_done)(bool);
    std::shared_ptr<WorkerSession> keep;  // while the operation is queued
  };

  // Starts one operation unless the queues have stopped; false when it did not start.
  template <typename Start>
  bool StartOp(Op* op, Start start) {
    absl::ReaderMutexLock lock(&hub_->ops_mu);
    if (hub_->stopped) return false;
    op->keep = shared_from_this();  // before the start: it may complete at once elsewhere
    start();
    return true;
  }

  void StartRead() {
    StartOp(&read_, [this] { stream_.Read(&in_, &read_); });
  }

  void StartWrite() {
    if (StartOp(&write_, [this] { stream_.Write(out_, &write_); })) return;
    absl::MutexLock lock(&mu_);
    writing_ = false;
    closed_ = true;
  }

  void OnAccepted(bool ok) {
    if (!ok) return;  // the server is shutting down
    Await(hub_, queue_);  // the next worker's call
    if (grpc::Status s = coordinator_->gate().Admit(context_, Role::kWorker); !s.ok()) {
      return End(s, /*cancel=*/false);
    }
    {
      // The alarm fires on this session's queue, so OnRegisterDeadline and OnRead never run at
      // once (one thread per queue) and read_register_ needs no lock.
      absl::MutexLock lock(&mu_);
      register_alarm_set_ = StartOp(&register_deadline_, [this] {
        register_alarm_.Set(queue_, absl::ToChronoTime(absl::Now() + kRegisterTimeout),
                            &register_deadline_);
      });
    }
    StartRead();
  }

  // The alarm's operation holds the session until it returns: cancelled as soon as it has no
  // purpose, so an ended session goes at once.
  void CancelRegisterDeadline() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (register_alarm_set_) register_alarm_.Cancel();  // no effect once fired or cancelled
  }

  // The register deadline passed (ok), or the alarm was cancelled (not ok: the register
  // message came, or the session ended).
  void OnRegisterDeadline(bool ok) {
    if (!ok || read_register_) return;
    End(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                     absl::StrCat("no register message within ",
                                  absl::FormatDuration(kRegisterTimeout),
                                  " of opening the session: a session must begin with register")),
        /*cancel=*/true);
  }

  void OnRead(bool ok) {
    if (!read_register_) {  // any first message, or the stream's end
      absl::MutexLock lock(&mu_);
      CancelRegisterDeadline();
    }
    if (ok && ending()) return StopReading();  // what the worker still sent is dropped
    if (!ok) {
      return Post([](WorkerSession& s) {
        s.Disconnect("connection lost");
        s.End(grpc::Status::OK, /*cancel=*/true);
      });
    }
    if (!read_register_) {
      read_register_ = true;
      if (grpc::Status s = CheckRegister(); !s.ok()) return End(s, /*cancel=*/false);
      return Post([request = in_.register_()](WorkerSession& s) {
        if (s.Register(request)) s.ResumeReading();
      });
    }
    const absl::Time now = absl::Now();
    allowance_ =
        std::min(kBurst, allowance_ + kPerSecond * absl::ToDoubleSeconds(now - last_read_));
    last_read_ = now;
    if (--allowance_ < 0) {
      std::string reason =
          absl::StrCat("session ended: more than ", kPerSecond, " messages a second (a flood)");
      Post([reason = std::move(reason)](WorkerSession& s) {
        LOG(WARNING) << "worker " << s.worker_id_ << ": " << reason;
        s.Disconnect(reason);
      });
      // Cancelled too: a flooding client that does not read would hold a write, and with it
      // the call, open.
      return End(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                              absl::StrCat("more than ", kPerSecond,
                                           " messages a second on one session: it was ended")),
                 /*cancel=*/true);
    }
    if (in_.has_heartbeat()) {
      coordinator_->Heartbeat(*this);  // the next tick tells the core
      return StartRead();
    }
    // The next read waits until the core has taken this report: a worker that reports faster
    // than the core decides is slowed by gRPC's flow control, as it would be by a blocking
    // read, instead of growing the strand without bound (and the core's view falling behind).
    set_report_pending(true);
    Post([message = std::move(in_)](WorkerSession& s) {
      s.Handle(message);
      s.ResumeReading();
    });
  }

  void ResumeReading() {
    set_report_pending(false);
    {
      absl::MutexLock lock(&mu_);  // so that no read starts after Finish
      if (!ending_) {
        StartRead();
        return;
      }
    }
    StopReading();
  }

  // The session ended with no read in flight: whatever ended it, the core must hear that the
  // worker is gone (nothing when it knew first: Disconnect and the core's loss are idempotent).
  void StopReading() {
    Post([](WorkerSession& s) { s.Disconnect("connection lost"); });
  }

  void OnWrite(bool ok) {
    bool more = false;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (ok && !closed_ && !messages_.empty()) {
        writing_ = true;
        out_ = std::move(messages_.front());
        messages_.pop_front();
        more = true;
      }
    }
    if (more) return StartWrite();
    if (!ok) {
      // The worker is gone (or stopped reading for good): the read side may be idle on a
      // report, so the core is told from here too.
      StopReading();
      return End(grpc::Status(grpc::StatusCode::CANCELLED, "the stream broke"), false);
    }
    FinishIfEnded();  // End came while this write was in flight
  }

  void OnFinished(bool) {}

  // Under mutual TLS a worker is who its certificate says: its name is the certificate's
  // common name, so holding the token and a certificate does not make one any worker.
  grpc::Status CheckRegister() {
    if (!in_.has_register_()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "the first message of a session must be register");
    }
    const auto auth = context_.auth_context();
    if (auth == nullptr || !auth->IsPeerAuthenticated()) return grpc::Status::OK;
    const std::vector<grpc::string_ref> names = auth->FindPropertyValues("x509_common_name");
    const std::string certified =
        names.empty() ? "" : std::string(names[0].data(), names[0].size());
    if (certified == in_.register_().name()) return grpc::Status::OK;
    return grpc::Status(
        grpc::StatusCode::PERMISSION_DENIED,
        absl::StrCat("register.name \"", in_.register_().name(),
                     "\" is not the common name of this worker's certificate (\"", certified,
                     "\"): under mutual TLS a worker registers under the name its certificate "
                     "carries"));
  }

  // Runs task(*this) on the session's strand, after everything posted before it.
  template <typename Task>
  void Post(Task task) {
    hub_->strands.Post(strand_, [self = shared_from_this(), task = std::move(task)]() mutable {
      task(*self);
    });
  }

  // No more writes; the call finishes with `status` (the first End's) once no write is in
  // flight. `cancel` also cancels the call, so a write the worker does not read cannot hold the
  // session open.
  void End(grpc::Status status, bool cancel) {
    {
      absl::MutexLock lock(&mu_);
      if (!ending_) {
        ending_ = true;
        status_ = std::move(status);
      }
      closed_ = true;
      messages_.clear();
      if (cancel && writing_) context_.TryCancel();
      CancelRegisterDeadline();
    }
    FinishIfEnded();
  }

  bool ending() {
    absl::MutexLock lock(&mu_);
    return ending_;
  }

  void FinishIfEnded() {
    grpc::Status status;
    {
      absl::MutexLock lock(&mu_);
      if (!ending_ || writing_ || finish_called_) return;
      finish_called_ = true;
      status = status_;
    }
    StartOp(&finished_, [&] { stream_.Finish(status, &finished_); });
  }

  // Strand only, from here on. False when the registration was refused (the call ends).
  bool Register(const v1::RegisterRequest& request) {
    absl::StatusOr<std::string> id = coordinator_->Register(request, shared_from_this());
    if (!id.ok()) {
      // What a worker sends is logged escaped: a newline in it must not forge a log line.
      LOG(WARNING) << "refused registration of " << EscapeForTerminal(request.name()) << ": "
                   << EscapeForTerminal(id.status().ToString());
      End(ToGrpcStatus(id.status()), /*cancel=*/false);
      return false;
    }
    worker_id_ = *id;
    return true;
  }

  void Disconnect(const std::string& reason) {
    if (worker_id_.empty() || disconnected_) return;
    disconnected_ = true;
    coordinator_->Disconnect(worker_id_, reason);
    LOG(INFO) << "session of " << worker_id_ << " ended: " << reason;
  }

  void Handle(const v1::WorkerMessage& message) {
    if (worker_id_.empty() || disconnected_) return;  // not registered, or already gone
    absl::Status status;
    std::string job_id;
    int64_t generation = 0;
    // One report: its job and generation kept for the answer below, then the core's verdict.
    auto report = [&](const auto& r, auto method) {
      job_id = r.job_id();
      generation = r.generation();
      status = coordinator_->Call([&](Core& core, absl::Time now, Decisions* d) {
        return (core.*method)(worker_id_, r, now, d);
      });
    };
    switch (message.kind_case()) {
      case v1::WorkerMessage::kProgress:
        report(message.progress(), &Core::ReportProgress);
        break;
      case v1::WorkerMessage::kFailure:
        report(message.failure(), &Core::ReportFailure);
        // Logged once the report was a member's (the job's events record it too).
        if (status.ok()) {
          LOG(WARNING) << "worker " << worker_id_ << " reports failure in " << job_id << " g"
                       << generation << ": " << EscapeForTerminal(message.failure().message());
        }
        break;
      case v1::WorkerMessage::kResumed:
        report(message.resumed(), &Core::ReportResumed);
        break;
      case v1::WorkerMessage::kCheckpoint:
        if (!message.checkpoint().error().empty()) {
          LOG(WARNING) << "worker " << worker_id_ << ": checkpoint of "
                       << EscapeForTerminal(message.checkpoint().job_id()) << " at step "
                       << message.checkpoint().step()
                       << " not written: " << EscapeForTerminal(message.checkpoint().error());
        }
        report(message.checkpoint(), &Core::ReportCheckpoint);
        break;
      case v1::WorkerMessage::kFinished:
        report(message.finished(), &Core::ReportFinished);
        break;
      case v1::WorkerMessage::kOutput:
        // Kept also after its generation ended (a failed process's last lines come then):
        // never answered with an abort.
        if (absl::Status s = coordinator_->AppendProgramOutput(worker_id_, message.output());
            !s.ok() && (++refused_ == 1 || refused_ % 1000 == 0)) {
          LOG(WARNING) << "worker " << worker_id_ << ": output refused: "
                       << EscapeForTerminal(s.ToString());
        }
        break;
      default:
        status = absl::InvalidArgumentError("unexpected message on an established session");
    }
    if (absl::IsAborted(status)) {
      // Stale generation: fence the sender; its report changed nothing.
      Push(Core::AbortMessage(job_id, generation, std::string(status.message())));
    } else if (absl::IsNotFound(status) && job_id.empty()) {
      Disconnect(absl::StrCat("session ended: ", status.message()));
      End(ToGrpcStatus(status), /*cancel=*/true);
    } else if (!status.ok() && (++refused_ == 1 || refused_ % 1000 == 0)) {
      LOG(WARNING) << "worker " << worker_id_ << ": " << EscapeForTerminal(status.ToString())
                   << " (" << refused_
                   << (refused_ == 1 ? " report" : " reports") << " refused on this session)";
    }
  }

  Hub* const hub_;
  grpc::ServerCompletionQueue* const queue_;
  Coordinator* const coordinator_;
  const std::shared_ptr<StrandPool::Strand> strand_;
  grpc::ServerContext context_;
  grpc::ServerAsyncReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage> stream_;
  Op accepted_{this, &WorkerSession::OnAccepted};
  Op read_{this, &WorkerSession::OnRead};
  Op write_{this, &WorkerSession::OnWrite};
  Op finished_{this, &WorkerSession::OnFinished};
  Op register_deadline_{this, &WorkerSession::OnRegisterDeadline};
  // Fires kRegisterTimeout after the call was accepted; Cancel only once Set (mu_).
  grpc::Alarm register_alarm_;

  // Read side: one read in flight at a time, and none while the strand handles a report, so
  // only one thread at a time touches these.
  v1::WorkerMessage in_;
  bool read_register_ = false;
  double allowance_ = kBurst;
  absl::Time last_read_ = absl::Now();

  // Strand side.
  std::string worker_id_;  // set once registered
  bool disconnected_ = false;
  int64_t refused_ = 0;  // reports refused on this session: logged sparingly

  // Write side and the end of the call.
  absl::Mutex mu_;
  std::deque<v1::CoordinatorMessage> messages_ ABSL_GUARDED_BY(mu_);
  // The write in flight while writing_: set under mu_ only when no write is in flight, then
  // read by gRPC until OnWriteDone.
  v1::CoordinatorMessage out_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;  // takes no more messages
  bool ending_ ABSL_GUARDED_BY(mu_) = false;  // End called: finish once no write is in flight
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
  bool register_alarm_set_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

WorkerServiceImpl::WorkerServiceImpl(Coordinator* coordinator, int queues)
    : hub_(std::make_unique<Hub>(coordinator)), queue_count_(std::max(1, queues)) {}

WorkerServiceImpl::~WorkerServiceImpl() { Stop(absl::ZeroDuration()); }

grpc::Service* WorkerServiceImpl::service() { return &hub_->service; }

void WorkerServiceImpl::AddQueues(grpc::ServerBuilder& builder) {
  for (int i = 0; i < queue_count_; ++i) hub_->queues.push_back(builder.AddCompletionQueue());
}

void WorkerServiceImpl::Start() {
  for (auto& queue : hub_->queues) {
    WorkerSession::Await(hub_.get(), queue.get());
    hub_->threads.emplace_back([queue = queue.get()] {
      void* tag = nullptr;
      bool ok = false;
      while (queue->Next(&tag, &ok)) static_cast<QueueTag*>(tag)->Proceed(ok);
    });
  }
}

void WorkerServiceImpl::Stop(absl::Duration grace) {
  {
    absl::MutexLock lock(&hub_->live_mu);
    hub_->live_mu.AwaitWithTimeout(
        absl::Condition(+[](int* live) { return *live == 0; }, &hub_->live), grace);
  }
  {
    absl::MutexLock lock(&hub_->ops_mu);
    if (hub_->stopped) return;
    hub_->stopped = true;
    for (auto& queue : hub_->queues) queue->Shutdown();
  }
  // Next returns every queued operation (not ok) before it returns false.
  for (std::thread& t : hub_->threads) t.join();
}

}  // namespace lockstep::coordinator
