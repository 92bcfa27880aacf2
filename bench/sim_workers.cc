#include "bench/sim_workers.h"

#include <deque>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/client_callback.h"

namespace lockstep::bench {

v1::JobSpec SimulatedJob(int min_workers, int max_workers) {
  v1::JobSpec spec;
  spec.set_name("simulated");
  spec.mutable_model()->set_type("mlp");
  spec.mutable_model()->add_hidden_widths(16);
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
      if (in_.has_registered()) ++tally_->registered;
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
    stubs_.push_back(v1::WorkerService::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args)));
  }
  {
    absl::MutexLock lock(&tally_.mu);
    tally_.ranks.resize(n);
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

int SimWorkers::ended() {
  absl::MutexLock lock(&tally_.mu);
  return tally_.ended;
}

}  // namespace lockstep::bench
