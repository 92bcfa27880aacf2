// Program jobs' specs (JobSpec.program): defaults and validation, each refusal naming its
// field. A program job sets none of the built-in training's fields but checkpoint_dir and
// keep_checkpoints, where its workers persist lockstep.torch.Checkpointer's saves.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/program.h"
#include "common/status_macros.h"
#include "coordinator/core/job_spec.h"

namespace lockstep::coordinator {
namespace {

constexpr int32_t kMaxPersistEverySaves = 1000000;
constexpr int32_t kMaxKeepCheckpoints = 1000;

absl::Status Invalid(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

bool IsVariableName(const std::string& name) {
  if (name.empty() || absl::ascii_isdigit(static_cast<unsigned char>(name[0]))) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
  }
  return true;
}

// The built-in training's fields, which mean nothing for a program: set ones are refused.
absl::Status CheckNoTrainingFields(const v1::JobSpec& spec) {
  const struct {
    const char* field;
    bool set;
  } fields[] = {
      {"model", spec.has_model()},
      {"dataset", spec.has_dataset()},
      {"optimizer", spec.has_optimizer()},
      {"global_batch_size", spec.global_batch_size() != 0},
      {"micro_shards", spec.micro_shards() != 0},
      {"micro_batch_size", spec.micro_batch_size() != 0},
      {"epochs", spec.epochs() != 0},
      {"max_steps", spec.max_steps() != 0},
      {"seed", spec.seed() != 0},
      {"deterministic", spec.deterministic()},
      {"bucket_size_kib", spec.bucket_size_kib() != 0},
      {"collective_timeout_ms", spec.collective_timeout_ms() != 0},
      {"checkpoint_every_steps", spec.checkpoint_every_steps() != 0},
      {"skip_evaluation", spec.skip_evaluation()},
      {"precision", !spec.precision().empty()},
      {"checkpoint_failure_policy", !spec.checkpoint_failure_policy().empty()},
      {"init_from_checkpoint", spec.has_init_from_checkpoint()},
      {"eval_every_steps", spec.eval_every_steps() != 0},
      {"sample", spec.has_sample()},
      {"output_dir", !spec.output_dir().empty()},
  };
  for (const auto& f : fields) {
    if (!f.set) continue;
    return Invalid(f.field,
                   std::string(f.field) == "model"
                       ? "a job runs either a built-in model or a program, not both"
                       : "means nothing for a program job (the program itself decides it); "
                         "remove it");
  }
  return absl::OkStatus();
}

absl::Status CheckProgram(const v1::ProgramSpec& program) {
  if (program.argv().empty()) {
    return Invalid("program.argv", "required: the interpreter or executable, then its arguments");
  }
  if (program.argv_size() > kMaxProgramArgs) {
    return Invalid("program.argv", absl::StrCat("at most ", kMaxProgramArgs, " elements, got ",
                                                program.argv_size()));
  }
  if (program.argv(0).empty()) {
    return Invalid("program.argv[0]", "empty: name the interpreter or executable");
  }
  for (int i = 0; i < program.argv_size(); ++i) {
    LOCKSTEP_RETURN_IF_ERROR(
        CheckText(absl::StrCat("program.argv[", i, "]"), program.argv(i), kMaxPathBytes));
  }
  if (program.workdir().empty()) {
    return Invalid("program.workdir",
                   "required: the directory the program runs in, inside the workers' "
                   "--programs_root");
  }
  LOCKSTEP_RETURN_IF_ERROR(CheckText("program.workdir", program.workdir(), kMaxPathBytes));
  if (program.workdir()[0] != '/') {
    return Invalid("program.workdir",
                   absl::StrCat("must be an absolute path, got \"", program.workdir(), "\""));
  }
  if (program.env_size() > kMaxProgramEnv) {
    return Invalid("program.env", absl::StrCat("at most ", kMaxProgramEnv, " variables, got ",
                                               program.env_size()));
  }
  for (const auto& [name, value] : program.env()) {
    const std::string field = absl::StrCat("program.env[", name, "]");
    if (name.size() > 256 || !IsVariableName(name)) {
      return Invalid("program.env",
                     absl::StrCat("\"", absl::CHexEscape(name.substr(0, 256)),
                                  "\" is not a variable name (letters, digits and _, not "
                                  "starting with a digit)"));
    }
    if (IsReservedProgramVariable(name)) {
      return Invalid(field, "set by the worker itself (torchrun's and Lockstep's variables)");
    }
    if (value.size() > kMaxProgramEnvValueBytes) {
      return Invalid(field, absl::StrCat("at most ", kMaxProgramEnvValueBytes, " bytes, got ",
                                         value.size()));
    }
    if (value.find('\0') != std::string::npos) return Invalid(field, "holds a NUL byte");
  }
  const std::string& arg = program.local_rank_arg();
  if (!arg.empty() && arg != "--local_rank" && arg != "--local-rank") {
    return Invalid("program.local_rank_arg",
                   absl::StrCat("must be \"\", \"--local_rank\" or \"--local-rank\", got \"",
                                absl::CHexEscape(arg.substr(0, 64)), "\""));
  }
  if (program.stop_grace_ms() < 0 || program.stop_grace_ms() > kMaxStopGraceMs) {
    return Invalid("program.stop_grace_ms", absl::StrCat("must be in [0, ", kMaxStopGraceMs,
                                                         "], got ", program.stop_grace_ms()));
  }
  if (program.fatal_exit_codes_size() > kMaxFatalExitCodes) {
    return Invalid("program.fatal_exit_codes",
                   absl::StrCat("at most ", kMaxFatalExitCodes, " codes, got ",
                                program.fatal_exit_codes_size()));
  }
  for (int i = 0; i < program.fatal_exit_codes_size(); ++i) {
    const int32_t code = program.fatal_exit_codes(i);
    if (code < 1 || code > 255) {
      return Invalid(absl::StrCat("program.fatal_exit_codes[", i, "]"),
                     absl::StrCat("must be an exit status in [1, 255], got ", code));
    }
  }
  return absl::OkStatus();
}

}  // namespace

void ApplyProgramSpecDefaults(v1::JobSpec* spec) {
  if (spec->min_workers() == 0) spec->set_min_workers(1);
  if (spec->max_workers() == 0) spec->set_max_workers(std::max(1, spec->min_workers()));
  if (spec->step_timeout_ms() == 0) spec->set_step_timeout_ms(60000);
  if (spec->threads_per_worker() == 0) spec->set_threads_per_worker(1);
  if (spec->device().empty()) spec->set_device("cpu");
  if (spec->program().stop_grace_ms() == 0) {
    spec->mutable_program()->set_stop_grace_ms(kDefaultStopGraceMs);
  }
}

absl::Status ValidateProgramJob(const v1::JobSpec& spec) {
  if (const size_t bytes = spec.ByteSizeLong(); bytes > kMaxJobSpecBytes) {
    return absl::InvalidArgumentError(absl::StrCat("spec: at most ", kMaxJobSpecBytes,
                                                   " bytes encoded, got ", bytes));
  }
  LOCKSTEP_RETURN_IF_ERROR(CheckText("name", spec.name(), kMaxJobNameBytes));
  LOCKSTEP_RETURN_IF_ERROR(CheckNoTrainingFields(spec));
  LOCKSTEP_RETURN_IF_ERROR(CheckProgram(spec.program()));
  if (spec.device() != "cpu" && spec.device() != "cuda") {
    return Invalid("device", absl::StrCat("must be \"cpu\" or \"cuda\", got \"",
                                          absl::CHexEscape(spec.device().substr(0, 64)), "\""));
  }
  if (spec.min_workers() <= 0) {
    return Invalid("min_workers", absl::StrCat("must be > 0, got ", spec.min_workers()));
  }
  if (spec.max_workers() < spec.min_workers()) {
    return Invalid("max_workers", absl::StrCat("min_workers ", spec.min_workers(),
                                               " > max_workers ", spec.max_workers()));
  }
  for (const auto& [name, value] :
       {std::pair<const char*, int64_t>{"heartbeat_timeout_ms", spec.heartbeat_timeout_ms()},
        {"step_timeout_ms", spec.step_timeout_ms()},
        {"rendezvous_timeout_ms", spec.rendezvous_timeout_ms()}}) {
    if (value < 0) return Invalid(name, absl::StrCat("must be >= 0, got ", value));
  }
  if (spec.threads_per_worker() < 0 || spec.threads_per_worker() > 256) {
    return Invalid("threads_per_worker",
                   absl::StrCat("must be in [0, 256], got ", spec.threads_per_worker()));
  }
  if (spec.max_restarts() < 0 || spec.max_restarts() > kMaxRestartsLimit) {
    return Invalid("max_restarts", absl::StrCat("must be in [0, ", kMaxRestartsLimit, "], got ",
                                                spec.max_restarts()));
  }
  // The in-memory checkpoints' persistence (lockstep.torch.Checkpointer's saves on disk).
  const int32_t persist = spec.program().persist_every_saves();
  if (persist < 0 || persist > kMaxPersistEverySaves) {
    return Invalid("program.persist_every_saves",
                   absl::StrCat("must be in [0, ", kMaxPersistEverySaves, "], got ", persist));
  }
  if (persist > 0 && spec.checkpoint_dir().empty()) {
    return Invalid("checkpoint_dir",
                   "required when program.persist_every_saves > 0 (where the saves are written)");
  }
  if (persist == 0 && !spec.checkpoint_dir().empty()) {
    return Invalid("program.persist_every_saves",
                   "required when checkpoint_dir is set: every how many "
                   "lockstep.torch.Checkpointer saves the workers write one there");
  }
  if (spec.keep_checkpoints() < 0 || spec.keep_checkpoints() > kMaxKeepCheckpoints) {
    return Invalid("keep_checkpoints", absl::StrCat("must be in [0, ", kMaxKeepCheckpoints,
                                                    "], got ", spec.keep_checkpoints()));
  }
  if (spec.keep_checkpoints() > 0 && persist == 0) {
    return Invalid("keep_checkpoints", "means nothing without program.persist_every_saves");
  }
  return absl::OkStatus();
}

}  // namespace lockstep::coordinator
