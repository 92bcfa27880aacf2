#include "bench/sim_workers.h"

#include <deque>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/client_callback.h"

// The store's session-key header (common/auth.h), spelled here so that the simulation links
// only the generated API.
constexpr char kSessionKeyHeader[] = "x-lockstep-session";

namespace lockstep::bench {

v1::JobSpec SimulatedJob(int min_workers, int max_workers) {
  v1::JobSpec spec;
  spec.set_name("simulated");
  spec.mutable_model()->set_type("mlp");
  spec.mutable_model()->mutable_mlp()->add_hidden_widths(16);
  spec.mutable_dataset()->set_type("synthetic");
  auto* s = spec.mutable_dataset()->mutable_synthetic();
  s->set_train_samples(1 << 20);
  s->set_test_samples(1024);
  s->set_input_dim(8);
  s->set_num_classes(2);
  spec.mutable_optimizer()->set_learning_rate(0.1);
  spec.set_global_batch_size(max_workers);
  spec.set_micro_shards(max_workers);
  spec.set_max_steps(1000);
  spec.set_min_workers(min_workers);
  spec.set_max_workers(max_workers);
  spec.set_step_timeout_ms(3'600'000);
  return spec;
}

// One Session stream with one write in flight at a time. Heartbeats are written from another
// thread, so a hold keeps the stream until its read side has ended: no write can follow OnDone.
class SimWorkers::Worker
    : public grpc::ClientBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage> {
 public:
  Worker(v1::WorkerService::Stub* stub, int index, const std::string& host, Tally* tally)
      : index_(index), tally_(tally) {
    v1::WorkerMessage hello;
    v1::RegisterRequest* r = hello.mutable_register_();
    r->set_name(absl::StrFormat("sim-%05d", index));
    r->set_host(host);
    r->set_device("cpu");
    r->set_device_name("cpu");
    r->set_comm_address("127.0.0.1");
    r->add_capabilities("gloo");
    stub->async()->Session(&context_, this);
    AddHold();
    Send(hello);
    StartRead(&in_);
    StartCall();
  }

  void Heartbeat() {
    v1::WorkerMessage m;
    m.mutable_heartbeat();
    Send(m);
  }
  void Drop() { context_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) return ReleaseHold();
    {
      absl::MutexLock lock(&tally_->mu);
      ++tally_->received;
      if (in_.has_registered()) {
        ++tally_->registered;
        tally_->session_keys[index_] = in_.registered().session_key();
      }
      if (in_.has_assignment() && in_.assignment().has_abort_previous()) {
        ++tally_->aborted[in_.assignment().abort_previous().generation()];
      }
      if (in_.has_assignment()) {
        ++tally_->assigned[in_.assignment().generation()];
        tally_->ranks[index_][in_.assignment().generation()] = in_.assignment().rank();
      }
      if (in_.has_abort()) ++tally_->aborted[in_.abort().generation()];
    }
    StartRead(&in_);
  }
  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    queue_.pop_front();
    if (!ok) {
      queue_.clear();
      broken_ = true;
      return;
    }
    if (!queue_.empty()) StartWrite(&queue_.front());
  }
  void OnDone(const grpc::Status&) override {
    absl::MutexLock lock(&tally_->mu);
    ++tally_->ended;
  }

 private:
  void ReleaseHold() {
    absl::MutexLock lock(&mu_);
    if (released_) return;
    released_ = true;
    RemoveHold();
  }
  void Send(const v1::WorkerMessage& m) {
    absl::MutexLock lock(&mu_);
    if (released_ || broken_ || queue_.size() > 4) return;  // a slow stream skips a beat
    queue_.push_back(m);
    if (queue_.size() == 1) StartWrite(&queue_.front());
  }

  const int index_;
  grpc::ClientContext context_;
  Tally* const tally_;
  v1::CoordinatorMessage in_;
  absl::Mutex mu_;
  std::deque<v1::WorkerMessage> queue_ ABSL_GUARDED_BY(mu_);
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
};

SimWorkers::SimWorkers(const std::string& address, SimWorkersOptions options) {
  const int n = options.workers;
  const int per_channel = std::max(1, options.streams_per_channel);
  for (int i = 0; i < (n + per_channel - 1) / per_channel; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("lockstep.sim.channel", i);  // a distinct connection each
    args.SetMaxReceiveMessageSize(64 << 20);
    auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
    stubs_.push_back(v1::WorkerService::NewStub(channel));
    store_stubs_.push_back(v1::StoreService::NewStub(channel));
  }
  per_channel_ = per_channel;
  {
    absl::MutexLock lock(&tally_.mu);
    tally_.ranks.resize(n);
    tally_.session_keys.resize(n);
  }
  // Hosts dealt round-robin, so registration order interleaves them: ranks are contiguous per
  // host only because the coordinator makes them so.
  const int per_host = std::max(1, options.workers_per_host);
  const int hosts = std::max(1, (n + per_host - 1) / per_host);
  for (int i = 0; i < n; ++i) {
    hosts_.push_back(absl::StrFormat("host-%04d", i % hosts));
    workers_.push_back(std::make_unique<Worker>(stubs_[i / per_channel].get(), i, hosts_.back(),
                                                &tally_));
  }
  heart_ = std::thread([this] {
    while (beating_.load()) {
      for (auto& w : workers_) w->Heartbeat();
      absl::SleepFor(absl::Milliseconds(500));
    }
  });
}

SimWorkers::~SimWorkers() {
  beating_.store(false);
  heart_.join();
  for (auto& w : workers_) w->Drop();
  absl::MutexLock lock(&tally_.mu);
  // Store calls still in flight answer into the tally (their deadlines bound the wait).
  auto store_answered = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(tally_.mu) {
    return tally_.store_answers == tally_.store_started;
  };
  tally_.mu.Await(absl::Condition(&store_answered));
  auto all_ended = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(tally_.mu) {
    return tally_.ended == size();
  };
  tally_.mu.Await(absl::Condition(&all_ended));
}

bool SimWorkers::WaitRegistered(absl::Duration timeout) {
  absl::MutexLock lock(&tally_.mu);
  auto all_registered = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(tally_.mu) {
    return tally_.registered == size();
  };
  return tally_.mu.AwaitWithTimeout(absl::Condition(&all_registered), timeout);
}

bool SimWorkers::WaitCount(std::map<int64_t, int> Tally::*counts, int64_t generation, int count,
                           absl::Duration timeout) {
  absl::MutexLock lock(&tally_.mu);
  auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(tally_.mu) {
    return (tally_.*counts)[generation] >= count;
  };
  return tally_.mu.AwaitWithTimeout(absl::Condition(&reached), timeout);
}

bool SimWorkers::WaitAssigned(int64_t generation, int count, absl::Duration timeout) {
  return WaitCount(&Tally::assigned, generation, count, timeout);
}

bool SimWorkers::WaitAborted(int64_t generation, int count, absl::Duration timeout) {
  return WaitCount(&Tally::aborted, generation, count, timeout);
}

void SimWorkers::Drop(int i) { workers_.at(i)->Drop(); }

const std::string& SimWorkers::host(int i) const { return hosts_.at(i); }

int SimWorkers::RankIn(int i, int64_t generation) {
  absl::MutexLock lock(&tally_.mu);
  const auto& ranks = tally_.ranks.at(i);
  auto it = ranks.find(generation);
  return it == ranks.end() ? -1 : it->second;
}

int SimWorkers::registered() {
  absl::MutexLock lock(&tally_.mu);
  return tally_.registered;
}

int64_t SimWorkers::received() {
  absl::MutexLock lock(&tally_.mu);
  return tally_.received;
}

int SimWorkers::ended() {
  absl::MutexLock lock(&tally_.mu);
  return tally_.ended;
}

struct SimWorkers::StoreCall {
  grpc::ClientContext context;
  v1::StoreWaitRequest request;
  v1::StoreWaitResponse response;
};

int SimWorkers::StartStoreWaits(const std::string& job_id, int64_t generation,
                                const std::string& key, absl::Duration timeout) {
  std::vector<std::pair<int, std::string>> members;  // (worker, session key)
  {
    absl::MutexLock lock(&tally_.mu);
    for (int i = 0; i < size(); ++i) {
      if (tally_.ranks[i].count(generation) > 0) members.emplace_back(i, tally_.session_keys[i]);
    }
  }
  {
    absl::MutexLock lock(&tally_.mu);
    tally_.store_started += static_cast<int>(members.size());
  }
  for (const auto& [i, session_key] : members) {
    auto* call = new StoreCall;
    call->context.AddMetadata(kSessionKeyHeader, session_key);
    call->context.set_deadline(absl::ToChronoTime(absl::Now() + timeout + absl::Seconds(5)));
    call->request.set_job_id(job_id);
    call->request.set_generation(generation);
    call->request.add_keys(key);
    call->request.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
    store_stubs_[i / per_channel_]->async()->Wait(
        &call->context, &call->request, &call->response, [this, call](grpc::Status status) {
          {
            absl::MutexLock lock(&tally_.mu);
            ++tally_.store_answers;
            if (status.ok()) ++tally_.store_ok;
          }
          delete call;
        });
  }
  return static_cast<int>(members.size());
}

absl::Status SimWorkers::StoreSet(int i, const std::string& job_id, int64_t generation,
                                  const std::string& key, const std::string& value) {
  grpc::ClientContext context;
  {
    absl::MutexLock lock(&tally_.mu);
    context.AddMetadata(kSessionKeyHeader, tally_.session_keys.at(i));
  }
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  v1::StoreSetRequest request;
  request.set_job_id(job_id);
  request.set_generation(generation);
  request.set_key(key);
  request.set_value(value);
  v1::StoreSetResponse response;
  const grpc::Status s = store_stubs_[i / per_channel_]->Set(&context, request, &response);
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

bool SimWorkers::WaitStoreAnswers(int count, absl::Duration timeout, int* ok) {
  absl::MutexLock lock(&tally_.mu);
  auto answered = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(tally_.mu) {
    return tally_.store_answers >= count;
  };
  const bool reached = tally_.mu.AwaitWithTimeout(absl::Condition(&answered), timeout);
  *ok = tally_.store_ok;
  return reached;
}

}  // namespace lockstep::bench
