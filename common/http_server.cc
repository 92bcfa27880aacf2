// cpp-httplib parses, routes and answers; this file owns the sockets. cpp-httplib's own loop
// gives every accepted connection a pool thread until the connection closes, queues the rest in
// an unbounded FIFO, and times out each read, not each request: forty clients trickling a
// header byte every few seconds, or a few thousand idle connections queued ahead of a real one,
// took a port over, and the idle ones held thousands of descriptors. Here one thread (the
// acceptor) does every wait on a client without blocking, and a handler thread only ever sees a
// request that has arrived whole; each connection has a deadline for its next request, and
// their number is capped.
//
// A connection's life: accepted (and its TLS handshake done) by the acceptor, it waits for a
// whole request in `waiting_`; then it is `ready_` for a handler thread, which runs cpp-httplib's
// process_request over it (ConnectionStream) and hands it back to wait for the next request
// (`returned_`), or closes it. Whoever holds its unique_ptr owns it; only the acceptor touches
// `waiting_` and the epoll set.
#include "common/http_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <deque>
#include <exception>
#include <list>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/atomic_file.h"
#include "glog/logging.h"
#include "httplib.h"

namespace lockstep {
namespace {

// A request head that has not ended by this size is handed to the parser as it is: cpp-httplib
// refuses a request line or a header over 8 KiB (414, 400), and reads on, under the request's
// deadline, through a head of many small headers.
constexpr size_t kMaxHeadBytes = 16 << 10;
// The kernel queues this many connections the acceptor has not taken yet (cpp-httplib's 5
// turned clients away during a burst before the acceptor could choose whom to keep).
constexpr int kListenBacklog = 1024;
// Connections accepted per turn of the acceptor, between which it reads the ones it has: a
// burst of connections cannot push a waiting request past its turn.
constexpr int kAcceptBatch = 64;
// Out of descriptors: the listening socket rests this long instead of spinning on accept.
constexpr absl::Duration kAcceptPause = absl::Milliseconds(100);

constexpr ssize_t kWouldBlock = -1;
constexpr ssize_t kFailed = -2;

struct Connection {
  ~Connection() {
    if (ssl != nullptr) {
      if (handshaken) SSL_shutdown(ssl);  // one try at close_notify; the socket is non-blocking
      SSL_free(ssl);
    }
    if (fd >= 0) close(fd);
  }
  int fd = -1;
  SSL* ssl = nullptr;  // HTTPS
  bool handshaken = false;
  // Bytes received and not parsed yet, from in_pos on: read ahead by the acceptor (the request
  // it waited for) or by a handler (a pipelined next request).
  std::string in;
  size_t in_pos = 0;
  int served = 0;       // requests answered
  absl::Time deadline;  // while waiting: the whole next request must be here by then
  uint32_t events = 0;  // while waiting: the epoll interest
  std::list<std::unique_ptr<Connection>>::iterator waiting_at;  // while waiting
};

// One read that does not block: the bytes read, 0 at the end of the stream, kWouldBlock (with
// the poll events to wait for in *wait: TLS may need to write to read) or kFailed.
ssize_t ReadOnce(Connection& c, char* buffer, size_t size, short* wait) {
  if (c.ssl == nullptr) {
    const ssize_t n = recv(c.fd, buffer, size, 0);
    if (n >= 0) return n;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      *wait = POLLIN;
      return kWouldBlock;
    }
    return kFailed;
  }
  ERR_clear_error();
  const int n = SSL_read(c.ssl, buffer, static_cast<int>(std::min<size_t>(size, INT_MAX)));
  if (n > 0) return n;
  switch (SSL_get_error(c.ssl, n)) {
    case SSL_ERROR_WANT_READ:
      *wait = POLLIN;
      return kWouldBlock;
    case SSL_ERROR_WANT_WRITE:
      *wait = POLLOUT;
      return kWouldBlock;
    case SSL_ERROR_ZERO_RETURN:
      return 0;
    default:
      return kFailed;
  }
}

// The same for a write. A TLS write that would block must be repeated with the same bytes.
ssize_t WriteOnce(Connection& c, const char* data, size_t size, short* wait) {
  if (c.ssl == nullptr) {
    const ssize_t n = send(c.fd, data, size, MSG_NOSIGNAL);
    if (n >= 0) return n;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      *wait = POLLOUT;
      return kWouldBlock;
    }
    return kFailed;
  }
  if (size == 0) return 0;
  ERR_clear_error();
  const int n = SSL_write(c.ssl, data, static_cast<int>(std::min<size_t>(size, INT_MAX)));
  if (n > 0) return n;
  switch (SSL_get_error(c.ssl, n)) {
    case SSL_ERROR_WANT_READ:
      *wait = POLLIN;
      return kWouldBlock;
    case SSL_ERROR_WANT_WRITE:
      *wait = POLLOUT;
      return kWouldBlock;
    default:
      return kFailed;
  }
}

// Waits until `fd` is ready for `events` or `deadline` passes; false then (or on an error).
bool WaitFor(int fd, short events, absl::Time deadline) {
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    pollfd p{fd, events, 0};
    // +1: a wait of less than a millisecond must not become a busy loop.
    const int r = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
    if (r > 0) return true;  // ready, or an error that the next call reports
    if (r < 0 && errno != EINTR) return false;
  }
}

void AddressOf(int fd, bool peer, std::string& ip, int& port) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  const int r = peer ? getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length)
                     : getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  ip.clear();
  port = 0;
  if (r != 0) return;
  char text[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&address);
    inet_ntop(AF_INET, &v4->sin_addr, text, sizeof(text));
    port = ntohs(v4->sin_port);
  } else if (address.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&address);
    inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof(text));
    port = ntohs(v6->sin6_port);
  }
  ip = text;
}

// A connection as cpp-httplib's parser reads and writes it: first the bytes read ahead, then
// the socket, every wait bounded by the request's deadlines (reading the rest of the request,
// and writing the response, each within `timeout` of their start).
class ConnectionStream final : public httplib::Stream {
 public:
  ConnectionStream(Connection& c, absl::Duration timeout)
      : c_(c), timeout_(timeout), read_deadline_(absl::Now() + timeout) {}

  bool is_readable() const override {
    if (c_.in_pos < c_.in.size()) return true;
    if (c_.ssl != nullptr && SSL_pending(c_.ssl) > 0) return true;
    return WaitFor(c_.fd, POLLIN, read_deadline_);
  }
  bool is_writable() const override { return WaitFor(c_.fd, POLLOUT, WriteDeadline()); }

  // cpp-httplib reads a head a byte at a time: it is served from c_.in, refilled 4 KiB at once.
  ssize_t read(char* ptr, size_t size) override {
    if (c_.in_pos == c_.in.size()) {
      c_.in.clear();
      c_.in_pos = 0;
      char buffer[4096];
      while (true) {
        short wait = 0;
        const ssize_t n = ReadOnce(c_, buffer, sizeof(buffer), &wait);
        if (n > 0) {
          c_.in.append(buffer, static_cast<size_t>(n));
          break;
        }
        if (n == 0) return 0;
        if (n == kFailed || !WaitFor(c_.fd, wait, read_deadline_)) return -1;
      }
    }
    const size_t n = std::min(size, c_.in.size() - c_.in_pos);
    std::memcpy(ptr, c_.in.data() + c_.in_pos, n);
    c_.in_pos += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    const absl::Time deadline = WriteDeadline();
    while (true) {
      short wait = 0;
      const ssize_t n = WriteOnce(c_, ptr, size, &wait);
      if (n >= 0) return n;
      if (n == kFailed || !WaitFor(c_.fd, wait, deadline)) return -1;
    }
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    AddressOf(c_.fd, /*peer=*/true, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    AddressOf(c_.fd, /*peer=*/false, ip, port);
  }
  socket_t socket() const override { return c_.fd; }

 private:
  absl::Time WriteDeadline() const {
    if (write_deadline_ == absl::InfiniteFuture()) write_deadline_ = absl::Now() + timeout_;
    return write_deadline_;
  }

  Connection& c_;
  const absl::Duration timeout_;
  const absl::Time read_deadline_;
  mutable absl::Time write_deadline_ = absl::InfiniteFuture();  // set by the first write
};

// Whether `in` holds a request the parser can take without waiting on the client: a whole head
// and the body its Content-Length announces. A head too large, a body over the limit, a chunked
// body or one sent only after "100 Continue" go to the parser at once: it refuses the first two
// without reading them, and reads the others under the request's deadline.
bool RequestArrived(absl::string_view in, size_t max_body_bytes) {
  const size_t end = in.find("\r\n\r\n");
  if (end == absl::string_view::npos) return in.size() >= kMaxHeadBytes;
  size_t body = 0;
  for (absl::string_view line : absl::StrSplit(in.substr(0, end), "\r\n")) {
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos) continue;
    const absl::string_view name = absl::StripAsciiWhitespace(line.substr(0, colon));
    const absl::string_view value = absl::StripAsciiWhitespace(line.substr(colon + 1));
    if (absl::EqualsIgnoreCase(name, "transfer-encoding") ||
        absl::EqualsIgnoreCase(name, "expect")) {
      return true;
    }
    if (absl::EqualsIgnoreCase(name, "content-length") && !absl::SimpleAtoi(value, &body)) {
      return true;  // malformed: the parser says so
    }
  }
  return body > max_body_bytes || in.size() - (end + 4) >= body;
}

// cpp-httplib's request handling (parse, route, answer) over one of our streams; its own accept
// loop is never started.
template <typename Base>
class Router final : public Base {
 public:
  using Base::Base;
  bool Process(httplib::Stream& stream, bool close_connection, bool& connection_closed, SSL* ssl) {
    return this->process_request(stream, close_connection, connection_closed,
                                 [ssl](httplib::Request& request) { request.ssl = ssl; });
  }
};

}  // namespace

class HttpServer::Impl {
 public:
  using Process = std::function<bool(httplib::Stream&, bool, bool&, SSL*)>;

  Impl(HttpServerOptions options, std::unique_ptr<httplib::Server> router, Process process,
       SSL_CTX* ssl_ctx)
      : options_(std::move(options)),
        router_(std::move(router)),
        process_(std::move(process)),
        ssl_ctx_(ssl_ctx) {}

  ~Impl() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      work_.SignalAll();
    }
    Wake();
    if (acceptor_.joinable()) acceptor_.join();
    // Each finishes the request it is answering (bounded by its deadlines) and takes no other.
    for (std::thread& t : handlers_) t.join();
    for (int fd : {listen_fd_, epoll_fd_, wake_fd_}) {
      if (fd >= 0) close(fd);
    }
  }

  httplib::Server& router() { return *router_; }
  int port() const { return port_; }

  // Listens on host:port; the port it got.
  absl::StatusOr<int> Listen(const std::string& host, int port) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    if (getaddrinfo(host.empty() ? nullptr : host.c_str(), std::to_string(port).c_str(), &hints,
                    &found) != 0) {
      return absl::UnavailableError("no such address");
    }
    for (addrinfo* ai = found; ai != nullptr && listen_fd_ < 0; ai = ai->ai_next) {
      const int fd =
          socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
      if (fd < 0) continue;
      // SO_REUSEADDR only: with SO_REUSEPORT (cpp-httplib's default) a second daemon given the
      // same port would share it silently instead of failing.
      int yes = 1;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
      if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, kListenBacklog) == 0) {
        listen_fd_ = fd;
      } else {
        close(fd);
      }
    }
    freeaddrinfo(found);
    if (listen_fd_ < 0) return absl::UnavailableError("cannot bind");
    std::string ip;
    AddressOf(listen_fd_, /*peer=*/false, ip, port_);
    return port_;
  }

  absl::Status Start() {
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (epoll_fd_ < 0 || wake_fd_ < 0) {
      return absl::UnavailableError(absl::StrCat(options_.what, ": epoll: ", strerror(errno)));
    }
    epoll_event listen_event{};
    listen_event.events = EPOLLIN;
    listen_event.data.ptr = &listen_fd_;
    epoll_event wake_event{};
    wake_event.events = EPOLLIN;
    wake_event.data.ptr = &wake_fd_;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &listen_event) != 0 ||
        epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &wake_event) != 0) {
      return absl::UnavailableError(absl::StrCat(options_.what, ": epoll: ", strerror(errno)));
    }
    for (int i = 0; i < std::max(1, options_.threads); ++i) {
      handlers_.emplace_back([this] { RunHandler(); });
    }
    acceptor_ = std::thread([this] { RunAcceptor(); });
    return absl::OkStatus();
  }

 private:
  void Wake() {
    const uint64_t one = 1;
    if (wake_fd_ >= 0) (void)!::write(wake_fd_, &one, sizeof(one));
  }

  // --- The acceptor's thread. ---

  void RunAcceptor() {
    std::vector<epoll_event> events(256);
    while (true) {
      const int n =
          epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), NextTimeoutMs());
      bool accept = false;
      // Connections first, then new ones: a burst of connections is accepted after the
      // requests that have arrived are taken, so it cannot push them out (Admit).
      for (int i = 0; i < n; ++i) {
        void* tag = events[i].data.ptr;
        if (tag == &listen_fd_) {
          accept = true;
        } else if (tag == &wake_fd_) {
          uint64_t count = 0;
          (void)!::read(wake_fd_, &count, sizeof(count));
        } else {
          Advance(static_cast<Connection*>(tag));
        }
      }
      std::vector<std::unique_ptr<Connection>> back;
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) break;
        back.swap(returned_);
      }
      const absl::Time now = absl::Now();
      for (auto& c : back) {
        Wait(std::move(c), now + absl::Seconds(options_.keep_alive_seconds));
      }
      if (accept_paused_until_ != absl::InfinitePast() && now >= accept_paused_until_) {
        accept_paused_until_ = absl::InfinitePast();
        SetListening(true);
        accept = true;
      }
      if (accept) AcceptSome(now);
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        Connection* c = (it++)->get();
        if (c->deadline <= now) Close(c);  // idle, trickling, or a handshake that never ended
      }
    }
    waiting_.clear();
  }

  // Until the earliest deadline of a waiting connection, at most a second.
  int NextTimeoutMs() const {
    absl::Time next = absl::Now() + absl::Seconds(1);
    for (const auto& c : waiting_) next = std::min(next, c->deadline);
    if (accept_paused_until_ != absl::InfinitePast()) next = std::min(next, accept_paused_until_);
    return static_cast<int>(
        std::max<int64_t>(0, absl::ToInt64Milliseconds(next - absl::Now()) + 1));
  }

  void SetListening(bool on) {
    epoll_event event{};
    event.events = on ? static_cast<uint32_t>(EPOLLIN) : 0u;
    event.data.ptr = &listen_fd_;
    epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, &event);
  }

  void AcceptSome(absl::Time now) {
    for (int i = 0; i < kAcceptBatch; ++i) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // The process (or the system) is out of descriptors: the connections wait in the
          // kernel's queue, and the listening socket rests instead of waking this loop at once.
          LOG_EVERY_N(WARNING, 100) << options_.what << ": cannot accept: " << strerror(errno);
          accept_paused_until_ = now + kAcceptPause;
          SetListening(false);
        }
        return;  // EAGAIN: none left
      }
      // Headers and body go out as two writes: without this, the second waits for the
      // client's delayed acknowledgement of the first on a kept-alive connection.
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      auto c = std::make_unique<Connection>();
      c->fd = fd;
      if (!Admit()) continue;  // closes it
      if (ssl_ctx_ != nullptr) {
        c->ssl = SSL_new(ssl_ctx_);
        if (c->ssl == nullptr || SSL_set_fd(c->ssl, fd) != 1) continue;
        SSL_set_accept_state(c->ssl);
      } else {
        c->handshaken = true;
      }
      Wait(std::move(c), now + absl::Seconds(options_.timeout_seconds));
    }
  }

  // Makes room for one more connection: false when there is none to make (every connection
  // is being answered; the new one is closed). The one closed otherwise is the one that has
  // waited longest for its request, an idle or a trickling client: a real client sends its
  // request as it connects, and is answered before it could become the oldest.
  bool Admit() {
    int handling = 0;
    {
      absl::MutexLock lock(&mu_);
      handling = handling_ + static_cast<int>(returned_.size());
    }
    if (static_cast<int>(waiting_.size()) + handling < options_.max_connections) return true;
    const bool evict = !waiting_.empty();
    if (evict) Close(waiting_.front().get());
    if (++turned_away_ == 1 || turned_away_ % 1000 == 0) {
      LOG(WARNING) << options_.what << ": " << options_.max_connections
                   << " connections open (the most it keeps): "
                   << (evict ? "closed the one that waited longest for its request"
                             : "every one is being answered; refused a new one")
                   << " (" << turned_away_ << " so far)";
    }
    return evict;
  }

  // Starts waiting for the connection's next request, and takes what has arrived already.
  void Wait(std::unique_ptr<Connection> owned, absl::Time deadline) {
    Connection* c = owned.get();
    c->deadline = deadline;
    c->events = EPOLLIN;
    waiting_.push_back(std::move(owned));
    c->waiting_at = std::prev(waiting_.end());
    epoll_event event{};
    event.events = c->events;
    event.data.ptr = c;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, c->fd, &event) != 0) return Close(c);
    Advance(c);
  }

  // Handshakes and reads as far as the client allows without blocking, and hands a request
  // that has arrived to the handler threads.
  void Advance(Connection* c) {
    if (!c->handshaken) {
      ERR_clear_error();
      const int r = SSL_accept(c->ssl);
      if (r != 1) {
        const int error = SSL_get_error(c->ssl, r);
        if (error == SSL_ERROR_WANT_READ) return Interest(c, EPOLLIN);
        if (error == SSL_ERROR_WANT_WRITE) return Interest(c, EPOLLOUT);
        return Close(c);  // not TLS, no client certificate, ...
      }
      c->handshaken = true;
    }
    // At most a head and a body, which is as far as the parser needs (RequestArrived).
    const size_t limit = kMaxHeadBytes + options_.max_body_bytes;
    bool ended = false;
    while (c->in.size() - c->in_pos < limit) {
      char buffer[4096];
      short wait = 0;
      const ssize_t n = ReadOnce(*c, buffer, sizeof(buffer), &wait);
      if (n > 0) {
        c->in.append(buffer, static_cast<size_t>(n));
        continue;
      }
      if (n == kWouldBlock) {
        Interest(c, wait == POLLOUT ? EPOLLOUT : EPOLLIN);
      } else {
        ended = true;  // the end of the stream, or an error
      }
      break;
    }
    const absl::string_view unread = absl::string_view(c->in).substr(c->in_pos);
    // A request sent before the client closed its side is still answered.
    if (unread.size() >= limit || RequestArrived(unread, options_.max_body_bytes)) {
      return Dispatch(c);
    }
    if (ended) Close(c);
  }

  void Interest(Connection* c, uint32_t events) {
    if (c->events == events) return;
    c->events = events;
    epoll_event event{};
    event.events = events;
    event.data.ptr = c;
    epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c->fd, &event);
  }

  void Dispatch(Connection* c) {
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
    std::unique_ptr<Connection> owned = std::move(*c->waiting_at);
    waiting_.erase(c->waiting_at);
    absl::MutexLock lock(&mu_);
    ready_.push_back(std::move(owned));
    ++handling_;
    work_.Signal();
  }

  void Close(Connection* c) {
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
    waiting_.erase(c->waiting_at);  // the destructor closes the socket
  }

  // --- The handler threads. ---

  void RunHandler() {
    while (true) {
      std::unique_ptr<Connection> c;
      {
        absl::MutexLock lock(&mu_);
        while (ready_.empty() && !stopping_) work_.Wait(&mu_);
        if (stopping_) return;  // what waits in ready_ is closed unanswered
        c = std::move(ready_.front());
        ready_.pop_front();
      }
      const bool keep = Handle(*c);
      {
        absl::MutexLock lock(&mu_);
        --handling_;
        if (keep && !stopping_) returned_.push_back(std::move(c));
      }
      if (keep) Wake();
      c.reset();  // closed here, outside mu_, unless handed back
    }
  }

  // Answers one request; whether the connection is kept for the next one.
  bool Handle(Connection& c) {
    ConnectionStream stream(c, absl::Seconds(options_.timeout_seconds));
    const bool last = c.served + 1 >= options_.keep_alive_max_requests;
    bool closed = false;
    bool ok = false;
    try {
      ok = process_(stream, last, closed, c.ssl);
    } catch (const std::exception& e) {  // the handlers' own are answered 500 by cpp-httplib
      LOG(ERROR) << options_.what << ": a request failed: " << e.what();
    } catch (...) {
      LOG(ERROR) << options_.what << ": a request failed";
    }
    ++c.served;
    if (!ok || closed || last) return false;
    c.in.erase(0, c.in_pos);  // what is left belongs to the next request
    c.in_pos = 0;
    return true;
  }

  const HttpServerOptions options_;
  const std::unique_ptr<httplib::Server> router_;  // its own listener is never started
  const Process process_;
  SSL_CTX* const ssl_ctx_;  // owned by router_ (an SSLServer); null for HTTP
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;  // counts connections handed back, and the stop
  int port_ = 0;
  std::thread acceptor_;
  std::vector<std::thread> handlers_;

  // The acceptor's thread only.
  std::list<std::unique_ptr<Connection>> waiting_;  // oldest wait first
  absl::Time accept_paused_until_ = absl::InfinitePast();
  int64_t turned_away_ = 0;  // connections closed to make room, or refused

  absl::Mutex mu_;
  absl::CondVar work_;  // ready_ has one, or stopping_
  std::deque<std::unique_ptr<Connection>> ready_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Connection>> returned_ ABSL_GUARDED_BY(mu_);
  int handling_ ABSL_GUARDED_BY(mu_) = 0;  // in ready_ or on a handler thread
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() = default;

int HttpServer::port() const { return impl_->port(); }

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
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.what, ": TLS needs both a certificate and its key"));
  }
  std::unique_ptr<httplib::Server> router;
  Impl::Process process;
  SSL_CTX* ssl_ctx = nullptr;
  if (!options.tls_cert.empty()) {
    auto tls = std::make_unique<Router<httplib::SSLServer>>(
        options.tls_cert.c_str(), options.tls_key.c_str(),
        options.tls_client_ca.empty() ? nullptr : options.tls_client_ca.c_str());
    if (!tls->is_valid()) {
      return absl::InvalidArgumentError(absl::StrCat(
          options.what, ": cannot load the TLS certificate ", options.tls_cert, " with the key ",
          options.tls_key, options.tls_client_ca.empty() ? "" : " and the client CA ",
          options.tls_client_ca, " (unreadable, not PEM, or not a pair)"));
    }
    ssl_ctx = tls->ssl_context();
    process = [r = tls.get()](httplib::Stream& s, bool close, bool& closed, SSL* ssl) {
      return r->Process(s, close, closed, ssl);
    };
    router = std::move(tls);
  } else {
    auto plain = std::make_unique<Router<httplib::Server>>();
    process = [r = plain.get()](httplib::Stream& s, bool close, bool& closed, SSL* ssl) {
      return r->Process(s, close, closed, ssl);
    };
    router = std::move(plain);
  }
  auto impl = std::make_unique<Impl>(options, std::move(router), std::move(process), ssl_ctx);
  httplib::Server& server = impl->router();
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
  absl::StatusOr<int> bound = impl->Listen(host, port);
  if (!bound.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot serve ", options.what, " on ", address,
                                               " (address in use or not this host's?)"));
  }
  // The port file first: the socket already accepts connections, and a failure here returns
  // before any thread runs.
  if (!port_file.empty()) {
    if (absl::Status s =
            WriteFileAtomically(port_file, absl::StrCat(*bound, "\n"), Durability::kVisible);
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = impl->Start(); !s.ok()) return s;
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

}  // namespace lockstep
