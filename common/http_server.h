// A daemon's side port over HTTP (Prometheus metrics, the coordinator's dashboard): cpp-httplib's
// request parsing, routing and answers, behind a front door of our own that bounds what clients
// can hold, so that a slow or hostile client can neither stall the daemon's work, nor starve the
// port's real requests, nor exhaust its descriptors.
//
// The front door: one thread accepts connections and reads each request (TLS handshake, head, and
// a body up to max_body_bytes) without blocking, and only a complete request reaches one of the
// `threads` handler threads, which read that request from memory and never the socket. An idle or
// trickling connection holds no handler thread and is closed at its deadline; a request whose end
// is not known from its head (see max_body_bytes) is answered at once and closed; beyond
// max_connections, the connection that has waited longest for its request is closed to admit the
// new one (so a flood of idle connections turns over, and a client that sends its request at once
// is served).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace httplib {
class Server;
}

namespace lockstep {

struct HttpServerOptions {
  // What the port serves ("metrics", "dashboard"): named in errors.
  std::string what = "HTTP";
  // Requests handled at once; more wait, whole, for a thread.
  int threads = 1;
  // A request body comes with a Content-Length of at most this; a larger one is answered 413 (a
  // POST without a length has no body). The front door answers, and closes the connection: a head
  // over 16 KiB 431 (414 when its request line is over 8 KiB), a Transfer-Encoding 411, two
  // Content-Lengths 400, an Expect other than 100-continue 417 (a 100-continue it answers
  // itself). Within a head, a request line or header over 8 KiB is answered 414 or 400
  // (cpp-httplib's limits).
  size_t max_body_bytes = 16 << 10;
  // A new connection's first request must have arrived whole within this long. Once handed to a
  // thread, writing its response gives up after it.
  int timeout_seconds = 5;
  // After a response, the next request on the connection must have arrived whole within this
  // long, or the connection is closed.
  int keep_alive_seconds = 5;
  // Requests one connection carries before the server closes it.
  int keep_alive_max_requests = 100;
  // Open connections at most (each holds a descriptor). Beyond it, the connection that has
  // waited longest for its next request is closed; when every one is being answered, the new
  // connection is.
  int max_connections = 64;
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
  // Stops listening, closes the connections that wait, and waits for the requests in flight.
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const;

  class Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  const std::unique_ptr<Impl> impl_;
};

}  // namespace lockstep
