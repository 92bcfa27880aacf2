// The dashboard's HTTP side as a client sees it (the browser test drives the page itself):
// the JSON API is the gRPC API's messages in protobuf's JSON mapping and needs the token; the
// page and its files are served by the coordinator; cancel needs the dashboard's header; and
// bad input (unknown paths, malformed ids, malformed or oversized requests) gets a clear 4xx
// while the coordinator goes on serving.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/http.h"

namespace lockstep {
namespace {

using testing::Cluster;
using testing::HttpRequest;
using testing::HttpResponse;
using testing::RawHttp;

constexpr char kToken[] = "dashboard-token";

std::string TempDir() {
  std::string dir = std::filesystem::temp_directory_path() / "lockstep-dashboard-XXXXXX";
  return mkdtemp(dir.data()) != nullptr ? dir : "";
}

int ReadPort(const std::string& path) {
  std::ifstream in(path);
  int port = 0;
  in >> port;
  return port;
}

template <typename Message>
Message Parse(const std::string& json) {
  Message message;
  auto status = google::protobuf::util::JsonStringToMessage(json, &message);
  EXPECT_TRUE(status.ok()) << status.ToString() << "\n" << json.substr(0, 400);
  return message;
}

class DashboardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempDir();
    ASSERT_FALSE(dir_.empty());
    auto started = Cluster::Start(
        {"--http_listen=127.0.0.1:0", "--http_port_file=" + dir_ + "/http.port"}, kToken);
    ASSERT_TRUE(started.ok()) << started.status();
    cluster_ = *std::move(started);
    port_ = ReadPort(dir_ + "/http.port");
    ASSERT_GT(port_, 0);
  }
  void TearDown() override {
    cluster_.reset();
    std::filesystem::remove_all(dir_);
  }

  HttpResponse Call(const std::string& method, const std::string& path,
                    const std::map<std::string, std::string>& headers = {},
                    const std::string& body = "") {
    absl::StatusOr<HttpResponse> response =
        HttpRequest(method, "127.0.0.1", port_, path, headers, body);
    EXPECT_TRUE(response.ok()) << response.status();
    return response.value_or(HttpResponse{});
  }
  HttpResponse Get(const std::string& path, bool with_token = true) {
    std::map<std::string, std::string> headers;
    if (with_token) headers["Authorization"] = absl::StrCat("Bearer ", kToken);
    return Call("GET", path, headers);
  }

  std::string dir_;
  std::unique_ptr<Cluster> cluster_;
  int port_ = 0;
};

TEST_F(DashboardTest, ApiIsTheGrpcMessagesAsJsonBehindTheToken) {
  ASSERT_TRUE(cluster_->StartWorkers(2).ok());
  auto job = cluster_->Submit(testing::SyntheticJob(2, 2, 120));
  ASSERT_TRUE(job.ok()) << job.status();
  auto done = cluster_->WaitForEnd(job->job_id(), absl::Seconds(120));
  ASSERT_TRUE(done.ok()) << done.status() << cluster_->Logs();
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason();

  // No token, a wrong one: 401 with the reason, and nothing of the cluster.
  HttpResponse bare = Get("/api/v1/jobs", /*with_token=*/false);
  EXPECT_EQ(bare.status, 401);
  EXPECT_NE(bare.body.find("\"code\":\"UNAUTHENTICATED\""), std::string::npos) << bare.body;
  EXPECT_NE(bare.body.find("missing token"), std::string::npos) << bare.body;
  EXPECT_EQ(bare.body.find(job->job_id()), std::string::npos);
  EXPECT_EQ(bare.Header("WWW-Authenticate"), "Bearer realm=\"lockstep\"");
  HttpResponse wrong =
      Call("GET", "/api/v1/workers", {{"Authorization", "Bearer not-the-token"}});
  EXPECT_EQ(wrong.status, 401);
  EXPECT_NE(wrong.body.find("wrong token"), std::string::npos) << wrong.body;
  for (const char* path : {"/api/v1/jobs/ID", "/api/v1/jobs/ID/curve"}) {
    const std::string p = absl::StrReplaceAll(path, {{"ID", job->job_id()}});
    EXPECT_EQ(Get(p, /*with_token=*/false).status, 401) << p;
  }

  // The documents parse as the gRPC messages and say what the gRPC API says.
  HttpResponse list = Get("/api/v1/jobs");
  ASSERT_EQ(list.status, 200) << list.body;
  EXPECT_TRUE(absl::StartsWith(list.Header("Content-Type"), "application/json"));
  EXPECT_EQ(list.Header("Cache-Control"), "no-store");
  auto jobs = Parse<v1::ListJobsResponse>(list.body);
  ASSERT_EQ(jobs.jobs_size(), 1);
  EXPECT_EQ(jobs.jobs(0).job_id(), job->job_id());
  EXPECT_EQ(jobs.jobs(0).state(), v1::JOB_STATE_SUCCEEDED);

  HttpResponse one = Get("/api/v1/jobs/" + job->job_id());
  ASSERT_EQ(one.status, 200) << one.body;
  auto parsed = Parse<v1::Job>(one.body);
  EXPECT_EQ(parsed.step(), 120);
  EXPECT_EQ(parsed.generations_size(), done->generations_size());
  ASSERT_EQ(parsed.generations_size(), 1);
  EXPECT_EQ(parsed.generations(0).members_size(), 2);
  EXPECT_EQ(parsed.members(0).parameter_checksum(), done->members(0).parameter_checksum());

  HttpResponse curve_response = Get("/api/v1/jobs/" + job->job_id() + "/curve");
  ASSERT_EQ(curve_response.status, 200) << curve_response.body;
  auto curve = Parse<v1::TrainingCurve>(curve_response.body);
  EXPECT_EQ(curve.job_id(), job->job_id());
  ASSERT_GE(curve.points_size(), 2);
  EXPECT_EQ(curve.points(0).step(), 1);
  EXPECT_EQ(curve.points(curve.points_size() - 1).step(), 120) << "the last step is reported";
  for (int i = 1; i < curve.points_size(); ++i) {
    EXPECT_GT(curve.points(i).step(), curve.points(i - 1).step());
    EXPECT_GT(curve.points(i).loss(), 0);
  }

  HttpResponse workers_response = Get("/api/v1/workers");
  ASSERT_EQ(workers_response.status, 200);
  auto workers = Parse<v1::ListWorkersResponse>(workers_response.body);
  EXPECT_EQ(workers.workers_size(), 2);
  bool dashboard_refused = false;
  for (const v1::RejectedClient& r : workers.rejected_clients()) {
    dashboard_refused = dashboard_refused || (r.client() == "dashboard" && r.count() >= 4);
  }
  EXPECT_TRUE(dashboard_refused) << workers_response.body;

  // The page and its files, from the coordinator itself.
  for (const std::string& path :
       std::vector<std::string>{"/", "/workers", "/jobs/" + job->job_id()}) {
    HttpResponse page = Get(path, /*with_token=*/false);
    EXPECT_EQ(page.status, 200) << path;
    EXPECT_TRUE(absl::StartsWith(page.Header("Content-Type"), "text/html")) << path;
    EXPECT_NE(page.body.find("/assets/app.js"), std::string::npos);
    EXPECT_EQ(page.body.find(job->job_id()), std::string::npos) << "the shell holds no data";
    EXPECT_NE(page.Header("Content-Security-Policy").find("default-src 'self'"),
              std::string::npos);
  }
  HttpResponse chart = Get("/assets/uPlot.iife.min.js", /*with_token=*/false);
  EXPECT_EQ(chart.status, 200);
  EXPECT_TRUE(absl::StartsWith(chart.Header("Content-Type"), "text/javascript"));
  EXPECT_NE(chart.body.find("uPlot"), std::string::npos);
  EXPECT_GT(chart.body.size(), 20000u);
  EXPECT_EQ(Get("/assets/app.js", false).status, 200);
  EXPECT_EQ(Get("/assets/style.css", false).status, 200);
  EXPECT_EQ(Get("/assets/uPlot.min.css", false).status, 200);

  // Cancelling the finished job: the dashboard's header is required, then 409.
  const std::string cancel = "/api/v1/jobs/" + job->job_id() + "/cancel";
  const std::string bearer = absl::StrCat("Bearer ", kToken);
  HttpResponse no_header = Call("POST", cancel, {{"Authorization", bearer}});
  EXPECT_EQ(no_header.status, 403);
  EXPECT_NE(no_header.body.find("X-Lockstep-Dashboard"), std::string::npos) << no_header.body;
  HttpResponse finished =
      Call("POST", cancel, {{"Authorization", bearer}, {"X-Lockstep-Dashboard", "1"}});
  EXPECT_EQ(finished.status, 409);
  EXPECT_NE(finished.body.find("FAILED_PRECONDITION"), std::string::npos) << finished.body;
  EXPECT_EQ(Call("POST", cancel, {{"X-Lockstep-Dashboard", "1"}}).status, 401);
}

TEST_F(DashboardTest, CancelStopsARunningJob) {
  ASSERT_TRUE(cluster_->StartWorkers(1).ok());
  auto job = cluster_->Submit(testing::SyntheticJob(1, 1, 1'000'000));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(cluster_
                  ->WaitFor(job->job_id(), [](const v1::Job& j) { return j.step() > 0; },
                            absl::Seconds(60))
                  .ok());
  HttpResponse response = Call(
      "POST", "/api/v1/jobs/" + job->job_id() + "/cancel",
      {{"Authorization", absl::StrCat("Bearer ", kToken)}, {"X-Lockstep-Dashboard", "1"}});
  ASSERT_EQ(response.status, 200) << response.body;
  EXPECT_EQ(Parse<v1::Job>(response.body).state(), v1::JOB_STATE_CANCELLED);
  auto ended = cluster_->WaitForEnd(job->job_id(), absl::Seconds(30));
  ASSERT_TRUE(ended.ok());
  EXPECT_EQ(ended->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(ended->reason(), "cancelled by user");
}

TEST_F(DashboardTest, BadRequestsGetAClearAnswerAndNothingCrashes) {
  // Unknown paths: 404 saying what exists.
  HttpResponse page = Get("/nowhere", false);
  EXPECT_EQ(page.status, 404);
  EXPECT_NE(page.body.find("pages: /, /jobs/ID, /workers"), std::string::npos) << page.body;
  HttpResponse api = Get("/api/v1/nowhere");
  EXPECT_EQ(api.status, 404);
  EXPECT_NE(api.body.find("\"code\":\"NOT_FOUND\""), std::string::npos) << api.body;
  EXPECT_NE(api.body.find("GET /api/v1/jobs"), std::string::npos) << api.body;
  EXPECT_EQ(Get("/assets/nothing.js", false).status, 404);
  EXPECT_EQ(Get("/assets/../../etc/passwd", false).status, 404);
  EXPECT_EQ(Call("DELETE", "/api/v1/jobs").status, 404);
  // Unknown and malformed job ids.
  HttpResponse unknown = Get("/api/v1/jobs/job-404");
  EXPECT_EQ(unknown.status, 404);
  EXPECT_NE(unknown.body.find("job job-404 does not exist"), std::string::npos) << unknown.body;
  HttpResponse malformed = Get("/api/v1/jobs/job%3B%20rm");
  EXPECT_EQ(malformed.status, 400);
  EXPECT_NE(malformed.body.find("job id may only hold"), std::string::npos) << malformed.body;
  EXPECT_EQ(Get("/api/v1/jobs/" + std::string(200, 'j')).status, 400);

  // Malformed and oversized requests, as raw bytes.
  auto garbage = RawHttp("127.0.0.1", port_, "NOT HTTP AT ALL\r\n\r\n");
  ASSERT_TRUE(garbage.ok());
  EXPECT_TRUE(absl::StartsWith(*garbage, "HTTP/1.1 400")) << *garbage;
  auto long_line = RawHttp("127.0.0.1", port_,
                           absl::StrCat("GET /", std::string(20000, 'a'), " HTTP/1.1\r\n\r\n"));
  ASSERT_TRUE(long_line.ok());
  EXPECT_TRUE(absl::StartsWith(*long_line, "HTTP/1.1 4")) << long_line->substr(0, 80);
  auto big_header = RawHttp("127.0.0.1", port_,
                            absl::StrCat("GET / HTTP/1.1\r\nHost: x\r\nX-Big: ",
                                         std::string(20000, 'b'), "\r\n\r\n"));
  ASSERT_TRUE(big_header.ok());
  EXPECT_TRUE(absl::StartsWith(*big_header, "HTTP/1.1 4")) << big_header->substr(0, 80);
  HttpResponse big_body =
      Call("POST", "/api/v1/jobs/job-1/cancel",
           {{"Authorization", absl::StrCat("Bearer ", kToken)}, {"X-Lockstep-Dashboard", "1"}},
           std::string(1 << 20, 'x'));
  EXPECT_EQ(big_body.status, 413);
  // A request that stops halfway: the server gives up on it (read timeout), others go on.
  auto half = RawHttp("127.0.0.1", port_, "GET /api/v1/jobs HTTP/1.1\r\nHost: x\r\n",
                      absl::Milliseconds(200));
  ASSERT_TRUE(half.ok());

  // Still serving, on both ports.
  EXPECT_EQ(Get("/api/v1/jobs").status, 200);
  EXPECT_EQ(Get("/", false).status, 200);
  EXPECT_TRUE(cluster_->coordinator()->running());
  EXPECT_TRUE(cluster_->Workers().ok());
}

// Without a token the dashboard answers only requests addressed to an IP or localhost, so a
// site that rebinds its own name to this address gets nothing through a visitor's browser.
TEST(DashboardWithoutTokenTest, ServesIpAndLocalhostOnly) {
  const std::string dir = TempDir();
  ASSERT_FALSE(dir.empty());
  auto started =
      Cluster::Start({"--http_listen=127.0.0.1:0", "--http_port_file=" + dir + "/http.port"});
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Cluster> cluster = *std::move(started);
  const int port = ReadPort(dir + "/http.port");
  ASSERT_GT(port, 0);
  auto get = [&](const std::string& path, const std::string& host) {
    auto response = HttpRequest("GET", "127.0.0.1", port, path, {{"Host", host}});
    EXPECT_TRUE(response.ok()) << response.status();
    return response.value_or(HttpResponse{});
  };
  EXPECT_EQ(get("/api/v1/jobs", absl::StrCat("127.0.0.1:", port)).status, 200);
  EXPECT_EQ(get("/api/v1/jobs", absl::StrCat("localhost:", port)).status, 200);
  EXPECT_EQ(get("/api/v1/jobs", absl::StrCat("[::1]:", port)).status, 200);
  HttpResponse auth = get("/api/v1/auth", "127.0.0.1");
  EXPECT_EQ(auth.body, "{\"tokenRequired\":false}\n");
  for (const std::string path : {"/", "/api/v1/jobs"}) {
    HttpResponse rebound = get(path, absl::StrCat("attacker.example:", port));
    EXPECT_EQ(rebound.status, 403) << path;
    EXPECT_NE(rebound.body.find("without a token"), std::string::npos) << rebound.body;
  }
  cluster.reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace lockstep
