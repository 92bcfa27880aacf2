#include "coordinator/dashboard/dashboard.h"

#include <arpa/inet.h>

#include <functional>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/proto_json.h"
#include "coordinator/dashboard/assets.h"
#include "glog/logging.h"
#include "google/protobuf/struct.pb.h"
#include "httplib.h"

namespace lockstep::coordinator {
namespace {

constexpr char kJson[] = "application/json; charset=utf-8";
// Sent by the page with every cancel: a cross-site form cannot set it (nor can it read the
// token), so another site cannot cancel jobs through a browser that has the dashboard open.
constexpr char kDashboardHeader[] = "X-Lockstep-Dashboard";
constexpr size_t kMaxJobIdLength = 128;

int HttpStatus(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kAborted:
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

// {"code": "NOT_FOUND", "message": "..."} with the matching HTTP status.
void ReplyError(httplib::Response& response, const absl::Status& status) {
  google::protobuf::Struct error;
  (*error.mutable_fields())["code"].set_string_value(absl::StatusCodeToString(status.code()));
  (*error.mutable_fields())["message"].set_string_value(std::string(status.message()));
  response.status = HttpStatus(status.code());
  if (status.code() == absl::StatusCode::kUnauthenticated) {
    response.set_header("WWW-Authenticate", "Bearer realm=\"lockstep\"");
  }
  absl::StatusOr<std::string> json = ToJson(error, /*multiline=*/false);
  response.set_content(json.ok() ? *json : std::string(status.message()), kJson);
}

void Reply(httplib::Response& response, const absl::StatusOr<std::string>& json) {
  if (!json.ok()) return ReplyError(response, json.status());
  response.set_content(*json, kJson);
}

template <typename Message>
void Reply(httplib::Response& response, const absl::StatusOr<Message>& message) {
  if (!message.ok()) return ReplyError(response, message.status());
  Reply(response, ToJson(*message, /*multiline=*/false));
}

// Job ids are "job-7-3fa9c1": anything else is refused before it reaches the core.
absl::StatusOr<std::string> JobIdOf(const httplib::Request& request) {
  const std::string id = request.matches.size() > 1 ? request.matches[1].str() : "";
  if (id.empty() || id.size() > kMaxJobIdLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("job id must be 1 to ", kMaxJobIdLength, " characters"));
  }
  for (char c : id) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      return absl::InvalidArgumentError(
          "job id may only hold letters, digits, '-', '_' and '.' (e.g. job-7-3fa9c1)");
    }
  }
  return id;
}

// What cpp-httplib's own refusals mean.
const char* RefusalReason(int status) {
  switch (status) {
    case 400:
      return "malformed request";
    case 413:
      return "request body too large";
    case 414:
      return "request line too long";
    case 431:
      return "request headers too large";
    default:
      return "request refused";
  }
}

// Without a token, a page elsewhere could reach this port through a browser by rebinding its
// own DNS name to this address; such requests carry that name in Host. Only IP literals and
// localhost are served then (with a token the page would still need it, which it cannot read).
bool HostIsLiteralOrLocal(absl::string_view host) {
  if (host.empty()) return true;  // HTTP/1.0 clients send none; browsers always do
  if (host.front() == '[') return host.find(']') != absl::string_view::npos;  // [IPv6]:port
  if (const size_t colon = host.rfind(':'); colon != absl::string_view::npos) {
    host = host.substr(0, colon);
  }
  if (absl::EqualsIgnoreCase(host, "localhost")) return true;
  in_addr v4;
  return inet_pton(AF_INET, std::string(host).c_str(), &v4) == 1;
}

const EmbeddedFile* FindFile(absl::string_view name) {
  for (size_t i = 0; i < kDashboardFileCount; ++i) {
    if (name == kDashboardFiles[i].name) return &kDashboardFiles[i];
  }
  return nullptr;
}

const char* ContentType(absl::string_view name) {
  if (absl::EndsWith(name, ".html")) return "text/html; charset=utf-8";
  if (absl::EndsWith(name, ".js")) return "text/javascript; charset=utf-8";
  if (absl::EndsWith(name, ".css")) return "text/css; charset=utf-8";
  if (absl::EndsWith(name, ".svg")) return "image/svg+xml";
  return "application/octet-stream";
}

void ServeFile(httplib::Response& response, absl::string_view name) {
  const EmbeddedFile* file = FindFile(name);
  if (file == nullptr) {
    response.status = 404;
    response.set_content(absl::StrCat("no file ", name, "\n"), "text/plain");
    return;
  }
  response.set_content(reinterpret_cast<const char*>(file->data), file->size, ContentType(name));
}

// The credentials check each API call passes; false: refused (answered).
using Admit = std::function<bool(const httplib::Request&, httplib::Response&)>;

// The page's routes and the API's.
void AddRoutes(httplib::Server& server, Coordinator* c, const Admit& admit) {
  // The page: one shell for every route (app.js renders the one in the address bar).
  auto shell = [](const httplib::Request&, httplib::Response& response) {
    ServeFile(response, "index.html");
  };
  server.Get("/", shell);
  server.Get("/workers", shell);
  server.Get(R"(/jobs/([^/]+))", shell);
  server.Get(R"(/assets/([A-Za-z0-9._-]+))",
             [](const httplib::Request& request, httplib::Response& response) {
               ServeFile(response, request.matches[1].str());
             });

  // Whether the page must ask for the token (no data: a stranger learns only that).
  server.Get("/api/v1/auth", [c](const httplib::Request&, httplib::Response& response) {
    google::protobuf::Struct auth;
    (*auth.mutable_fields())["tokenRequired"].set_bool_value(c->gate().token_required());
    Reply(response, ToJson(auth, /*multiline=*/false));
  });
  server.Get("/api/v1/jobs", [c, admit](const httplib::Request& request,
                                        httplib::Response& response) {
    if (!admit(request, response)) return;
    // ?page_size=N&page_token=T, as in the gRPC ListJobs.
    v1::ListJobsRequest page;
    if (request.has_param("page_size")) {
      int32_t size = 0;
      if (!absl::SimpleAtoi(request.get_param_value("page_size"), &size)) {
        return ReplyError(response, absl::InvalidArgumentError("page_size must be a whole number"));
      }
      page.set_page_size(size);
    }
    page.set_page_token(request.get_param_value("page_token"));
    absl::StatusOr<v1::ListJobsResponse> jobs =
        c->Call([&](Core& core, absl::Time, Decisions*) { return core.ListJobs(page); });
    if (!jobs.ok()) return ReplyError(response, jobs.status());
    Reply(response, ToJson(*jobs, /*multiline=*/false));
  });
  server.Get(R"(/api/v1/jobs/([^/]+))", [c, admit](const httplib::Request& request,
                                                   httplib::Response& response) {
    if (!admit(request, response)) return;
    absl::StatusOr<std::string> id = JobIdOf(request);
    if (!id.ok()) return ReplyError(response, id.status());
    Reply(response, c->Call([&](Core& core, absl::Time, Decisions*) { return core.GetJob(*id); }));
  });
  server.Get(R"(/api/v1/jobs/([^/]+)/curve)", [c, admit](const httplib::Request& request,
                                                         httplib::Response& response) {
    if (!admit(request, response)) return;
    absl::StatusOr<std::string> id = JobIdOf(request);
    if (!id.ok()) return ReplyError(response, id.status());
    Reply(response,
          c->Call([&](Core& core, absl::Time, Decisions*) { return core.GetTrainingCurve(*id); }));
  });
  // A program job's output: ?rank=N (default every rank's), ?from=SEQUENCE (default 0).
  server.Get(R"(/api/v1/jobs/([^/]+)/logs)", [c, admit](const httplib::Request& request,
                                                        httplib::Response& response) {
    if (!admit(request, response)) return;
    absl::StatusOr<std::string> id = JobIdOf(request);
    if (!id.ok()) return ReplyError(response, id.status());
    v1::GetJobLogsRequest logs;
    logs.set_job_id(*id);
    for (const auto& [name, field] : {std::pair<const char*, const char*>{"rank", "rank"},
                                      {"from", "from"}}) {
      if (!request.has_param(name)) continue;
      int64_t value = 0;
      if (!absl::SimpleAtoi(request.get_param_value(name), &value) || value < 0 ||
          (std::string(field) == "rank" && value > INT32_MAX)) {
        return ReplyError(response, absl::InvalidArgumentError(absl::StrCat(
                                        field, ": must be a number >= 0")));
      }
      if (std::string(field) == "rank") {
        logs.set_rank(static_cast<int32_t>(value));
      } else {
        logs.set_from_sequence(value);
      }
    }
    Reply(response, c->JobLogs(logs));
  });
  server.Get("/api/v1/workers",
             [c, admit](const httplib::Request& request, httplib::Response& response) {
               if (!admit(request, response)) return;
               Reply(response, ToJson(c->Workers(), /*multiline=*/false));
             });
  server.Post(R"(/api/v1/jobs/([^/]+)/cancel)", [c, admit](const httplib::Request& request,
                                                           httplib::Response& response) {
    if (!admit(request, response)) return;
    if (request.get_header_value(kDashboardHeader) != "1") {
      return ReplyError(response, absl::PermissionDeniedError(
                                      absl::StrCat("cancel needs the header ", kDashboardHeader,
                                                   ": 1 (the dashboard page sends it)")));
    }
    absl::StatusOr<std::string> id = JobIdOf(request);
    if (!id.ok()) return ReplyError(response, id.status());
    absl::StatusOr<v1::Job> job = c->Call(
        [&](Core& core, absl::Time now, Decisions* d) { return core.CancelJob(*id, now, d); });
    if (job.ok())
      LOG(INFO) << "cancelled " << *id << " from the dashboard at " << request.remote_addr;
    Reply(response, job);
  });
}

// What every answer gets (the Host check without a token, security headers) and the answers
// to what no route takes.
void AddGuards(httplib::Server& server, Coordinator* c) {
  server.set_pre_routing_handler([c](const httplib::Request& request, httplib::Response& response) {
    if (c->gate().token_required() || HostIsLiteralOrLocal(request.get_header_value("Host"))) {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    ReplyError(response,
               absl::PermissionDeniedError(absl::StrCat(
                   "Host \"", request.get_header_value("Host"),
                   "\" refused: without a token (--token_file) the dashboard serves only "
                   "IP addresses and localhost, so that no other site can reach it through "
                   "a browser")));
    return httplib::Server::HandlerResponse::Handled;
  });
  server.set_post_routing_handler([](const httplib::Request& request, httplib::Response& response) {
    response.set_header("X-Content-Type-Options", "nosniff");
    response.set_header("X-Frame-Options", "DENY");
    response.set_header("Referrer-Policy", "no-referrer");
    if (absl::StartsWith(request.path, "/api/")) {
      response.set_header("Cache-Control", "no-store");
    } else {
      response.set_header("Cache-Control", "no-cache");
      response.set_header("Content-Security-Policy",
                          "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'");
    }
  });
  // Unknown paths (404), and requests cpp-httplib refused itself (malformed: 400; too
  // large: 413, 414) get a body that says so.
  server.set_error_handler([](const httplib::Request& request, httplib::Response& response) {
    if (!response.body.empty()) return;
    const bool api = absl::StartsWith(request.path, "/api/");
    if (response.status == 404) {
      const absl::Status status = absl::NotFoundError(absl::StrCat(
          "no ", request.method, " ", request.path,
          api ? " in the API (GET /api/v1/jobs, /api/v1/jobs/ID, /api/v1/jobs/ID/curve, "
                "/api/v1/jobs/ID/logs, "
                "/api/v1/workers; POST /api/v1/jobs/ID/cancel)"
              : " here (pages: /, /jobs/ID, /workers)"));
      if (api) return ReplyError(response, status);
      response.set_content(absl::StrCat(status.message(), "\n"), "text/plain");
      return;
    }
    response.set_content(
        absl::StrCat("HTTP ", response.status, ": ", RefusalReason(response.status), "\n"),
        "text/plain");
  });
}

}  // namespace

absl::StatusOr<std::unique_ptr<Dashboard>> Dashboard::Start(const std::string& address,
                                                            const std::string& port_file,
                                                            Coordinator* coordinator,
                                                            const TlsFiles& tls) {
  std::unique_ptr<Dashboard> dashboard(new Dashboard(coordinator));
  Coordinator* const c = coordinator;
  // Each API call passes the caller's credentials check; false: refused (answered).
  auto admit = [c](const httplib::Request& request, httplib::Response& response) {
    absl::Status status = c->gate().AdmitHttp(request.remote_addr, "dashboard",
                                              request.get_header_value("Authorization"));
    if (!status.ok()) ReplyError(response, status);
    return status.ok();
  };
  HttpServerOptions options;
  options.what = "dashboard";
  // Each open page polls with two requests and a browser keeps a few connections alive.
  options.threads = 16;
  options.keep_alive_seconds = 2;
  // A browser keeps at most six connections to a host: room for a few dozen open pages.
  options.max_connections = 256;
  options.tls_cert = tls.cert;
  options.tls_key = tls.key;
  options.tls_client_ca = tls.ca;
  absl::StatusOr<std::unique_ptr<HttpServer>> server =
      HttpServer::Start(address, port_file, options, [c, admit](httplib::Server& server) {
        AddRoutes(server, c, admit);
        AddGuards(server, c);
      });
  if (!server.ok()) return server.status();
  dashboard->server_ = *std::move(server);
  return dashboard;
}

}  // namespace lockstep::coordinator
