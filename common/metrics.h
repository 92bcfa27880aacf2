// A daemon's Prometheus endpoint: GET /metrics in the text exposition format (prometheus-cpp's
// registry and serializer, served by cpp-httplib), over one registry of counters, gauges and
// histograms that the daemon updates as things happen, plus collectors that read state when
// Prometheus scrapes (job and worker counts, memory), so nothing is kept current in between.
// (prometheus-cpp's own exposer, civetweb, cannot start in a process that has loaded cuBLAS:
// its server context comes back null, so the workers of a CUDA build could not serve.)
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/http_server.h"
#include "prometheus/collectable.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace lockstep {

class MetricsEndpoint {
 public:
  // Listens on `address` (HOST:PORT; port 0 lets the OS pick) and, when `port_file` is set,
  // writes the port there once serving. INVALID_ARGUMENT for a malformed address, UNAVAILABLE
  // when it cannot listen.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(const std::string& address,
                                                                const std::string& port_file);
  ~MetricsEndpoint();

  int port() const { return server_->port(); }
  prometheus::Registry& registry() { return *registry_; }
  // Served beside the registry for as long as the endpoint lives.
  void Add(std::shared_ptr<prometheus::Collectable> collectable);

  // The exposition text of everything registered (what GET /metrics answers).
  std::string Scrape() const;

 private:
  MetricsEndpoint();
  // Destroyed first: no scrape runs once the registry and collectables go.
  std::shared_ptr<prometheus::Registry> registry_;
  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<HttpServer> server_;  // last member: stopped before the rest is destroyed
};

// A daemon's --metrics_listen endpoint (with --metrics_port_file): null when `address` is
// empty; errors name the flag; the port is logged once serving.
absl::StatusOr<std::unique_ptr<MetricsEndpoint>> StartMetricsFlag(const std::string& address,
                                                                  const std::string& port_file);

// Metric families computed at scrape time by `collect` (called on the exposer's thread).
class ScrapeCollector : public prometheus::Collectable {
 public:
  explicit ScrapeCollector(std::function<std::vector<prometheus::MetricFamily>()> collect)
      : collect_(std::move(collect)) {}
  std::vector<prometheus::MetricFamily> Collect() const override { return collect_(); }

 private:
  const std::function<std::vector<prometheus::MetricFamily>()> collect_;
};

// One gauge family with one sample per label set, for ScrapeCollector.
using Labels = std::vector<std::pair<std::string, std::string>>;
prometheus::MetricFamily GaugeFamily(std::string name, std::string help,
                                     const std::vector<std::pair<Labels, double>>& samples);
prometheus::MetricFamily CounterFamily(std::string name, std::string help,
                                       const std::vector<std::pair<Labels, double>>& samples);

// Buckets of a seconds histogram from 1 ms to about 2 minutes, doubling.
std::vector<double> SecondsBuckets();
// An unlabelled histogram of seconds with those buckets, registered in `registry`.
prometheus::Histogram& SecondsHistogram(prometheus::Registry& registry, const std::string& name,
                                        const std::string& help);

}  // namespace lockstep
