// Leader election on an etcd lease: campaign, renew, fence, resign.
#include "coordinator/store/leadership.h"

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace lockstep::coordinator {
namespace {

// Standing by, the lease is renewed this often, and the leader renews its own this often: a
// quarter of its time to live, so two renewals can fail before it is in doubt.
absl::Duration RenewEvery(absl::Duration ttl) { return ttl / 4; }

}  // namespace

absl::StatusOr<std::unique_ptr<Leadership>> Leadership::Campaign(
    EtcdClient* etcd, LeadershipOptions options, StandbyCallback on_standby, LostCallback on_lost,
    const std::function<bool()>& stop) {
  const std::string key = options.prefix + "leader";
  int64_t lease = 0;
  absl::Time renewed = absl::InfinitePast();
  std::string seen_leader = "\x01", seen_why = "\x01";  // nothing reported yet
  auto standby = [&](const std::string& leader, const std::string& why) {
    if (leader == seen_leader && why == seen_why) return;
    seen_leader = leader;
    seen_why = why;
    on_standby(leader, why);
  };
  while (!stop()) {
    const absl::Time now = absl::Now();
    // A lease that may have expired is replaced; one that lives is renewed now and then, so
    // that the attempt below can succeed the moment the key is free.
    if (lease == 0 || now - renewed >= options.ttl) {
      absl::StatusOr<etcdserverpb::LeaseGrantResponse> granted =
          etcd->LeaseGrant(absl::ToInt64Seconds(absl::Ceil(options.ttl, absl::Seconds(1))));
      if (!granted.ok()) {
        standby("", std::string(granted.status().message()));
        absl::SleepFor(options.poll);
        continue;
      }
      lease = granted->id();
      options.ttl = absl::Seconds(granted->ttl());
      renewed = now;
    } else if (now - renewed >= RenewEvery(options.ttl)) {
      absl::StatusOr<int64_t> ttl = etcd->KeepAliveOnce(lease);
      if (ttl.ok() && *ttl > 0) renewed = now;
      if (ttl.ok() && *ttl <= 0) lease = 0;
    }
    if (lease == 0) continue;
    etcdserverpb::TxnRequest txn;
    EtcdClient::AddAbsent(&txn, key);
    etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
    put->set_key(key);
    put->set_value(options.address);
    put->set_lease(lease);
    txn.add_failure()->mutable_request_range()->set_key(key);
    absl::StatusOr<etcdserverpb::TxnResponse> answer = etcd->Txn(txn);
    if (!answer.ok()) {
      standby("", std::string(answer.status().message()));
      absl::SleepFor(options.poll);
      continue;
    }
    int64_t term = 0;
    if (answer->succeeded()) {
      term = answer->header().revision();
    } else if (answer->responses_size() == 1 &&
               answer->responses(0).response_range().kvs_size() == 1) {
      const etcdserverpb::KeyValue& held = answer->responses(0).response_range().kvs(0);
      // Our own key (an earlier attempt succeeded but its answer was lost): we lead.
      if (held.lease() == lease) {
        term = held.create_revision();
      } else if (held.value() == options.address) {
        // This coordinator's previous run, restarted within its lease: not a leader to name.
        standby("",
                "the leader key still holds this coordinator's previous run, until its "
                "lease runs out");
      } else {
        standby(held.value(), "");
      }
    }
    if (term > 0) {
      return std::unique_ptr<Leadership>(
          new Leadership(etcd, std::move(options), lease, term, renewed, std::move(on_lost)));
    }
    absl::SleepFor(options.poll);
  }
  if (lease != 0) (void)etcd->LeaseRevoke(lease);
  return absl::CancelledError("stopped while standing by");
}

Leadership::Leadership(EtcdClient* etcd, LeadershipOptions options, int64_t lease, int64_t term,
                       absl::Time renewed, LostCallback on_lost)
    : etcd_(etcd),
      options_(std::move(options)),
      leader_key_(options_.prefix + "leader"),
      lease_(lease),
      term_(term),
      on_lost_(std::move(on_lost)),
      renewed_(renewed) {
  renewer_ = std::thread([this] { Renew(); });
}

Leadership::~Leadership() {
  Stop();
  if (renewer_.joinable() && renewer_.get_id() != std::this_thread::get_id()) renewer_.join();
  if (renewer_.joinable()) renewer_.detach();
}

void Leadership::Stop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
}

void Leadership::AddFence(etcdserverpb::TxnRequest* txn) const {
  etcdserverpb::Compare* term = txn->add_compare();
  term->set_key(leader_key_);
  term->set_target(etcdserverpb::Compare::CREATE);
  term->set_result(etcdserverpb::Compare::EQUAL);
  term->set_create_revision(term_);
  etcdserverpb::Compare* lease = txn->add_compare();
  lease->set_key(leader_key_);
  lease->set_target(etcdserverpb::Compare::LEASE);
  lease->set_result(etcdserverpb::Compare::EQUAL);
  lease->set_lease(lease_);
}

void Leadership::Refused(const std::string& what) {
  Lose(absl::StrCat(what, " was refused: another coordinator leads now (this one led term ", term_,
                    ")"));
}

void Leadership::WriteFailed(const std::string& what) {
  Lose(absl::StrCat(what, " did not reach etcd (term ", term_, ")"));
}

void Leadership::Lose(const std::string& reason) {
  if (lost_.exchange(true)) return;
  Stop();
  if (on_lost_) on_lost_(reason);
}

void Leadership::Renew() {
  // The first renewal at once: the lease was last renewed while standing by, up to a quarter
  // of its time to live ago.
  for (bool first = true;; first = false) {
    if (!first) {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), RenewEvery(options_.ttl))) return;
    }
    const absl::Time sent = absl::Now();
    absl::StatusOr<int64_t> ttl = etcd_->KeepAliveOnce(lease_);
    absl::Time renewed;
    {
      absl::MutexLock lock(&mu_);
      if (ttl.ok() && *ttl > 0) renewed_ = sent;
      renewed = renewed_;
    }
    if (ttl.ok() && *ttl <= 0) {
      Lose(absl::StrCat("the leader's lease expired (term ", term_, ")"));
      return;
    }
    // Not renewed for the lease's whole time to live (etcd unreachable, or this process was
    // frozen): etcd may have let the lease go and another coordinator may lead.
    if (absl::Now() - renewed >= options_.ttl) {
      Lose(absl::StrCat("the leader's lease was not renewed for ",
                        absl::FormatDuration(absl::Now() - renewed), " (term ", term_,
                        "): ", ttl.ok() ? "this process was not running" : ttl.status().message()));
      return;
    }
  }
}

void Leadership::Resign() {
  lost_.store(true);
  Stop();
  if (renewer_.joinable()) renewer_.join();
  if (absl::Status s = etcd_->LeaseRevoke(lease_); !s.ok()) {
    LOG(WARNING) << "resigning: " << s << " (a standby takes over when the lease expires)";
  }
}

}  // namespace lockstep::coordinator
