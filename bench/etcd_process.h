// A one-member etcd that a benchmark starts on loopback (Debian's /usr/bin/etcd, free ports, a
// data directory of its own), and the counters it exposes on /metrics that say what its
// clients wrote.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace lockstep::bench {

// What etcd has served since it started (its Prometheus counters).
struct EtcdCounters {
  int64_t txns = 0;            // Txn calls answered (grpc_server_handled_total, method Txn)
  int64_t puts = 0;            // keys written (etcd_mvcc_put_total, puts inside transactions too)
  int64_t received_bytes = 0;  // bytes received from gRPC clients
  EtcdCounters operator-(const EtcdCounters& o) const {
    return {txns - o.txns, puts - o.puts, received_bytes - o.received_bytes};
  }
};

class EtcdProcess {
 public:
  // Starts etcd with its data and log under `dir` and waits until it answers /health.
  static absl::StatusOr<std::unique_ptr<EtcdProcess>> Start(const std::string& binary,
                                                            const std::string& dir);
  ~EtcdProcess();  // kills it and removes `dir`
  // http://127.0.0.1:PORT, for --etcd_endpoints.
  const std::string& endpoint() const { return endpoint_; }
  absl::StatusOr<EtcdCounters> Counters() const;

 private:
  EtcdProcess() = default;
  pid_t pid_ = 0;
  int port_ = 0;
  std::string dir_, endpoint_;
};

}  // namespace lockstep::bench
