#include "common/http_server.h"

#include <sys/socket.h>

#include <chrono>
#include <exception>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "glog/logging.h"
#include "httplib.h"

namespace lockstep {

HttpServer::HttpServer(std::unique_ptr<httplib::Server> server) : server_(std::move(server)) {}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(
    const std::string& address, const std::string& port_file, const HttpServerOptions& options,
    const std::function<void(httplib::Server&)>& routes) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.what, " address \"", address, "\" is not HOST:PORT"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);  // [::1]:9400
  }
  std::unique_ptr<httplib::Server> plain_or_tls;
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.what, ": TLS needs both a certificate and its key"));
  }
  if (!options.tls_cert.empty()) {
    auto tls = std::make_unique<httplib::SSLServer>(
        options.tls_cert.c_str(), options.tls_key.c_str(),
        options.tls_client_ca.empty() ? nullptr : options.tls_client_ca.c_str());
    if (!tls->is_valid()) {
      return absl::InvalidArgumentError(
          absl::StrCat(options.what, ": cannot load the TLS certificate ", options.tls_cert,
                       " with the key ", options.tls_key,
                       options.tls_client_ca.empty() ? "" : " and the client CA ",
                       options.tls_client_ca, " (unreadable, not PEM, or not a pair)"));
    }
    plain_or_tls = std::move(tls);
  } else {
    plain_or_tls = std::make_unique<httplib::Server>();
  }
  std::unique_ptr<HttpServer> http(new HttpServer(std::move(plain_or_tls)));
  httplib::Server& server = *http->server_;
  const int threads = std::max(1, options.threads);
  server.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, with which a second daemon
  // given the same port would share it silently instead of failing.
  server.set_socket_options([](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server.set_read_timeout(options.timeout_seconds, 0);
  server.set_write_timeout(options.timeout_seconds, 0);
  server.set_keep_alive_timeout(options.keep_alive_seconds);
  server.set_payload_max_length(options.max_body_bytes);
  server.set_exception_handler([what = options.what](const httplib::Request& request,
                                                     httplib::Response& response,
                                                     std::exception_ptr error) {
    std::string message = "unknown error";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
    }
    LOG(ERROR) << what << ": " << request.method << " " << request.path << " failed: " << message;
    response.status = 500;
    response.set_content(absl::StrCat("internal error: ", message, "\n"), "text/plain");
  });
  routes(server);
  const int bound = port == 0 ? server.bind_to_any_port(host)
                              : (server.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve ", options.what, " on ", address,
                                               " (address in use or not this host's?)"));
  }
  http->port_ = bound;
  // The port file first: the socket already accepts connections, and a failure here returns
  // before any thread runs.
  if (!port_file.empty()) {
    if (absl::Status s =
            WriteFileAtomically(port_file, absl::StrCat(bound, "\n"), Durability::kVisible);
        !s.ok()) {
      return s;
    }
  }
  HttpServer* self = http.get();
  http->thread_ = std::thread([self] {
    self->server_->listen_after_bind();
    self->listening_done_ = true;
  });
  return http;
}

HttpServer::~HttpServer() {
  if (thread_.joinable()) {
    // stop() does nothing until the listen loop has started: repeat it until the loop ends.
    while (!listening_done_) {
      server_->stop();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    thread_.join();
  }
}

}  // namespace lockstep
