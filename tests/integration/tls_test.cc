// TLS on the API with certificates the test makes with openssl: a coordinator with mutual TLS
// trains a job with two workers that present their certificates, and lockstepctl works with
// its own; a client without a certificate, with one from another CA, with an expired one, or
// speaking plaintext is refused with a message that names the flag to fix; the token is still
// checked over TLS; bad TLS flags stop the daemons naming the flag.
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/http.h"
#include "tests/testing/pki.h"

namespace lockstep {
namespace {

using testing::Cluster;
using testing::CommandResult;
using testing::Pki;
using testing::RunCommand;

std::vector<std::string> ServerFlags(const Pki& pki) {
  return {"--tls_cert=" + pki.Path("server.crt"), "--tls_key=" + pki.Path("server.key"),
          "--tls_ca=" + pki.Path("ca.crt")};
}

std::vector<std::string> ClientFlags(const Pki& pki, const std::string& who,
                                     const std::string& ca = "ca") {
  return {"--tls_ca=" + pki.Path(ca + ".crt"), "--tls_cert=" + pki.Path(who + ".crt"),
          "--tls_key=" + pki.Path(who + ".key")};
}

TlsFiles ClientFiles(const Pki& pki, const std::string& who) {
  TlsFiles files;
  files.ca = pki.Path("ca.crt");
  files.cert = pki.Path(who + ".crt");
  files.key = pki.Path(who + ".key");
  return files;
}

CommandResult Ctl(const Cluster& cluster, std::vector<std::string> flags,
                  const std::string& token_file) {
  std::vector<std::string> argv = {LOCKSTEP_CTL_BIN, "--coordinator=" + cluster.address(),
                                   "--timeout_ms=5000"};
  if (!token_file.empty()) argv.push_back("--token_file=" + token_file);
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back("list");
  absl::StatusOr<CommandResult> result = RunCommand(argv, absl::Seconds(30));
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *result : CommandResult{};
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Pki::Get().ok)
      GTEST_FAIL() << "openssl could not make the certificates:\n" << Pki::Get().error;
  }
};

TEST_F(TlsTest, MutualTlsTrainsAndRefusesEveryoneWithoutAValidCertificate) {
  const Pki& pki = Pki::Get();
  auto started = Cluster::Start(ServerFlags(pki), "tls-token", ClientFiles(pki, "ctl"));
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  for (const std::string name : {"w0", "w1"}) {
    ASSERT_TRUE(cluster.StartWorker(name, ClientFlags(pki, name)).ok()) << cluster.Logs();
  }
  absl::StatusOr<v1::Job> job = cluster.Submit(testing::SyntheticJob(2, 2, 300));
  ASSERT_TRUE(job.ok()) << job.status();
  absl::StatusOr<v1::Job> ended = cluster.WaitForEnd(job->job_id(), absl::Seconds(120));
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_EQ(ended->state(), v1::JOB_STATE_SUCCEEDED) << ended->reason() << cluster.Logs();
  EXPECT_EQ(ended->step(), 300);
  ASSERT_EQ(ended->members_size(), 2);
  EXPECT_EQ(ended->members(0).parameter_checksum(), ended->members(1).parameter_checksum());

  // lockstepctl with its certificate and the token.
  CommandResult ok = Ctl(cluster, ClientFlags(pki, "ctl"), cluster.token_file());
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find(job->job_id()), std::string::npos) << ok.output;

  // The token is still checked over TLS.
  const std::string wrong_token = cluster.dir() + "/wrong-token";
  std::ofstream(wrong_token) << "not-the-token\n";
  CommandResult wrong = Ctl(cluster, ClientFlags(pki, "ctl"), wrong_token);
  EXPECT_EQ(wrong.exit_code, 3);
  EXPECT_NE(wrong.output.find("UNAUTHENTICATED"), std::string::npos) << wrong.output;
  EXPECT_NE(wrong.output.find("wrong token"), std::string::npos) << wrong.output;

  // Each refusal's hint names the flag to fix: the client certificate when the coordinator
  // refused it (or its absence), the CA when the client did not trust the coordinator.
  struct Refused {
    std::string what;
    std::vector<std::string> flags;
    std::string names;
    std::string not_named;
  };
  const std::vector<Refused> refused = {
      {"plaintext", {}, "pass --tls_ca", ""},
      {"no client certificate",
       {"--tls_ca=" + pki.Path("ca.crt")},
       "requires a client certificate: pass --tls_cert and --tls_key",
       "--tls_ca"},
      {"a certificate from another CA", ClientFlags(pki, "stranger"),
       "refused this client's certificate: --tls_cert/--tls_key", "--tls_ca"},
      {"an expired certificate", ClientFlags(pki, "expired"),
       "refused this client's certificate: --tls_cert/--tls_key", "--tls_ca"},
      {"a coordinator certificate from a CA it does not trust", ClientFlags(pki, "ctl", "other-ca"),
       "--tls_ca must be the CA that signed it", "--tls_cert"},
  };
  for (const Refused& r : refused) {
    CommandResult result = Ctl(cluster, r.flags, cluster.token_file());
    EXPECT_EQ(result.exit_code, 3) << r.what << ": " << result.output;
    EXPECT_NE(result.output.find("UNAVAILABLE"), std::string::npos)
        << r.what << ": " << result.output;
    EXPECT_NE(result.output.find("TLS"), std::string::npos)
        << r.what << ": the message should point at TLS: " << result.output;
    EXPECT_NE(result.output.find(r.names), std::string::npos) << r.what << ": " << result.output;
    if (!r.not_named.empty()) {
      EXPECT_EQ(result.output.find(r.not_named), std::string::npos)
          << r.what << ": the hint should not blame " << r.not_named << ": " << result.output;
    }
  }

  // A worker without a valid certificate never registers, and exits saying why.
  absl::StatusOr<CommandResult> stranger =
      RunCommand({LOCKSTEP_WORKER_BIN, "--coordinator=" + cluster.address(), "--name=stranger",
                  "--token_file=" + cluster.token_file(), "--give_up_after=3s",
                  "--tls_ca=" + pki.Path("ca.crt"), "--tls_cert=" + pki.Path("stranger.crt"),
                  "--tls_key=" + pki.Path("stranger.key")},
                 absl::Seconds(30));
  ASSERT_TRUE(stranger.ok()) << stranger.status();
  EXPECT_EQ(stranger->exit_code, 4) << stranger->output;
  absl::StatusOr<std::vector<v1::WorkerInfo>> workers = cluster.Workers();
  ASSERT_TRUE(workers.ok());
  for (const v1::WorkerInfo& w : *workers) EXPECT_NE(w.name(), "stranger");

  // A valid certificate registers only under its own name: w0's cannot be w9 (or w1).
  std::vector<std::string> impostor = {LOCKSTEP_WORKER_BIN, "--coordinator=" + cluster.address(),
                                       "--name=w9", "--token_file=" + cluster.token_file(),
                                       "--give_up_after=10s"};
  for (const std::string& flag : ClientFlags(pki, "w0")) impostor.push_back(flag);
  absl::StatusOr<CommandResult> refused_name = RunCommand(impostor, absl::Seconds(30));
  ASSERT_TRUE(refused_name.ok()) << refused_name.status();
  EXPECT_EQ(refused_name->exit_code, 3) << refused_name->output;
  EXPECT_NE(refused_name->output.find("is not the common name of this worker's certificate"),
            std::string::npos)
      << refused_name->output;
}

TEST_F(TlsTest, BadTlsFlagsStopTheDaemonsNamingTheFlag) {
  const Pki& pki = Pki::Get();
  struct Case {
    std::vector<std::string> argv;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{LOCKSTEP_COORDINATOR_BIN, "--listen=127.0.0.1:0", "--tls_cert=" + pki.Path("server.crt")},
       "--tls_cert and --tls_key go together"},
      {{LOCKSTEP_COORDINATOR_BIN, "--listen=127.0.0.1:0", "--tls_cert=/nonexistent.crt",
        "--tls_key=" + pki.Path("server.key")},
       "--tls_cert: cannot read /nonexistent.crt"},
      {{LOCKSTEP_COORDINATOR_BIN, "--listen=127.0.0.1:0", "--tls_ca=" + pki.Path("ca.crt")},
       "the server needs its own certificate"},
      {{LOCKSTEP_COORDINATOR_BIN, "--listen=127.0.0.1:0", "--tls_cert=" + pki.Path("san.ext"),
        "--tls_key=" + pki.Path("server.key")},
       "is not a PEM file"},
      {{LOCKSTEP_WORKER_BIN, "--coordinator=127.0.0.1:1", "--tls_cert=" + pki.Path("worker.crt"),
        "--tls_key=" + pki.Path("worker.key")},
       "TLS needs --tls_ca"},
      {{LOCKSTEP_CTL_BIN, "--coordinator=127.0.0.1:1", "--tls_ca=/nonexistent-ca.crt", "list"},
       "--tls_ca: cannot read /nonexistent-ca.crt"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<CommandResult> result = RunCommand(c.argv, absl::Seconds(20));
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_NE(result->exit_code, 0) << absl::StrJoin(c.argv, " ");
    EXPECT_NE(result->output.find(c.expected), std::string::npos)
        << absl::StrJoin(c.argv, " ") << "\n"
        << result->output;
  }
}

TEST_F(TlsTest, PlaintextBeyondLoopbackIsWarnedAbout) {
  auto started = Cluster::Start({"--listen=0.0.0.0:0"});
  // Cluster::Start listens on 127.0.0.1:0 itself; a second --listen overrides it.
  ASSERT_TRUE(started.ok()) << started.status();
  std::ifstream log((*started)->dir() + "/coordinator.log");
  const std::string text((std::istreambuf_iterator<char>(log)), {});
  EXPECT_NE(text.find("beyond loopback without TLS"), std::string::npos) << text;
}

// The dashboard of a coordinator with mutual TLS is HTTPS with the API's certificate and asks
// browsers for a client certificate from the same CA; the token is still required.
TEST_F(TlsTest, DashboardIsHttpsAndRequiresAClientCertificateWithMutualTls) {
  const Pki& pki = Pki::Get();
  const std::string port_file = pki.Path(absl::StrCat("dashboard-", getpid(), ".port"));
  std::vector<std::string> flags = ServerFlags(pki);
  flags.push_back("--http_listen=127.0.0.1:0");
  flags.push_back("--http_port_file=" + port_file);
  auto started = Cluster::Start(flags, "tls-token", ClientFiles(pki, "ctl"));
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Cluster> cluster = *std::move(started);
  int port = 0;
  std::ifstream(port_file) >> port;
  ASSERT_GT(port, 0);
  const std::map<std::string, std::string> bearer = {{"Authorization", "Bearer tls-token"}};
  testing::HttpsFiles ctl{pki.Path("ca.crt"), pki.Path("ctl.crt"), pki.Path("ctl.key")};

  auto ok = testing::HttpRequest("GET", "127.0.0.1", port, "/api/v1/workers", bearer, "", ctl);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->status, 200) << ok->body;
  auto no_token = testing::HttpRequest("GET", "127.0.0.1", port, "/api/v1/workers", {}, "", ctl);
  ASSERT_TRUE(no_token.ok());
  EXPECT_EQ(no_token->status, 401);
  // No client certificate, one from another CA, or plain HTTP: no answer.
  testing::HttpsFiles anonymous{pki.Path("ca.crt"), "", ""};
  testing::HttpsFiles stranger{pki.Path("ca.crt"), pki.Path("stranger.crt"),
                               pki.Path("stranger.key")};
  for (const testing::HttpsFiles& files : {anonymous, stranger}) {
    auto refused =
        testing::HttpRequest("GET", "127.0.0.1", port, "/", bearer, "", files, absl::Seconds(5));
    EXPECT_FALSE(refused.ok() && refused->status == 200) << files.cert;
  }
  auto plain =
      testing::HttpRequest("GET", "127.0.0.1", port, "/", bearer, "", {}, absl::Seconds(5));
  EXPECT_FALSE(plain.ok() && plain->status == 200);
  EXPECT_TRUE(cluster->coordinator()->running());
}

}  // namespace
}  // namespace lockstep
