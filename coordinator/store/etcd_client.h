// A client for the part of etcd's v3 API the coordinators' etcd backend uses (proto/etcd), over
// gRPC: key ranges, transactions and leases. One channel per endpoint; a call that finds its
// endpoint unreachable goes on to the next, so one etcd member down costs a caller one failed
// attempt, not an error. Plaintext to http:// endpoints (or HOST:PORT), TLS to https:// ones.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/tls.h"
#include "etcd/rpc.grpc.pb.h"
#include "etcd/rpc.pb.h"

namespace lockstep::coordinator {

// Thread-safe.
class EtcdClient {
 public:
  // `endpoints`: comma-separated, each http://HOST:PORT or HOST:PORT, or all https://HOST:PORT
  // with `tls` (its CA, and a client certificate where etcd asks for one; common/tls.h). Checks
  // that one of them answers (a read of `probe_key`) within `timeout`; the error names every
  // endpoint tried. INVALID_ARGUMENT for https:// without a CA, TLS files with http://
  // endpoints, or a mix.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Connect(const std::string& endpoints,
                                                             const std::string& probe_key,
                                                             absl::Duration timeout,
                                                             const TlsFiles& tls = {});

  // Each call has `call_timeout` per endpoint tried. Errors carry etcd's code and words with
  // the endpoint ("etcd 127.0.0.1:2379: ...").
  absl::StatusOr<etcdserverpb::RangeResponse> Range(const etcdserverpb::RangeRequest& request);
  absl::StatusOr<etcdserverpb::TxnResponse> Txn(const etcdserverpb::TxnRequest& request);
  absl::StatusOr<etcdserverpb::LeaseGrantResponse> LeaseGrant(int64_t ttl_seconds);
  absl::Status LeaseRevoke(int64_t lease);
  // One renewal: the lease's time to live after it, in seconds (<= 0: it had expired).
  absl::StatusOr<int64_t> KeepAliveOnce(int64_t lease);

  const std::string& endpoints() const { return endpoints_text_; }
  void set_call_timeout(absl::Duration timeout) {
    call_timeout_ms_ = absl::ToInt64Milliseconds(timeout);
  }

  // The end of the range of every key that starts with `prefix` (etcd's convention: the
  // prefix with its last byte incremented).
  static std::string PrefixEnd(const std::string& prefix);
  // Adds to `txn` the condition that no key in [key, range_end) exists (range_end empty: the
  // key alone): none was ever created, or it has been deleted since.
  static void AddAbsent(etcdserverpb::TxnRequest* txn, const std::string& key,
                        const std::string& range_end = "");

 private:
  struct Endpoint {
    std::string address;
    std::unique_ptr<etcdserverpb::KV::Stub> kv;
    std::unique_ptr<etcdserverpb::Lease::Stub> lease;
  };
  explicit EtcdClient(std::string endpoints_text) : endpoints_text_(std::move(endpoints_text)) {}

  // Runs `call` on the endpoints from the last one that answered, until one answers with
  // anything but UNAVAILABLE or DEADLINE_EXCEEDED.
  template <typename Call>
  absl::Status OnSomeEndpoint(const char* what, Call call);

  const std::string endpoints_text_;
  std::vector<Endpoint> endpoints_;
  std::atomic<size_t> current_{0};
  std::atomic<int64_t> call_timeout_ms_{1000};
};

}  // namespace lockstep::coordinator
