// Command-line checking for lockstepctl. The flag pre-check mirrors absl::ParseCommandLine
// (abseil 20220623, absl/flags/parse.cc): names with one or two dashes, "--name=value" or
// "--name value" for non-boolean flags, "--name"/"--noname" for booleans, "--" ends the flags.
#include "cli/invocation.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>
#include <tuple>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "common/auth.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"

namespace lockstep::cli {
namespace {

constexpr char kUsageBody[] =
    "usage: lockstepctl [--coordinator=HOST:PORT] [--token_file=FILE] [--tls_ca=FILE]\n"
    "                   [--tls_cert=FILE --tls_key=FILE] [--output=table|json]\n"
    "                   [--timeout_ms=N] COMMAND [ARGS]\n"
    "commands:\n"
    "  submit FILE [--watch]  submit a JSON job spec ('-' reads stdin), print the job id\n"
    "  list                   list jobs\n"
    "  queue                  the queued jobs in the order they will start, with why each\n"
    "                         waits\n"
    "  status JOB             show one job in detail\n"
    "  watch JOB              follow a job until it ends (exit 0 only if it succeeded)\n"
    "  cancel JOB             cancel a job\n"
    "  suspend JOB            stop a job, its state kept in its workers' memory\n"
    "  resume JOB             queue a suspended job again: it goes on from that state\n"
    "  workers                list the registered workers and rejected clients\n"
    "  health                 ask the coordinator's gRPC health service (exit 0 if SERVING)\n"
    "  logs JOB [--rank=N] [--generation=G] [--follow]\n"
    "                         print a program job's output, each line prefixed with its\n"
    "                         rank as torchrun's --tee does ([default0]:); --follow keeps\n"
    "                         printing until the job ends\n"
    "  export CHECKPOINT [-o FILE] [--force]\n"
    "                         convert a checkpoint file to safetensors (default\n"
    "                         model.safetensors; config.json is written beside it); offline;\n"
    "                         refuses to replace either file unless --force\n";

// Flags that absl handles itself without registering them (DeduceUsageFlags in parse.cc).
constexpr absl::string_view kAbslUsageFlags[] = {"help",        "helpfull", "helpshort",
                                                 "helppackage", "version",  "only_check_args",
                                                 "helpon",      "helpmatch"};

// The global flags, in the order --help lists them. They are defined in main.cc.
constexpr absl::string_view kOwnFlags[] = {
    "coordinator", "token_file", "tls_ca", "tls_cert", "tls_key", "tls_server_name",
    "output",      "timeout_ms", "watch",  "o",        "force",   "rank", "generation",
    "follow"};

struct CommandInfo {
  Command command;
  absl::string_view name;
  absl::string_view args;  // positional arguments after the command word, for messages
  size_t arg_count;
};

constexpr CommandInfo kCommands[] = {
    {Command::kSubmit, "submit", "FILE", 1}, {Command::kList, "list", "", 0},
    {Command::kQueue, "queue", "", 0},
    {Command::kStatus, "status", "JOB", 1},  {Command::kWatch, "watch", "JOB", 1},
    {Command::kCancel, "cancel", "JOB", 1},  {Command::kSuspend, "suspend", "JOB", 1},
    {Command::kResume, "resume", "JOB", 1},  {Command::kWorkers, "workers", "", 0},
    {Command::kHealth, "health", "", 0},     {Command::kHelp, "help", "", 0},
    {Command::kExport, "export", "CHECKPOINT", 1}, {Command::kLogs, "logs", "JOB", 1},
};

// (name, value, has '=') of an argument whose leading dashes are already removed.
std::tuple<absl::string_view, absl::string_view, bool> SplitNameAndValue(absl::string_view arg) {
  const size_t eq = arg.find('=');
  if (eq == absl::string_view::npos) return {arg, "", false};
  return {arg.substr(0, eq), arg.substr(eq + 1), true};
}

// Checks one flag argument; `next` is the following argument or null. Sets *consumed_next when
// the flag takes `next` as its value.
absl::Status CheckOneFlag(absl::string_view arg, const char* next, bool* consumed_next) {
  const std::string original(arg);
  absl::ConsumePrefix(&arg, "-");
  absl::ConsumePrefix(&arg, "-");
  auto [name, value, has_value] = SplitNameAndValue(arg);
  for (absl::string_view usage_flag : kAbslUsageFlags) {
    if (name == usage_flag) return absl::OkStatus();
  }
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  bool negative = false;
  if (flag == nullptr && absl::StartsWith(name, "no")) {
    flag = absl::FindCommandLineFlag(name.substr(2));
    negative = flag != nullptr;
  }
  if (flag == nullptr || flag->IsRetired()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown flag ", original));
  }
  std::string value_text(value);
  if (flag->IsOfType<bool>()) {
    if (negative && has_value) {
      return absl::InvalidArgumentError(absl::StrCat("flag ", original, " takes no value"));
    }
    if (!has_value) return absl::OkStatus();
    if (value.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("flag ", original, " needs a value"));
    }
  } else {
    if (negative) return absl::InvalidArgumentError(absl::StrCat("unknown flag ", original));
    if (!has_value) {
      if (next == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("flag ", original, " needs a value"));
      }
      value_text = next;
      *consumed_next = true;
    }
  }
  std::string error;
  if (!flag->ParseFrom(value_text, &error)) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid value '", value_text, "' for --", flag->Name(), ": ", error));
  }
  return absl::OkStatus();
}

// The protobuf JSON parser's message on one line. A syntax error comes as three lines: the
// message, a stretch of the input around the error, and a caret under the error's position;
// that becomes "message near 'input'".
std::string OneLineParseError(absl::string_view text) {
  text = absl::StripTrailingAsciiWhitespace(text);
  const size_t first_break = text.find('\n');
  const size_t last_break = text.rfind('\n');
  if (first_break == absl::string_view::npos) return std::string(text);
  const absl::string_view message = absl::StripAsciiWhitespace(text.substr(0, first_break));
  const absl::string_view caret_line = text.substr(last_break + 1);
  std::string context;
  if (last_break > first_break && absl::StripLeadingAsciiWhitespace(caret_line) == "^") {
    context = std::string(text.substr(first_break + 1, last_break - first_break - 1));
  } else {
    context = std::string(text.substr(first_break + 1));
  }
  context = absl::StrReplaceAll(context, {{"\n", " "}, {"\r", " "}, {"\t", " "}});
  absl::StripAsciiWhitespace(&context);
  if (context.empty()) return std::string(message);
  return absl::StrCat(message, " near '", context, "'");
}

}  // namespace

std::string ResolveCoordinator(const std::string& flag_value, const char* env_value) {
  if (!flag_value.empty()) return flag_value;
  if (env_value != nullptr && env_value[0] != '\0') return env_value;
  return kDefaultCoordinator;
}

bool WantsHelp(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") return false;
    if (arg == "--help" || arg == "-help" || arg == "-h" || arg == "--h") return true;
  }
  return false;
}

absl::Status CheckFlags(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;  // positional, or "-" for stdin
    bool consumed_next = false;
    const char* next = i + 1 < argc ? argv[i + 1] : nullptr;
    LOCKSTEP_RETURN_IF_ERROR(CheckOneFlag(arg, next, &consumed_next));
    if (consumed_next) ++i;
  }
  return absl::OkStatus();
}

absl::StatusOr<Invocation> ParseInvocation(const std::vector<std::string>& args,
                                           const FlagValues& flags, const char* coordinator_env,
                                           std::istream& stdin_stream) {
  Invocation inv;
  inv.coordinator = ResolveCoordinator(flags.coordinator, coordinator_env);
  absl::StatusOr<std::string> token = ResolveToken(flags.token_file);
  if (!token.ok()) return absl::InvalidArgumentError(token.status().message());
  inv.token = *std::move(token);
  if (flags.output == "table") {
    inv.output = OutputFormat::kTable;
  } else if (flags.output == "json") {
    inv.output = OutputFormat::kJson;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--output must be table or json, not '", flags.output, "'"));
  }
  if (flags.timeout_ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--timeout_ms must be > 0, not ", flags.timeout_ms));
  }
  inv.rpc_timeout = absl::Milliseconds(flags.timeout_ms);

  if (args.empty()) return absl::InvalidArgumentError("missing command");
  const CommandInfo* info = nullptr;
  for (const CommandInfo& candidate : kCommands) {
    if (args[0] == candidate.name) info = &candidate;
  }
  if (info == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown command '", args[0], "'"));
  }
  inv.command = info->command;
  const size_t given = args.size() - 1;
  if (given != info->arg_count) {
    if (info->arg_count == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(info->name, " takes no arguments, got '", args[1], "'"));
    }
    if (given < info->arg_count) {
      return absl::InvalidArgumentError(
          absl::StrCat(info->name, " needs ", info->args, ": ", info->name, " ", info->args));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(info->name, " takes one argument (", info->args, "), got ", given, ": ",
                     absl::StrJoin(args.begin() + 1, args.end(), " ")));
  }
  if (flags.watch && inv.command != Command::kSubmit) {
    return absl::InvalidArgumentError("--watch only applies to submit");
  }
  inv.watch = flags.watch;
  if (flags.export_output != "model.safetensors" && inv.command != Command::kExport) {
    return absl::InvalidArgumentError("-o only applies to export");
  }
  if (flags.force && inv.command != Command::kExport) {
    return absl::InvalidArgumentError("--force only applies to export");
  }
  if ((flags.rank != -1 || flags.generation != 0 || flags.follow) &&
      inv.command != Command::kLogs) {
    return absl::InvalidArgumentError("--rank, --generation and --follow only apply to logs");
  }

  switch (inv.command) {
    case Command::kSubmit: {
      absl::StatusOr<v1::JobSpec> spec = ReadJobSpec(args[1], stdin_stream);
      if (!spec.ok()) return spec.status();
      inv.spec = *std::move(spec);
      break;
    }
    case Command::kLogs:
      if (flags.rank < -1 || flags.rank > INT32_MAX) {
        return absl::InvalidArgumentError(
            absl::StrCat("--rank: must be a rank (>= 0), got ", flags.rank));
      }
      if (flags.generation < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("--generation: must be >= 1, got ", flags.generation));
      }
      inv.rank = static_cast<int32_t>(flags.rank);
      inv.generation = flags.generation;
      inv.follow = flags.follow;
      [[fallthrough]];
    case Command::kStatus:
    case Command::kWatch:
    case Command::kCancel:
    case Command::kSuspend:
    case Command::kResume:
      if (args[1].empty()) return absl::InvalidArgumentError("JOB must not be empty");
      inv.job_id = args[1];
      break;
    case Command::kExport:
      if (args[1].empty()) return absl::InvalidArgumentError("CHECKPOINT must not be empty");
      if (flags.export_output.empty()) return absl::InvalidArgumentError("-o must not be empty");
      inv.checkpoint = args[1];
      inv.export_output = flags.export_output;
      inv.force = flags.force;
      break;
    case Command::kHelp:
    case Command::kList:
    case Command::kQueue:
    case Command::kWorkers:
    case Command::kHealth:
      break;
  }
  return inv;
}

absl::StatusOr<v1::JobSpec> ParseJobSpecJson(absl::string_view json, absl::string_view source) {
  if (absl::StripAsciiWhitespace(json).empty()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot parse job spec ", source, ": empty"));
  }
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  v1::JobSpec spec;
  const auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &spec, options);
  if (!status.ok()) {
    const auto message = status.message();
    return absl::InvalidArgumentError(
        absl::StrCat("cannot parse job spec ", source, ": ",
                     OneLineParseError(absl::string_view(message.data(), message.size()))));
  }
  return spec;
}

absl::StatusOr<v1::JobSpec> ReadJobSpec(const std::string& path, std::istream& stdin_stream) {
  if (path == "-") {
    std::string json((std::istreambuf_iterator<char>(stdin_stream)),
                     std::istreambuf_iterator<char>());
    if (stdin_stream.bad()) {
      return absl::InvalidArgumentError("cannot read job spec from <stdin>");
    }
    return ParseJobSpecJson(json, "<stdin>");
  }
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read job spec ", path, ": is a directory"));
  }
  std::ifstream file(path, std::ios::binary);
  if (!file.is_open()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read job spec ", path, ": ", std::strerror(errno)));
  }
  std::string json((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (file.bad()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read job spec ", path, ": read error"));
  }
  return ParseJobSpecJson(json, path);
}

std::string UsageText() {
  return absl::StrCat(kUsageBody, "Run 'lockstepctl --help' for details.\n");
}

std::string HelpText() {
  std::string out =
      "lockstepctl: the command line of Lockstep, elastic data-parallel training.\n\n";
  out += kUsageBody;
  out += "\nflags (they may also follow the command word):\n";
  for (absl::string_view name : kOwnFlags) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr) continue;  // a binary that does not define it (e.g. a test)
    absl::StrAppendFormat(&out, "  --%-14s %s\n", flag->Name(), flag->Help());
  }
  out +=
      "\njob spec files use protobuf's JSON mapping of lockstep.v1.JobSpec; see\n"
      "docs/job_spec_example.md.\n"
      "\nwatch prints state and membership changes with their time, and a progress line "
      "(rewritten\n"
      "in place on a terminal, at most one line a second otherwise). With --output=json, watch\n"
      "prints every event as one JSON document per line.\n"
      "\nexit codes:\n"
      "  0  done; for watch and submit --watch: the job SUCCEEDED\n"
      "  1  the watched job FAILED or was CANCELLED\n"
      "  2  usage error: bad command line, unreadable or malformed job spec\n"
      "  3  RPC error (coordinator unreachable, job not found, spec refused, stream broken)\n"
      "  4  export: the checkpoint cannot be read or is damaged, the output exists (see\n"
      "     --force) or cannot be written\n"
      "\nexport reads the checkpoint whole and checks it (lengths, checksum, tensor names and\n"
      "shapes against the parameters) before it writes anything. It writes FILE and, when the\n"
      "checkpoint records the model's configuration, config.json in FILE's directory, each\n"
      "atomically (a reader sees the old file or the new one). If either exists already,\n"
      "nothing is written unless --force is given; then both are replaced.\n"
      "\nWith a token and no TLS, a coordinator beyond loopback gets the token in plaintext;\n"
      "lockstepctl warns on stderr when that happens.\n";
  return out;
}

}  // namespace lockstep::cli
