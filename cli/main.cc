// lockstepctl: the user's command line for Lockstep (submit, list, status, watch, cancel,
// workers, health, export). Parses flags, dials the coordinator, and hands over to
// cli/commands.h.
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "cli/commands.h"
#include "cli/invocation.h"
#include "common/coordinators.h"
#include "common/grpc_options.h"
#include "common/grpc_status.h"
#include "common/tls_flags.h"
#include "lockstep/v1/job.grpc.pb.h"

ABSL_FLAG(std::string, coordinator, "",
          "coordinator address HOST:PORT, or several comma-separated (coordinators on etcd: the "
          "leader is found and used) (default: $LOCKSTEP_COORDINATOR, else 127.0.0.1:7070)");
ABSL_FLAG(std::string, token_file, "",
          "file holding the coordinator's token (default: $LOCKSTEP_TOKEN_FILE, else "
          "$LOCKSTEP_TOKEN, else none)");
ABSL_FLAG(std::string, output, "table", "output format: table or json");
ABSL_FLAG(int64_t, timeout_ms, 10000, "deadline of each request in milliseconds (not of watch)");
ABSL_FLAG(bool, watch, false, "submit: keep following the job, as the watch command does");
ABSL_FLAG(std::string, o, "model.safetensors", "export: the safetensors file to write");
ABSL_FLAG(int64_t, rank, -1, "logs: only this rank's lines (default: every rank's)");
ABSL_FLAG(int64_t, generation, 0, "logs: only this generation's lines (default: every one's)");
ABSL_FLAG(bool, follow, false, "logs: keep printing new lines until the job ends");
ABSL_FLAG(bool, force, false,
          "export: replace the output file and the config.json beside it if they exist");

int main(int argc, char** argv) {
  namespace cli = lockstep::cli;
  absl::SetProgramUsageMessage(cli::UsageText());
  if (cli::WantsHelp(argc, argv)) {
    std::cout << cli::HelpText();
    return cli::kExitOk;
  }
  auto usage_error = [](const absl::Status& status) {
    std::cerr << "lockstepctl: " << lockstep::StatusLine(status) << "\n" << cli::UsageText();
    return cli::kExitUsage;
  };
  if (absl::Status status = cli::CheckFlags(argc, argv); !status.ok()) return usage_error(status);
  const std::vector<char*> parsed = absl::ParseCommandLine(argc, argv);
  const std::vector<std::string> args(parsed.begin() + 1, parsed.end());

  cli::FlagValues flags;
  flags.coordinator = absl::GetFlag(FLAGS_coordinator);
  flags.token_file = absl::GetFlag(FLAGS_token_file);
  flags.output = absl::GetFlag(FLAGS_output);
  flags.timeout_ms = absl::GetFlag(FLAGS_timeout_ms);
  flags.watch = absl::GetFlag(FLAGS_watch);
  flags.export_output = absl::GetFlag(FLAGS_o);
  flags.force = absl::GetFlag(FLAGS_force);
  flags.rank = absl::GetFlag(FLAGS_rank);
  flags.generation = absl::GetFlag(FLAGS_generation);
  flags.follow = absl::GetFlag(FLAGS_follow);
  absl::StatusOr<cli::Invocation> invocation =
      cli::ParseInvocation(args, flags, std::getenv(cli::kCoordinatorEnv), std::cin);
  if (!invocation.ok()) return usage_error(invocation.status());

  cli::CommandOptions options;
  options.output = invocation->output;
  options.rpc_timeout = invocation->rpc_timeout;
  options.live_progress = isatty(STDOUT_FILENO) == 1;
  const lockstep::TlsFiles tls = lockstep::ClientTlsFilesFromFlags();
  options.tls = tls.any();
  options.tls_client_cert = !tls.cert.empty();
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      lockstep::MakeChannelCredentials(tls);
  if (!credentials.ok()) return usage_error(credentials.status());
  const lockstep::ClientAuth auth{invocation->token, "lockstepctl", *std::move(credentials),
                                  tls.server_name};
  absl::StatusOr<std::vector<std::string>> coordinators =
      lockstep::SplitCoordinators(invocation->coordinator);
  if (!coordinators.ok()) return usage_error(coordinators.status());
  auto channel = cli::LeaderChannel(*coordinators, auth, options.rpc_timeout);
  auto stub = lockstep::v1::JobService::NewStub(channel);
  auto health = grpc::health::v1::Health::NewStub(channel);
  return cli::RunCommand(*invocation, *stub, options, std::cout, std::cerr, health.get());
}
