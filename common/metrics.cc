#include "common/metrics.h"

#include <sys/socket.h>

#include <exception>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "httplib.h"
#include "prometheus/text_serializer.h"

namespace lockstep {
namespace {

prometheus::MetricFamily Family(std::string name, std::string help, prometheus::MetricType type,
                                const std::vector<std::pair<Labels, double>>& samples) {
  prometheus::MetricFamily family;
  family.name = std::move(name);
  family.help = std::move(help);
  family.type = type;
  for (const auto& [labels, value] : samples) {
    prometheus::ClientMetric metric;
    for (const auto& [key, label_value] : labels) metric.label.push_back({key, label_value});
    if (type == prometheus::MetricType::Counter) {
      metric.counter.value = value;
    } else {
      metric.gauge.value = value;
    }
    family.metric.push_back(std::move(metric));
  }
  return family;
}

}  // namespace

MetricsEndpoint::MetricsEndpoint()
    : server_(std::make_unique<httplib::Server>()),
      registry_(std::make_shared<prometheus::Registry>()) {}

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& address, const std::string& port_file) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", address, "\" is not HOST:PORT"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);  // [::1]:9400
  }
  std::unique_ptr<MetricsEndpoint> endpoint(new MetricsEndpoint());
  httplib::Server& server = *endpoint->server_;
  // One thread: a scrape is small, and Prometheus scrapes each target one at a time.
  server.new_task_queue = [] { return new httplib::ThreadPool(1); };
  // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, with which a second daemon
  // given the same port would share it silently instead of failing.
  server.set_socket_options([](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server.set_read_timeout(5, 0);
  server.set_write_timeout(5, 0);
  MetricsEndpoint* self = endpoint.get();
  server.Get("/metrics", [self](const httplib::Request&, httplib::Response& response) {
    response.set_content(self->Scrape(), "text/plain; version=0.0.4; charset=utf-8");
  });
  server.set_error_handler([](const httplib::Request& request, httplib::Response& response) {
    if (response.status == 404) {
      response.set_content(absl::StrCat("no ", request.path, " here: metrics are at /metrics\n"),
                           "text/plain");
    }
  });
  const int bound = port == 0 ? server.bind_to_any_port(host) : (server.bind_to_port(host, port)
                                                                      ? port
                                                                      : -1);
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address,
                                               " (address in use or not this host's?)"));
  }
  endpoint->port_ = bound;
  endpoint->thread_ = std::thread([self] { self->server_->listen_after_bind(); });
  if (!port_file.empty()) {
    if (absl::Status s = WriteFileAtomically(port_file, absl::StrCat(bound, "\n"),
                                             Durability::kVisible);
        !s.ok()) {
      return s;
    }
  }
  return endpoint;
}

MetricsEndpoint::~MetricsEndpoint() {
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

void MetricsEndpoint::Add(std::shared_ptr<prometheus::Collectable> collectable) {
  absl::MutexLock lock(&mu_);
  collectables_.push_back(std::move(collectable));
}

std::string MetricsEndpoint::Scrape() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables;
  {
    absl::MutexLock lock(&mu_);
    collectables = collectables_;
  }
  for (const auto& c : collectables) {
    std::vector<prometheus::MetricFamily> more = c->Collect();
    families.insert(families.end(), std::make_move_iterator(more.begin()),
                    std::make_move_iterator(more.end()));
  }
  return prometheus::TextSerializer().Serialize(families);
}

prometheus::MetricFamily GaugeFamily(std::string name, std::string help,
                                     const std::vector<std::pair<Labels, double>>& samples) {
  return Family(std::move(name), std::move(help), prometheus::MetricType::Gauge, samples);
}

prometheus::MetricFamily CounterFamily(std::string name, std::string help,
                                       const std::vector<std::pair<Labels, double>>& samples) {
  return Family(std::move(name), std::move(help), prometheus::MetricType::Counter, samples);
}

std::vector<double> SecondsBuckets() {
  std::vector<double> buckets;
  for (double b = 0.001; b < 150; b *= 2) buckets.push_back(b);
  return buckets;
}

}  // namespace lockstep

namespace lockstep {

prometheus::Histogram& SecondsHistogram(prometheus::Registry& registry, const std::string& name,
                                        const std::string& help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(registry).Add(
      {}, SecondsBuckets());
}

}  // namespace lockstep
