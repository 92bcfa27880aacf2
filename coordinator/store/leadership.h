// Leadership among coordinators that share an etcd (--state_backend=etcd): one leads and
// serves, the others stand by. The leader holds the key PREFIX/leader on an etcd lease that it
// renews; when it dies or freezes past the lease's time to live, etcd deletes the key and a
// standby creates it (a transaction that succeeds only while the key is absent). The key's
// create revision is the leader's term: it grows with every new leader. Every write a leader
// makes carries the fence (AddFence): its term and lease must still own the key, so a deposed
// leader (frozen, cut off) can never write after another has taken over.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/store/etcd_client.h"

namespace lockstep::coordinator {

struct LeadershipOptions {
  std::string prefix;   // e.g. "/lockstep/"
  std::string address;  // what standbys and clients are told: where this coordinator serves
  absl::Duration ttl = absl::Seconds(2);
  absl::Duration poll = absl::Milliseconds(100);  // how often a standby looks at the key
};

// Thread-safe.
class Leadership {
 public:
  // Told while standing by: the leader's address, or why none is known (etcd unreachable).
  using StandbyCallback = std::function<void(const std::string& leader, const std::string& why)>;
  using LostCallback = std::function<void(const std::string& reason)>;

  // Blocks until this coordinator leads (then renews its lease in the background and calls
  // `on_lost` once, from that thread, when leadership is or may be lost), or until `stop`
  // returns true (CANCELLED). Standing by, `on_standby` is called whenever what it sees
  // changes.
  static absl::StatusOr<std::unique_ptr<Leadership>> Campaign(EtcdClient* etcd,
                                                              LeadershipOptions options,
                                                              StandbyCallback on_standby,
                                                              LostCallback on_lost,
                                                              const std::function<bool()>& stop);
  ~Leadership();

  int64_t term() const { return term_; }
  int64_t lease() const { return lease_; }
  const std::string& leader_key() const { return leader_key_; }

  // The compares under which a write is the leader's: the leader key still exists with this
  // term and lease.
  void AddFence(etcdserverpb::TxnRequest* txn) const;

  // A fenced write was refused: leadership is lost (calls on_lost, once).
  void Refused(const std::string& what);
  // A write could not reach etcd: this coordinator cannot keep what it decides, so it gives
  // the leadership up (calls on_lost, once) rather than serve state that is not durable.
  void WriteFailed(const std::string& what);

  // Stops renewing and revokes the lease, so that a standby takes over at once (a clean
  // shutdown). on_lost is not called.
  void Resign();

 private:
  Leadership(EtcdClient* etcd, LeadershipOptions options, int64_t lease, int64_t term,
             absl::Time renewed, LostCallback on_lost);
  void Renew();
  void Lose(const std::string& reason);
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  EtcdClient* const etcd_;
  const LeadershipOptions options_;
  const std::string leader_key_;
  const int64_t lease_;
  const int64_t term_;
  LostCallback on_lost_;
  std::atomic<bool> lost_{false};
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // When the last renewal that succeeded was sent: the lease lives at least `ttl` past it.
  absl::Time renewed_ ABSL_GUARDED_BY(mu_);
  std::thread renewer_;
};

}  // namespace lockstep::coordinator
