// cpp-httplib parses, routes and answers; this file owns the sockets. cpp-httplib's own loop
// gives every accepted connection a pool thread until the connection closes, queues the rest in
// an unbounded FIFO, and times out each read, not each request: forty clients trickling a
// header byte every few seconds, or a few thousand idle connections queued ahead of a real one,
// took a port over, and the idle ones held thousands of descriptors. Here one thread (the
// acceptor) does every wait on a client without blocking, and a handler thread only ever sees a
// request that has arrived whole; each connection has a deadline for its next request, and
// their number is capped.
//
// "Whole" is decided by the acceptor alone: it frames each request by its head (at most
// kMaxHeadBytes) and its one Content-Length (at most max_body_bytes), and the parser reads that
// request from memory and nothing past it. A request whose end cannot be known that way (a
// Transfer-Encoding, two Content-Lengths, a head or a body over the limits, an Expect other than
// 100-continue) is answered by the acceptor and the connection closed, so no client can make a
// handler thread wait on it, or read a body of unbounded length into memory.
//
// A connection's life: accepted (and its TLS handshake done) by the acceptor, it waits for a
// whole request in `waiting_`; then it is `ready_` for a handler thread, which runs cpp-httplib's
// process_request over it (ConnectionStream) and hands it back (`returned_`) to wait for the next
// request or, when it is to close, to linger: its write side shut, what the client still sends
// read and dropped until the client closes or kLinger passes (closing with unread bytes would
// reset the connection, and could destroy the answer before the client read it). Whoever holds
// its unique_ptr owns it; only the acceptor touches `waiting_` and the epoll set.
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
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/atomic_file.h"
#include "common/http_framing.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "httplib.h"

namespace lockstep {
namespace {

// A request head (request line, headers, blank line) must end within this many bytes, or it is
// answered 431 (414 when the request line alone is over cpp-httplib's 8 KiB). Within it,
// cpp-httplib still refuses a single line over 8 KiB itself (414, 400).
constexpr size_t kMaxHeadBytes = 16 << 10;
// A connection that is to close reads and drops what its client still sends for at most this
// long after its write side is shut (and the answer on its way).
constexpr absl::Duration kLinger = absl::Seconds(2);
// What a lingering connection reads per turn of the acceptor: a client sending as fast as it
// can does not keep the acceptor from the others.
constexpr size_t kDrainPerTurn = 64 << 10;
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

enum class Phase {
  kRequest,  // waiting for its next request (and writing a 100 Continue), or being answered
  kRefuse,   // writing the acceptor's answer to a request it refused; then kLinger
  kLinger,   // its write side shut: reading and dropping what the client sends until it closes
};

struct Connection {
  ~Connection() {
    if (ssl != nullptr) {
      // One try at close_notify (the socket is non-blocking), unless ShutDownWrites sent it.
      if (handshaken && !shut) SSL_shutdown(ssl);
      SSL_free(ssl);
    }
    if (fd >= 0) close(fd);
  }
  int fd = -1;
  SSL* ssl = nullptr;  // HTTPS
  bool handshaken = false;
  bool shut = false;  // our side has ended (ShutDownWrites)
  Phase phase = Phase::kRequest;
  // Bytes received and not consumed: the request being waited for or answered, and whatever the
  // client sent after it. The acceptor appends; the parser reads [in_pos, request_end) and
  // nothing else, and once it is done they are erased. So while a connection waits, in_pos is 0.
  std::string in;
  size_t in_pos = 0;
  // The request's framing, found by the acceptor as its bytes arrive. `scanned`: the head's end
  // was looked for in in[0, scanned), and is not there (each read is searched once, not the
  // whole head again). `request_end`: once the head is in, where its body ends; 0 before.
  size_t scanned = 0;
  size_t request_end = 0;
  // What the acceptor writes itself (a 100 Continue, a refusal), from its start: a TLS write
  // that would block must be repeated with the same bytes, so it changes only once written.
  std::string out;
  int served = 0;       // requests answered
  absl::Time deadline;  // while waiting: the whole next request must be here by then
  uint32_t events = 0;  // while waiting: the epoll interest
  std::list<std::unique_ptr<Connection>>::iterator waiting_at;  // while waiting
};

// After an SSL_read or SSL_write that did not complete: kWouldBlock with the poll events TLS
// waits for in *wait, 0 for a TLS close (reads), or kFailed.
ssize_t SslIncomplete(SSL* ssl, int n, short* wait) {
  switch (SSL_get_error(ssl, n)) {
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
  return n > 0 ? n : SslIncomplete(c.ssl, n, wait);
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
  // A TLS close while writing is a failed write, not an end of stream.
  const ssize_t r = SslIncomplete(c.ssl, n, wait);
  return r == 0 ? kFailed : r;
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

// Ends our side of a connection: close_notify (TLS, one try: the socket is non-blocking) and
// FIN, after what was written. The peer may still send; a close then would reset the connection.
void ShutDownWrites(Connection& c) {
  if (c.shut) return;
  c.shut = true;
  if (c.ssl != nullptr && c.handshaken) {
    ERR_clear_error();
    SSL_shutdown(c.ssl);
  }
  shutdown(c.fd, SHUT_WR);
}

// A connection as cpp-httplib's parser reads and writes it. It reads the one request the acceptor
// framed, from memory, and then the end of the stream: never the socket, so a handler thread
// never waits on a client's bytes, and no request is longer than the acceptor allowed. (A POST
// without a Content-Length, which cpp-httplib would read until the client closes, thus has an
// empty body, as HTTP says it has.) Writing the response gives up `timeout` after it began.
class ConnectionStream final : public httplib::Stream {
 public:
  ConnectionStream(Connection& c, absl::Duration timeout) : c_(c), timeout_(timeout) {}

  bool is_readable() const override { return c_.in_pos < c_.request_end; }
  bool is_writable() const override { return WaitFor(c_.fd, POLLOUT, WriteDeadline()); }

  // 0 at the request's end: cpp-httplib reads a head a byte at a time and a body by its length,
  // so it stops there unless the request lacks what it expects (then it fails, 400).
  ssize_t read(char* ptr, size_t size) override {
    const size_t n = std::min(size, c_.request_end - c_.in_pos);
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
  mutable absl::Time write_deadline_ = absl::InfiniteFuture();  // set by the first write
};

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
        const absl::Time deadline =
            now +
            (c->phase == Phase::kLinger ? kLinger : absl::Seconds(options_.keep_alive_seconds));
        Wait(std::move(c), deadline);
      }
      if (accept_paused_until_ != absl::InfinitePast() && now >= accept_paused_until_) {
        accept_paused_until_ = absl::InfinitePast();
        SetListening(true);
        accept = true;
      }
      if (accept) AcceptSome(now);
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        Connection* c = (it++)->get();
        // Idle, trickling, a handshake that never ended, or done lingering.
        if (c->deadline <= now) Close(c);
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

  // Starts waiting for the connection's next request (or the end of its lingering), and takes
  // what has arrived already.
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

  enum class Head { kFramed, kIncomplete, kRefused };

  // Handshakes, writes what the acceptor has to say, and reads as far as the client allows
  // without blocking; hands a request that has arrived whole to the handler threads, and answers
  // one it will not hand over.
  void Advance(Connection* c) {
    if (c->phase == Phase::kLinger) return Drain(c);
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
    // A TLS read cannot come between the tries of one write: the write is finished first.
    if (!Flush(c)) return;
    if (c->phase == Phase::kRefuse) return Linger(c);
    // At most a head and a body, which is as far as a request can go; once the head is in, up
    // to its body's end.
    const size_t limit = kMaxHeadBytes + options_.max_body_bytes;
    bool ended = false;
    while (c->in.size() < (c->request_end != 0 ? c->request_end : limit)) {
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
    if (c->request_end == 0) {
      const Head head = Frame(c);
      if (head == Head::kRefused) return;  // answered, or closed
      if (head == Head::kIncomplete) {
        if (ended) Close(c);
        return;
      }
    }
    // A request sent before the client closed its side is still answered.
    if (c->in.size() >= c->request_end) return Dispatch(c);
    if (ended) return Close(c);
    Flush(c);  // a 100 Continue
  }

  // Looks for the end of the request's head in what has arrived, and frames the request by it:
  // kFramed sets c->request_end. kRefused: the answer is under way, or the connection is closed
  // (c is gone).
  Head Frame(Connection* c) {
    const absl::string_view window =
        absl::string_view(c->in).substr(0, std::min(c->in.size(), kMaxHeadBytes));
    // The end may straddle the previous read: 3 bytes of it can be before c->scanned.
    const size_t end = window.find("\r\n\r\n", c->scanned < 3 ? 0 : c->scanned - 3);
    if (end == absl::string_view::npos) {
      c->scanned = window.size();
      if (window.size() < kMaxHeadBytes) return Head::kIncomplete;
      // Still no end: the request line alone is over cpp-httplib's limit, or the head is.
      const size_t line_end = window.find("\r\n");
      if (line_end == absl::string_view::npos || line_end + 2 > CPPHTTPLIB_REQUEST_URI_MAX_LENGTH) {
        Refuse(
            c, 414,
            absl::StrCat("the request line is over ", CPPHTTPLIB_REQUEST_URI_MAX_LENGTH, " bytes"));
      } else {
        Refuse(c, 431, absl::StrCat("the request head is over ", kMaxHeadBytes, " bytes"));
      }
      return Head::kRefused;
    }
    size_t head_end = end + 4;
    Framing framing = FrameHead(window.substr(0, head_end), options_.max_body_bytes);
    if (framing.refuse != 0) {
      Refuse(c, framing.refuse, framing.why);
      return Head::kRefused;
    }
    for (auto it = framing.expect_lines.rbegin(); it != framing.expect_lines.rend(); ++it) {
      c->in.erase(it->first, it->second - it->first);
      head_end -= it->second - it->first;
    }
    c->request_end = head_end + framing.body;
    if (!framing.expect_lines.empty() && c->in.size() < c->request_end) {
      c->out.append("HTTP/1.1 100 Continue\r\n\r\n");
    }
    return Head::kFramed;
  }

  // Writes c->out as far as the socket takes it: true once all of it is written. False when the
  // rest waits for the socket (the interest is set for it), or the connection failed (closed).
  bool Flush(Connection* c) {
    while (!c->out.empty()) {
      short wait = 0;
      const ssize_t n = WriteOnce(*c, c->out.data(), c->out.size(), &wait);
      if (n > 0) {
        c->out.erase(0, static_cast<size_t>(n));
      } else if (n == kWouldBlock) {
        Interest(c, wait == POLLIN ? EPOLLIN : EPOLLOUT);
        return false;
      } else {
        Close(c);
        return false;
      }
    }
    return true;
  }

  // Answers a request the acceptor will not hand over, and then lingers (Linger). What was read
  // of the request is dropped.
  void Refuse(Connection* c, int status, absl::string_view why) {
    c->out.append(Refusal(status, why));
    c->phase = Phase::kRefuse;
    c->deadline = absl::Now() + kLinger;
    std::string().swap(c->in);
    c->scanned = 0;
    if (Flush(c)) Linger(c);
  }

  void Linger(Connection* c) {
    ShutDownWrites(*c);
    c->phase = Phase::kLinger;
    Interest(c, EPOLLIN);
    Drain(c);
  }

  // Reads and drops what a lingering client sends, and closes the connection once the client
  // has closed its side. The raw socket even under TLS: nothing of it is parsed any more.
  void Drain(Connection* c) {
    char buffer[16 << 10];
    for (size_t drained = 0; drained < kDrainPerTurn; drained += sizeof(buffer)) {
      const ssize_t n = recv(c->fd, buffer, sizeof(buffer), 0);
      if (n > 0) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
      return Close(c);  // the client closed, or the connection failed
    }
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
      Handle(*c);
      {
        absl::MutexLock lock(&mu_);
        --handling_;
        if (!stopping_) returned_.push_back(std::move(c));
      }
      Wake();
      c.reset();  // closed here, outside mu_, when the server stops
    }
  }

  // Answers one request, and readies the connection to wait for the next one or to linger.
  void Handle(Connection& c) {
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
    // What follows the request's framed end belongs to the next one, whatever of the request the
    // parser left unread (the body of a GET).
    c.in.erase(0, c.request_end);
    c.in_pos = 0;
    c.scanned = 0;
    c.request_end = 0;
    if (!ok || closed || last) {
      ShutDownWrites(c);  // here, so that the FIN follows the answer at once
      c.phase = Phase::kLinger;
      std::string().swap(c.in);
    }
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
    LOCKSTEP_RETURN_IF_ERROR(
        WriteFileAtomically(port_file, absl::StrCat(*bound, "\n"), Durability::kVisible));
  }
  LOCKSTEP_RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

}  // namespace lockstep
