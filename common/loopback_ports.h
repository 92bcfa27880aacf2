// Ports for processes that take no port 0 (etcd), for tests and benchmarks on loopback.
#pragma once

#include <vector>

namespace lockstep {

// `n` distinct TCP ports free on 127.0.0.1 now: each is bound (port 0) and held until all are
// chosen, then released. Another process may still take one before the caller binds it.
std::vector<int> FreeLoopbackPorts(int n);

}  // namespace lockstep
