// Job spec validation and defaults.
#include "coordinator/core/job_spec.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/data_format.h"
#include "common/model_family.h"
#include "common/model_layout.h"
#include "common/status_macros.h"

namespace lockstep::coordinator {
namespace {

absl::Status Invalid(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// The largest divisor of b that is <= limit: enough micro-shards for `limit` workers, and
// shards big enough to keep the matrix products efficient.
int32_t DefaultMicroShards(int64_t b, int64_t limit) {
  for (int64_t m = std::min<int64_t>(limit, b); m > 1; --m) {
    if (b % m == 0) return static_cast<int32_t>(m);
  }
  return 1;
}

// The smallest divisor of b that is >= k (b itself at worst).
int32_t SmallestDivisorAtLeast(int64_t b, int64_t k) {
  for (int64_t m = std::max<int64_t>(1, k); m < b; ++m) {
    if (b % m == 0) return static_cast<int32_t>(m);
  }
  return static_cast<int32_t>(b);  // b <= 2^24 (validated)
}

// The sizes of everything in a spec, before any other check reads it (docs/job_spec_example.md).
absl::Status CheckBounds(const v1::JobSpec& spec) {
  if (const size_t bytes = spec.ByteSizeLong(); bytes > kMaxJobSpecBytes) {
    return absl::InvalidArgumentError(absl::StrCat("spec: at most ", kMaxJobSpecBytes,
                                                   " bytes encoded, got ", bytes));
  }
  LOCKSTEP_RETURN_IF_ERROR(CheckText("name", spec.name(), kMaxJobNameBytes));
  const struct {
    const char* field;
    const std::string& value;
  } paths[] = {{"dataset.path", spec.dataset().path()},
               {"dataset.validation_path", spec.dataset().validation_path()},
               {"checkpoint_dir", spec.checkpoint_dir()},
               {"output_dir", spec.output_dir()},
               {"init_from_checkpoint.path", spec.init_from_checkpoint().path()}};
  for (const auto& path : paths) {
    LOCKSTEP_RETURN_IF_ERROR(CheckText(path.field, path.value, kMaxPathBytes));
  }
  for (const auto& text : {std::pair<const char*, const std::string&>{"model.type", spec.model().type()},
                           {"model.mlp.activation", spec.model().mlp().activation()},
                           {"dataset.type", spec.dataset().type()},
                           {"optimizer.type", spec.optimizer().type()},
                           {"device", spec.device()},
                           {"precision", spec.precision()},
                           {"checkpoint_failure_policy", spec.checkpoint_failure_policy()}}) {
    LOCKSTEP_RETURN_IF_ERROR(CheckText(text.first, text.second, 64));
  }
  if (spec.model().mlp().hidden_widths_size() > kMaxHiddenLayers) {
    return Invalid("model.mlp.hidden_widths",
                   absl::StrCat("at most ", kMaxHiddenLayers, " layers, got ",
                                spec.model().mlp().hidden_widths_size()));
  }
  if (spec.model().frozen_parameters_size() > kMaxFrozenPatterns) {
    return Invalid("model.frozen_parameters",
                   absl::StrCat("at most ", kMaxFrozenPatterns, " patterns, got ",
                                spec.model().frozen_parameters_size()));
  }
  for (int i = 0; i < spec.model().frozen_parameters_size(); ++i) {
    LOCKSTEP_RETURN_IF_ERROR(CheckText(absl::StrCat("model.frozen_parameters[", i, "]"),
                                       spec.model().frozen_parameters(i), 256));
  }
  if (spec.sample().prompt().size() > kMaxPromptBytes) {
    return Invalid("sample.prompt", absl::StrCat("at most ", kMaxPromptBytes, " bytes, got ",
                                                 spec.sample().prompt().size()));
  }
  if (spec.sample().prompt_tokens_size() > static_cast<int>(kMaxPromptBytes)) {
    return Invalid("sample.prompt_tokens", absl::StrCat("at most ", kMaxPromptBytes,
                                                        " tokens, got ",
                                                        spec.sample().prompt_tokens_size()));
  }
  if (spec.has_max_restarts() && spec.max_restarts() > kMaxRestartsLimit) {
    return Invalid("max_restarts",
                   absl::StrCat("at most ", kMaxRestartsLimit, ", got ", spec.max_restarts()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckText(const std::string& field, const std::string& value, size_t limit) {
  if (value.size() > limit) {
    return Invalid(field, absl::StrCat("at most ", limit, " bytes, got ", value.size()));
  }
  for (size_t i = 0; i < value.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(value[i]);
    if (c < 0x20 || c == 0x7f) {
      return Invalid(field, absl::StrCat("holds control byte ", int{c}, " at offset ", i));
    }
  }
  return absl::OkStatus();
}

void ApplyJobSpecDefaults(v1::JobSpec* spec) {
  if (spec->has_program()) return ApplyProgramSpecDefaults(spec);
  NormalizeModelSpec(*spec->mutable_model());
  // (A model that is not one family's is left as it is, for validation to name.)
  if (const ModelFamily* family = FindModelFamily(spec->model().type());
      family != nullptr && family->apply_defaults != nullptr &&
      ValidateModelForm(spec->model()).ok()) {
    family->apply_defaults(*spec->mutable_model());
  }
  if (const DataFormat* format = FindDataFormat(spec->dataset().type());
      format != nullptr && format->apply_defaults != nullptr) {
    format->apply_defaults(*spec->mutable_dataset());
  }
  if (spec->sample().max_tokens() > 0 && spec->sample().temperature() == 0) {
    spec->mutable_sample()->set_temperature(1.0);
  }
  v1::OptimizerSpec* opt = spec->mutable_optimizer();
  if (opt->type().empty()) opt->set_type("sgd");
  if (opt->type() == "adamw") {
    if (opt->beta1() == 0) opt->set_beta1(0.9);
    if (opt->beta2() == 0) opt->set_beta2(0.999);
    if (opt->epsilon() == 0) opt->set_epsilon(1e-8);
  }
  if (spec->min_workers() == 0) spec->set_min_workers(1);
  if (spec->max_workers() == 0) spec->set_max_workers(std::max(1, spec->min_workers()));
  if (spec->global_batch_size() > 0 && spec->micro_shards() == 0) {
    // Deterministic mode computes every micro-shard's gradient on its own, so the fewest
    // shards that still let max_workers ranks each take one are the fastest: at full size
    // every rank does one shard (64 shards of 4 samples ran at 0.17x of the default mode).
    spec->set_micro_shards(
        spec->deterministic()
            ? SmallestDivisorAtLeast(spec->global_batch_size(), spec->max_workers())
            : DefaultMicroShards(spec->global_batch_size(), 64));
  }
  if (spec->bucket_size_kib() == 0) spec->set_bucket_size_kib(256);
  if (spec->step_timeout_ms() == 0) spec->set_step_timeout_ms(60000);
  if (spec->collective_timeout_ms() == 0) spec->set_collective_timeout_ms(30000);
  if (spec->threads_per_worker() == 0) spec->set_threads_per_worker(1);
  if (spec->device().empty()) spec->set_device("cpu");
  if (spec->precision().empty()) spec->set_precision("fp32");
  if (spec->checkpoint_failure_policy().empty()) spec->set_checkpoint_failure_policy("warn");
}

absl::Status CheckJobPaths(const v1::JobSpec& spec, const PathRoots& data,
                           const PathRoots& checkpoints) {
  for (const auto& [field, path] :
       {std::pair<const char*, const std::string&>{"dataset.path", spec.dataset().path()},
        {"dataset.validation_path", spec.dataset().validation_path()}}) {
    LOCKSTEP_RETURN_IF_ERROR(data.Check(field, path));
  }
  for (const auto& [field, path] :
       {std::pair<const char*, const std::string&>{"checkpoint_dir", spec.checkpoint_dir()},
        {"output_dir", spec.output_dir()}}) {
    LOCKSTEP_RETURN_IF_ERROR(checkpoints.Check(field, path));
  }
  const std::string& init = spec.init_from_checkpoint().path();
  if (absl::Status s = checkpoints.Check("init_from_checkpoint.path", init); !s.ok()) {
    if (!data.Check("init_from_checkpoint.path", init).ok()) return s;
  }
  return absl::OkStatus();
}

namespace {

absl::Status ValidateDevice(const v1::JobSpec& spec) {
  if (spec.device() != "cpu" && spec.device() != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("device: must be \"cpu\" or \"cuda\", got \"", spec.device(), "\""));
  }
  if (spec.precision() != "fp32" && spec.precision() != "tf32" && spec.precision() != "bf16") {
    return Invalid("precision", absl::StrCat("must be \"fp32\", \"tf32\" or \"bf16\", got \"",
                                             spec.precision(), "\""));
  }
  if (spec.precision() != "fp32" && spec.device() != "cuda") {
    return Invalid("precision", absl::StrCat(spec.precision(),
                                             " needs GPU workers (\"device\": \"cuda\")"));
  }
  return absl::OkStatus();
}

// The family's own fields, then the frozen patterns against the tensors the spec implies.
absl::Status ValidateModel(const v1::ModelSpec& model) {
  if (model.type().empty()) {
    return Invalid("model.type", absl::StrCat("required (one of: ", ModelFamilyNames(), ")"));
  }
  const ModelFamily* family = FindModelFamily(model.type());
  if (family == nullptr) {
    return Invalid("model.type", absl::StrCat("unknown model \"", model.type(), "\" (one of: ",
                                              ModelFamilyNames(), ")"));
  }
  LOCKSTEP_RETURN_IF_ERROR(ValidateModelForm(model));
  LOCKSTEP_RETURN_IF_ERROR(family->validate(model));
  if (!model.frozen_parameters().empty()) {
    const std::vector<std::string> patterns(model.frozen_parameters().begin(),
                                            model.frozen_parameters().end());
    if (absl::StatusOr<std::vector<bool>> frozen =
            MatchFrozen(ModelTensors(model, 1, 2), patterns);
        !frozen.ok()) {
      return frozen.status();
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateDataset(const v1::DatasetSpec& data) {
  if (data.type().empty()) {
    return Invalid("dataset.type", absl::StrCat("required (one of: ", DataFormatNames(), ")"));
  }
  const DataFormat* format = FindDataFormat(data.type());
  if (format == nullptr) {
    return Invalid("dataset.type", absl::StrCat("unknown dataset type \"", data.type(),
                                                "\" (one of: ", DataFormatNames(), ")"));
  }
  return format->validate(data);
}

// What each family trains on: "mlp: fashion_mnist, idx, synthetic; gpt: text, tokens".
std::string FamilyData() {
  std::vector<std::string> parts;
  for (const ModelFamily* family : ModelFamilies()) {
    std::vector<std::string> formats;
    for (const DataFormat* format : DataFormats()) {
      if (format->language == family->language_model) formats.push_back(format->name);
    }
    parts.push_back(absl::StrCat(family->name, ": ", absl::StrJoin(formats, ", ")));
  }
  return absl::StrJoin(parts, "; ");
}

// The model against its data and device (both valid on their own by now).
absl::Status ValidateModelOnData(const v1::JobSpec& spec) {
  const v1::ModelSpec& model = spec.model();
  const v1::DatasetSpec& data = spec.dataset();
  if (FindDataFormat(data.type())->language != IsLanguageModel(model)) {
    return Invalid("dataset.type",
                   absl::StrCat("model type ", model.type(), " cannot train on ", data.type(),
                                " data (", FamilyData(), ")"));
  }
  if (const ModelFamily* family = FindModelFamily(model.type());
      family->validate_on_device != nullptr) {
    LOCKSTEP_RETURN_IF_ERROR(family->validate_on_device(spec));
  }
  return absl::OkStatus();
}

// The language-model families' names: "gpt".
std::string LanguageFamilyNames() {
  std::vector<std::string> names;
  for (const ModelFamily* family : ModelFamilies()) {
    if (family->language_model) names.push_back(family->name);
  }
  return absl::StrJoin(names, ", ");
}

absl::Status ValidateSample(const v1::JobSpec& spec) {
  const v1::ModelSpec& model = spec.model();
  const int32_t vocab = TokenShapeOf(model).vocab;
  const v1::DatasetSpec& data = spec.dataset();
  const v1::SampleSpec& sample = spec.sample();
  if (sample.max_tokens() < 0 || sample.max_tokens() > 4096) {
    return Invalid("sample.max_tokens", absl::StrCat("must be in [0, 4096], got ", sample.max_tokens()));
  }
  if (sample.max_tokens() > 0) {
    if (!IsLanguageModel(model)) {
      return Invalid("sample", absl::StrCat("only language models (", LanguageFamilyNames(),
                                            ") generate text"));
    }
    if (!(sample.temperature() > 0) || sample.temperature() > 100) {
      return Invalid("sample.temperature",
                     absl::StrCat("must be in (0, 100], got ", sample.temperature()));
    }
    if (sample.top_k() < 0) {
      return Invalid("sample.top_k", absl::StrCat("must be >= 0, got ", sample.top_k()));
    }
    if (data.type() == "tokens" && !sample.prompt().empty()) {
      return Invalid("sample.prompt", "token data has no text; give sample.prompt_tokens");
    }
    for (int i = 0; i < sample.prompt_tokens_size(); ++i) {
      if (sample.prompt_tokens(i) < 0 || sample.prompt_tokens(i) >= vocab) {
        return Invalid(absl::StrCat("sample.prompt_tokens[", i, "]"),
                       absl::StrCat(sample.prompt_tokens(i), " is outside [0, vocab_size ",
                                    vocab, ")"));
      }
    }
    if (data.type() == "text" && vocab < 256) {
      for (unsigned char c : sample.prompt()) {
        if (c >= vocab) {
          return Invalid("sample.prompt", absl::StrCat("holds byte ", int{c},
                                                       ", beyond vocab_size ", vocab));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateOptimizer(const v1::OptimizerSpec& opt) {
  if (opt.type() != "sgd" && opt.type() != "adamw") {
    return Invalid("optimizer.type",
                   absl::StrCat("unknown optimizer \"", opt.type(), "\" (one of: sgd, adamw)"));
  }
  if (!(opt.learning_rate() > 0) || opt.learning_rate() > 1e3) {
    return Invalid("optimizer.learning_rate",
                   absl::StrCat("must be in (0, 1000], got ", opt.learning_rate()));
  }
  if (!(opt.momentum() >= 0 && opt.momentum() < 1)) {
    return Invalid("optimizer.momentum", absl::StrCat("must be in [0, 1), got ", opt.momentum()));
  }
  // Upper bounds on every rate: an infinite or absurd one would only train NaNs (each update
  // multiplies the weights by 1 - lr * weight_decay).
  if (!(opt.weight_decay() >= 0 && opt.weight_decay() <= 100)) {
    return Invalid("optimizer.weight_decay",
                   absl::StrCat("must be in [0, 100], got ", opt.weight_decay()));
  }
  if (opt.type() == "adamw") {
    if (!(opt.beta1() >= 0 && opt.beta1() < 1)) {
      return Invalid("optimizer.beta1", absl::StrCat("must be in [0, 1), got ", opt.beta1()));
    }
    if (!(opt.beta2() >= 0 && opt.beta2() < 1)) {
      return Invalid("optimizer.beta2", absl::StrCat("must be in [0, 1), got ", opt.beta2()));
    }
    if (!(opt.epsilon() > 0 && opt.epsilon() <= 1)) {
      return Invalid("optimizer.epsilon", absl::StrCat("must be in (0, 1], got ", opt.epsilon()));
    }
  }
  if (!(opt.grad_clip_norm() >= 0 && std::isfinite(opt.grad_clip_norm()))) {
    return Invalid("optimizer.grad_clip_norm",
                   absl::StrCat("must be finite and >= 0, got ", opt.grad_clip_norm()));
  }
  if (opt.warmup_steps() < 0) {
    return Invalid("optimizer.warmup_steps",
                   absl::StrCat("must be >= 0, got ", opt.warmup_steps()));
  }
  return absl::OkStatus();
}

// The batch, its micro-shards and micro-batches.
absl::Status ValidateBatch(const v1::JobSpec& spec) {
  if (spec.global_batch_size() <= 0) {
    return Invalid("global_batch_size",
                   absl::StrCat("must be > 0, got ", spec.global_batch_size()));
  }
  if (spec.global_batch_size() > (int64_t{1} << 24)) {
    return Invalid("global_batch_size",
                   absl::StrCat("must be <= 16777216, got ", spec.global_batch_size()));
  }
  if (spec.micro_shards() <= 0) {
    return Invalid("micro_shards", absl::StrCat("must be > 0, got ", spec.micro_shards()));
  }
  if (spec.global_batch_size() % spec.micro_shards() != 0) {
    return Invalid("micro_shards",
                   absl::StrCat("global_batch_size ", spec.global_batch_size(),
                                " is not divisible into ", spec.micro_shards(), " micro-shards"));
  }
  if (spec.micro_batch_size() != 0) {
    const int64_t shard = spec.global_batch_size() / spec.micro_shards();
    if (spec.micro_batch_size() < 0 || spec.micro_batch_size() % shard != 0) {
      return Invalid("micro_batch_size",
                     absl::StrCat("must be a positive multiple of the micro-shard size ", shard,
                                  " (global_batch_size ", spec.global_batch_size(), " / ",
                                  spec.micro_shards(), " micro_shards), or 0; got ",
                                  spec.micro_batch_size()));
    }
    if (spec.deterministic() && spec.micro_batch_size() != shard) {
      return Invalid("micro_batch_size",
                     absl::StrCat("deterministic mode computes one micro-shard (", shard,
                                  " samples) at a time; set 0 or ", shard, ", got ",
                                  spec.micro_batch_size()));
    }
  }
  return absl::OkStatus();
}

// The job's length, workers, timeouts, restarts and checkpoints.
absl::Status ValidateOperations(const v1::JobSpec& spec) {
  if (spec.epochs() < 0) {
    return Invalid("epochs", absl::StrCat("must be >= 0, got ", spec.epochs()));
  }
  if (spec.max_steps() < 0) {
    return Invalid("max_steps", absl::StrCat("must be >= 0, got ", spec.max_steps()));
  }
  if (spec.epochs() == 0 && spec.max_steps() == 0) {
    return Invalid("epochs", "set epochs or max_steps to a positive value");
  }
  if (spec.min_workers() <= 0) {
    return Invalid("min_workers", absl::StrCat("must be > 0, got ", spec.min_workers()));
  }
  if (spec.max_workers() < spec.min_workers()) {
    return Invalid("max_workers", absl::StrCat("min_workers ", spec.min_workers(),
                                               " > max_workers ", spec.max_workers()));
  }
  if (spec.max_workers() > spec.micro_shards()) {
    return Invalid("max_workers",
                   absl::StrCat("max_workers ", spec.max_workers(), " exceeds micro_shards ",
                                spec.micro_shards(), " (each worker needs a micro-shard)"));
  }
  if (spec.bucket_size_kib() < 0) {
    return Invalid("bucket_size_kib", absl::StrCat("must be >= 0, got ", spec.bucket_size_kib()));
  }
  for (const auto& [name, value] :
       {std::pair<const char*, int64_t>{"heartbeat_timeout_ms", spec.heartbeat_timeout_ms()},
        {"step_timeout_ms", spec.step_timeout_ms()},
        {"collective_timeout_ms", spec.collective_timeout_ms()},
        {"rendezvous_timeout_ms", spec.rendezvous_timeout_ms()}}) {
    if (value < 0) return Invalid(name, absl::StrCat("must be >= 0, got ", value));
  }
  if (spec.threads_per_worker() < 0 || spec.threads_per_worker() > 256) {
    return Invalid("threads_per_worker",
                   absl::StrCat("must be in [0, 256], got ", spec.threads_per_worker()));
  }
  if (spec.max_restarts() < 0) {
    return Invalid("max_restarts", absl::StrCat("must be >= 0, got ", spec.max_restarts()));
  }
  if (spec.checkpoint_every_steps() < 0) {
    return Invalid("checkpoint_every_steps",
                   absl::StrCat("must be >= 0, got ", spec.checkpoint_every_steps()));
  }
  // Deterministic mode sums one fixed-point gradient per micro-shard; the fixed-point range
  // leaves headroom for at most 1024 addends (kernels::kMaxFixedPointAddends).
  if (spec.deterministic() && spec.micro_shards() > 1024) {
    return Invalid("micro_shards",
                   absl::StrCat("at most 1024 in deterministic mode, got ", spec.micro_shards()));
  }
  if (spec.checkpoint_every_steps() > 0 && spec.checkpoint_dir().empty()) {
    return Invalid("checkpoint_dir", "required when checkpoint_every_steps > 0");
  }
  if (spec.keep_checkpoints() < 0) {
    return Invalid("keep_checkpoints", absl::StrCat("must be >= 0, got ", spec.keep_checkpoints()));
  }
  if (spec.checkpoint_failure_policy() != "warn" && spec.checkpoint_failure_policy() != "fail") {
    return Invalid("checkpoint_failure_policy",
                   absl::StrCat("must be \"warn\" or \"fail\", got \"",
                                spec.checkpoint_failure_policy(), "\""));
  }
  if (spec.has_init_from_checkpoint() && spec.init_from_checkpoint().path().empty()) {
    return Invalid("init_from_checkpoint.path", "required (a checkpoint file or a directory)");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateJobSpec(const v1::JobSpec& spec) {
  if (spec.priority() < kMinPriority || spec.priority() > kMaxPriority) {
    return Invalid("priority", absl::StrCat("must be from ", kMinPriority, " to ", kMaxPriority,
                                            ", got ", spec.priority()));
  }
  if (spec.max_wall_time_ms() < 0) {
    return Invalid("max_wall_time_ms",
                   absl::StrCat("must be >= 0 (0: no limit), got ", spec.max_wall_time_ms()));
  }
  if (spec.has_program()) return ValidateProgramJob(spec);
  LOCKSTEP_RETURN_IF_ERROR(CheckBounds(spec));
  LOCKSTEP_RETURN_IF_ERROR(ValidateDevice(spec));
  LOCKSTEP_RETURN_IF_ERROR(ValidateModel(spec.model()));
  LOCKSTEP_RETURN_IF_ERROR(ValidateDataset(spec.dataset()));
  LOCKSTEP_RETURN_IF_ERROR(ValidateModelOnData(spec));
  LOCKSTEP_RETURN_IF_ERROR(ValidateSample(spec));
  if (spec.eval_every_steps() < 0) {
    return Invalid("eval_every_steps", absl::StrCat("must be >= 0, got ", spec.eval_every_steps()));
  }
  LOCKSTEP_RETURN_IF_ERROR(ValidateOptimizer(spec.optimizer()));
  LOCKSTEP_RETURN_IF_ERROR(ValidateBatch(spec));
  return ValidateOperations(spec);
}

}  // namespace lockstep::coordinator
