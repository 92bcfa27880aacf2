// The coordinator's web dashboard (--http_listen): a jobs page, a job page with live loss and
// throughput curves and the membership timeline, and a workers page. The pages are one static
// shell (assets.h) that polls a read-only JSON API, whose documents are the gRPC API's messages
// in protobuf's JSON mapping (common/proto_json.h):
//   GET  /api/v1/jobs                 ListJobsResponse
//   GET  /api/v1/jobs/{id}            Job
//   GET  /api/v1/jobs/{id}/curve      TrainingCurve
//   GET  /api/v1/workers              ListWorkersResponse
//   POST /api/v1/jobs/{id}/cancel     Job (header X-Lockstep-Dashboard: 1, so that another
//                                     site's form cannot post it)
//   GET  /api/v1/auth                 {"tokenRequired": true}: whether the page must ask
// Without a token, only requests to an IP address or localhost are served (Host), so that no
// other site can reach the dashboard through a browser by rebinding its DNS name. With a
// client CA (mutual TLS on the API), HTTPS requires client certificates too.
// With a coordinator token, every API call needs "Authorization: Bearer <token>" (the page asks
// for it once and keeps it for the browser tab); refusals are counted with the gRPC ones (the
// workers page lists them). Errors are {"code": "NOT_FOUND", "message": "..."} with the HTTP
// status that matches.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/http_server.h"
#include "common/tls.h"
#include "coordinator/service/coordinator.h"

namespace lockstep::coordinator {

class Dashboard {
 public:
  // Serves `coordinator` on `address` (HOST:PORT; port 0 lets the OS pick, written to
  // `port_file` when set); HTTPS with the API's certificate and key when `tls` has them. The
  // coordinator must outlive the dashboard.
  static absl::StatusOr<std::unique_ptr<Dashboard>> Start(const std::string& address,
                                                          const std::string& port_file,
                                                          Coordinator* coordinator,
                                                          const TlsFiles& tls = {});
  int port() const { return server_->port(); }

 private:
  explicit Dashboard(Coordinator* coordinator) : coordinator_(coordinator) {}
  Coordinator* const coordinator_;
  std::unique_ptr<HttpServer> server_;
};

}  // namespace lockstep::coordinator
