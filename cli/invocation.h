// Turns lockstepctl's command line into a checked Invocation before any RPC is made. Every
// failure here is a usage error: INVALID_ARGUMENT, and exit code 2.
#pragma once

#include <cstdint>
#include <istream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cli/format.h"
#include "lockstep/v1/job.pb.h"

namespace lockstep::cli {

// Exit codes of lockstepctl.
inline constexpr int kExitOk = 0;         // done; for watch: the job SUCCEEDED
inline constexpr int kExitJobFailed = 1;  // watch: the job FAILED or was CANCELLED
inline constexpr int kExitUsage = 2;      // bad command line or job spec file
inline constexpr int kExitRpcError = 3;   // an RPC failed or the watch stream broke
inline constexpr int kExitFileError = 4;  // export: the checkpoint or the output file failed

inline constexpr char kDefaultCoordinator[] = "127.0.0.1:7070";
inline constexpr char kCoordinatorEnv[] = "LOCKSTEP_COORDINATOR";

enum class Command {
  kHelp, kSubmit, kList, kQueue, kStatus, kWatch, kCancel, kSuspend, kResume, kWorkers, kHealth,
  kExport, kLogs
};

// The values of the global flags, as absl parsed them.
struct FlagValues {
  std::string coordinator;  // "" = $LOCKSTEP_COORDINATOR, else kDefaultCoordinator
  std::string token_file;   // "" = $LOCKSTEP_TOKEN_FILE, else $LOCKSTEP_TOKEN, else none
  std::string output = "table";
  int64_t timeout_ms = 10000;
  bool watch = false;
  std::string export_output = "model.safetensors";  // export -o
  bool force = false;                               // export --force
  int64_t rank = -1;                                // logs --rank (-1: every rank)
  int64_t generation = 0;                           // logs --generation (0: every one)
  bool follow = false;                              // logs --follow
};

// A command line that passed every check.
struct Invocation {
  Command command = Command::kHelp;
  std::string coordinator;
  std::string token;  // sent on every call; empty sends none
  OutputFormat output = OutputFormat::kTable;
  absl::Duration rpc_timeout = absl::Seconds(10);
  std::string job_id;         // status, watch, cancel
  v1::JobSpec spec;           // submit
  bool watch = false;         // submit --watch
  std::string checkpoint;     // export: the checkpoint file
  std::string export_output;  // export: the safetensors file to write
  bool force = false;         // export: replace existing output files
  int32_t rank = -1;          // logs: only this rank's lines (-1: every rank's)
  int64_t generation = 0;     // logs: only this generation's (0: every one's)
  bool follow = false;        // logs: keep printing new lines until the job ends
};

// The target to dial: the flag when set, else the environment's value when set, else
// kDefaultCoordinator. `env_value` may be null.
std::string ResolveCoordinator(const std::string& flag_value, const char* env_value);

// True when the arguments before "--" ask for help: --help, -help, -h or --h. lockstepctl
// answers these itself so that help exits 0.
bool WantsHelp(int argc, char** argv);

// Checks every flag on the command line against the absl flag registry (the name exists; the
// value parses; a non-boolean flag has a value), mirroring absl::ParseCommandLine's rules.
// absl::ParseCommandLine exits with status 1 on a bad flag, which lockstepctl reserves for
// "the job failed"; running this first turns those mistakes into usage errors (exit 2).
// Parsing the values sets the flags, exactly as absl::ParseCommandLine will again.
absl::Status CheckFlags(int argc, char** argv);

// Builds the Invocation from the positional arguments (argv[0] excluded) and the flag values.
// Reads and parses the job spec of `submit` ("-" reads `stdin_stream`).
absl::StatusOr<Invocation> ParseInvocation(const std::vector<std::string>& args,
                                           const FlagValues& flags, const char* coordinator_env,
                                           std::istream& stdin_stream);

// Parses a JobSpec from protobuf's JSON mapping (lowerCamelCase or original field names).
// Unknown fields are errors: a misspelt field would otherwise be silently ignored. `source` names
// the input in the error ("spec.json", "<stdin>").
absl::StatusOr<v1::JobSpec> ParseJobSpecJson(absl::string_view json, absl::string_view source);

// Reads the file at `path` ("-" = `stdin_stream`) and parses it with ParseJobSpecJson.
absl::StatusOr<v1::JobSpec> ReadJobSpec(const std::string& path, std::istream& stdin_stream);

// The short usage text printed after a usage error.
std::string UsageText();

// The --help text: usage, commands, flags, exit codes.
std::string HelpText();

}  // namespace lockstep::cli
