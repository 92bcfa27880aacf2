#include "common/metrics.h"

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
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

MetricsEndpoint::MetricsEndpoint() : registry_(std::make_shared<prometheus::Registry>()) {}

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& address, const std::string& port_file) {
  std::unique_ptr<MetricsEndpoint> endpoint(new MetricsEndpoint());
  MetricsEndpoint* self = endpoint.get();
  HttpServerOptions options;
  options.what = "metrics";
  // One thread: a scrape is small, and Prometheus scrapes each target one at a time.
  options.threads = 1;
  absl::StatusOr<std::unique_ptr<HttpServer>> server =
      HttpServer::Start(address, port_file, options, [self](httplib::Server& server) {
        server.Get("/metrics", [self](const httplib::Request&, httplib::Response& response) {
          response.set_content(self->Scrape(), "text/plain; version=0.0.4; charset=utf-8");
        });
        server.set_error_handler([](const httplib::Request& request, httplib::Response& response) {
          if (response.status == 404) {
            response.set_content(
                absl::StrCat("no ", request.path, " here: metrics are at /metrics\n"),
                "text/plain");
          }
        });
      });
  if (!server.ok()) return server.status();
  endpoint->server_ = *std::move(server);
  return endpoint;
}

MetricsEndpoint::~MetricsEndpoint() = default;

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

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> StartMetricsFlag(const std::string& address,
                                                                  const std::string& port_file) {
  if (address.empty()) return nullptr;
  absl::StatusOr<std::unique_ptr<MetricsEndpoint>> started =
      MetricsEndpoint::Start(address, port_file);
  if (!started.ok()) {
    return absl::Status(started.status().code(),
                        absl::StrCat("--metrics_listen: ", started.status().message()));
  }
  LOG(INFO) << "metrics on port " << (*started)->port() << " (GET /metrics)";
  return started;
}

}  // namespace lockstep
