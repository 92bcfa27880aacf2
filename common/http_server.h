// A daemon's side port over HTTP (Prometheus metrics, the coordinator's dashboard): a
// cpp-httplib server on HOST:PORT with its own threads, bounded requests and timeouts, so that
// a slow or hostile client can neither stall the daemon's work nor crash it.
#pragma once

#include <cstddef>
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace httplib {
class Server;
}

namespace lockstep {

struct HttpServerOptions {
  // What the port serves ("metrics", "dashboard"): named in errors.
  std::string what = "HTTP";
  // Requests handled at once; more wait for a thread.
  int threads = 1;
  // Request bodies beyond this are answered 413; request lines and headers beyond 8 KiB, 414
  // and 400 (cpp-httplib's limits).
  size_t max_body_bytes = 16 << 10;
  // Reading a request and writing a response each give up after this long.
  int timeout_seconds = 5;
  // An idle keep-alive connection holds a thread this long.
  int keep_alive_seconds = 5;
  // HTTPS with this certificate chain and key (PEM files); empty: plain HTTP. With
  // `tls_client_ca`, every client must present a certificate that CA signed (mutual TLS).
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
};

class HttpServer {
 public:
  // Listens on `address` (HOST:PORT or [IPv6]:PORT; port 0 lets the OS pick) and, with
  // `port_file`, writes the port there once serving. `routes` adds the handlers (and may set an
  // error handler) before the first request. A handler that throws is answered 500, logged, and
  // the server goes on. INVALID_ARGUMENT for a malformed address or a certificate that cannot be
  // loaded, UNAVAILABLE when it cannot listen.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(
      const std::string& address, const std::string& port_file, const HttpServerOptions& options,
      const std::function<void(httplib::Server&)>& routes);
  // Stops listening and waits for the requests in flight.
  ~HttpServer();

  int port() const { return port_; }

 private:
  explicit HttpServer(std::unique_ptr<httplib::Server> server);
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::atomic<bool> listening_done_{false};  // the listen loop has returned
  int port_ = 0;
};

}  // namespace lockstep
