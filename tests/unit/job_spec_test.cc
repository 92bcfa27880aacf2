// Job spec validation: every refusal is INVALID_ARGUMENT and names the field.
#include "coordinator/core/job_spec.h"

#include <functional>
#include <limits>

#include "absl/strings/match.h"
#include "common/data_format.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace lockstep::coordinator {
namespace {

v1::JobSpec ValidSpec() {
  v1::JobSpec spec;
  spec.mutable_model()->set_type("mlp");
  spec.mutable_model()->mutable_mlp()->add_hidden_widths(16);
  spec.mutable_dataset()->set_type("synthetic");
  auto* s = spec.mutable_dataset()->mutable_synthetic();
  s->set_train_samples(512);
  s->set_test_samples(64);
  s->set_input_dim(8);
  s->set_num_classes(3);
  spec.mutable_optimizer()->set_type("sgd");
  spec.mutable_optimizer()->set_learning_rate(0.1);
  spec.set_global_batch_size(64);
  spec.set_epochs(1);
  return spec;
}

TEST(JobSpecTest, ValidSpecWithDefaultsPasses) {
  v1::JobSpec spec = ValidSpec();
  ApplyJobSpecDefaults(&spec);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  EXPECT_EQ(spec.micro_shards(), 64);
  EXPECT_EQ(spec.min_workers(), 1);
  EXPECT_EQ(spec.max_workers(), 1);
  EXPECT_EQ(spec.model().mlp().activation(), "relu");
}

TEST(JobSpecTest, PriorityIsWithinItsRangeForBuiltInAndProgramJobs) {
  for (int priority : {kMinPriority, -1, 0, 7, kMaxPriority}) {
    v1::JobSpec spec = ValidSpec();
    spec.set_priority(priority);
    ApplyJobSpecDefaults(&spec);
    EXPECT_TRUE(ValidateJobSpec(spec).ok()) << priority << ": " << ValidateJobSpec(spec);
  }
  for (int priority : {kMinPriority - 1, kMaxPriority + 1, 1 << 30}) {
    v1::JobSpec spec = ValidSpec();
    spec.set_priority(priority);
    ApplyJobSpecDefaults(&spec);
    const absl::Status s = ValidateJobSpec(spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << priority;
    EXPECT_TRUE(absl::StrContains(s.message(), "priority")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "-1000 to 1000")) << s;
  }
  v1::JobSpec late = ValidSpec();
  late.set_max_wall_time_ms(-1);
  ApplyJobSpecDefaults(&late);
  EXPECT_TRUE(absl::StrContains(ValidateJobSpec(late).message(), "max_wall_time_ms"))
      << ValidateJobSpec(late);
  v1::JobSpec program;
  program.mutable_program()->add_argv("/usr/bin/python3");
  program.mutable_program()->add_argv("train.py");
  program.set_priority(5000);
  ApplyJobSpecDefaults(&program);
  EXPECT_TRUE(absl::StrContains(ValidateJobSpec(program).message(), "priority"))
      << ValidateJobSpec(program);
}

TEST(JobSpecTest, MicroBatchOfWholeMicroShardsPasses) {
  v1::JobSpec spec = ValidSpec();
  spec.set_micro_shards(8);
  spec.set_micro_batch_size(16);
  ApplyJobSpecDefaults(&spec);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.set_deterministic(true);
  spec.set_micro_batch_size(8);  // one micro-shard: what deterministic mode does anyway
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
}

TEST(JobSpecTest, PrecisionDefaultsToFp32AndTf32NeedsGpus) {
  v1::JobSpec spec = ValidSpec();
  ApplyJobSpecDefaults(&spec);
  EXPECT_EQ(spec.precision(), "fp32");
  spec.set_device("cuda");
  spec.set_precision("tf32");
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
}

TEST(JobSpecTest, DeterministicModeDefaultsToFewerLargerMicroShards) {
  v1::JobSpec spec = ValidSpec();
  spec.set_deterministic(true);
  spec.set_global_batch_size(96);
  spec.set_max_workers(5);
  ApplyJobSpecDefaults(&spec);
  EXPECT_EQ(spec.micro_shards(), 6) << "smallest divisor of 96 that gives 5 ranks a shard";
  EXPECT_TRUE(ValidateJobSpec(spec).ok());
  v1::JobSpec plain = ValidSpec();
  plain.set_global_batch_size(96);
  ApplyJobSpecDefaults(&plain);
  EXPECT_EQ(plain.micro_shards(), 48);
}

TEST(JobSpecTest, FashionMnistGetsDefaultPath) {
  v1::JobSpec spec = ValidSpec();
  spec.mutable_dataset()->set_type("fashion_mnist");
  ApplyJobSpecDefaults(&spec);
  EXPECT_EQ(spec.dataset().path(), kDefaultFashionMnistPath);
  EXPECT_TRUE(ValidateJobSpec(spec).ok());
}

struct BadCase {
  const char* name;
  std::function<void(v1::JobSpec*)> mutate;
  const char* field;  // must appear in the message
  absl::StatusCode code = absl::StatusCode::kInvalidArgument;
};

// Each case's change of `base` is refused (after the defaults) with its code, naming its field.
void ExpectRefused(const v1::JobSpec& base, const std::vector<BadCase>& cases) {
  for (const BadCase& c : cases) {
    v1::JobSpec spec = base;
    c.mutate(&spec);
    ApplyJobSpecDefaults(&spec);
    absl::Status status = ValidateJobSpec(spec);
    EXPECT_EQ(status.code(), c.code) << c.name << ": " << status;
    EXPECT_NE(status.message().find(c.field), std::string::npos)
        << c.name << ": message \"" << status.message() << "\" does not name " << c.field;
  }
}

TEST(JobSpecTest, RefusesBadSpecsNamingTheField) {
  const std::vector<BadCase> cases = {
      {"zero batch", [](v1::JobSpec* s) { s->set_global_batch_size(0); }, "global_batch_size"},
      {"negative batch", [](v1::JobSpec* s) { s->set_global_batch_size(-4); },
       "global_batch_size"},
      {"min > max",
       [](v1::JobSpec* s) {
         s->set_min_workers(3);
         s->set_max_workers(2);
       },
       "max_workers"},
      {"negative min", [](v1::JobSpec* s) { s->set_min_workers(-1); }, "min_workers"},
      {"indivisible micro-shards", [](v1::JobSpec* s) { s->set_micro_shards(5); },
       "micro_shards"},
      {"more workers than shards",
       [](v1::JobSpec* s) {
         s->set_micro_shards(2);
         s->set_max_workers(3);
       },
       "max_workers"},
      {"unknown model", [](v1::JobSpec* s) { s->mutable_model()->set_type("resnet"); },
       "model.type"},
      {"missing model", [](v1::JobSpec* s) { s->clear_model(); }, "model.type"},
      {"zero width", [](v1::JobSpec* s) { s->mutable_model()->mutable_mlp()->set_hidden_widths(0, 0); },
       "model.mlp.hidden_widths[0]"},
      {"bad activation", [](v1::JobSpec* s) { s->mutable_model()->mutable_mlp()->set_activation("tanhh"); },
       "model.mlp.activation"},
      {"idx without path",
       [](v1::JobSpec* s) {
         s->mutable_dataset()->set_type("idx");
         s->mutable_dataset()->clear_path();
       },
       "dataset.path"},
      {"unknown dataset", [](v1::JobSpec* s) { s->mutable_dataset()->set_type("imagenet"); },
       "dataset.type"},
      {"synthetic zero samples",
       [](v1::JobSpec* s) { s->mutable_dataset()->mutable_synthetic()->set_train_samples(0); },
       "dataset.synthetic.train_samples"},
      {"one class",
       [](v1::JobSpec* s) { s->mutable_dataset()->mutable_synthetic()->set_num_classes(1); },
       "dataset.synthetic.num_classes"},
      {"unknown optimizer", [](v1::JobSpec* s) { s->mutable_optimizer()->set_type("lamb"); },
       "optimizer.type"},
      {"zero lr", [](v1::JobSpec* s) { s->mutable_optimizer()->set_learning_rate(0); },
       "optimizer.learning_rate"},
      {"momentum 1", [](v1::JobSpec* s) { s->mutable_optimizer()->set_momentum(1.0); },
       "optimizer.momentum"},
      {"no epochs nor steps", [](v1::JobSpec* s) { s->set_epochs(0); }, "epochs"},
      {"negative steps", [](v1::JobSpec* s) { s->set_max_steps(-1); }, "max_steps"},
      {"negative heartbeat", [](v1::JobSpec* s) { s->set_heartbeat_timeout_ms(-5); },
       "heartbeat_timeout_ms"},
      {"deterministic with too many micro-shards",
       [](v1::JobSpec* s) {
         s->set_deterministic(true);
         s->set_global_batch_size(4096);
         s->set_micro_shards(2048);
       },
       "micro_shards"},
      {"micro-batch not a multiple of the micro-shard",
       [](v1::JobSpec* s) {
         s->set_micro_shards(8);  // shards of 8 samples
         s->set_micro_batch_size(12);
       },
       "micro_batch_size"},
      {"negative micro-batch", [](v1::JobSpec* s) { s->set_micro_batch_size(-8); },
       "micro_batch_size"},
      {"deterministic micro-batch of two micro-shards",
       [](v1::JobSpec* s) {
         s->set_deterministic(true);
         s->set_micro_shards(8);
         s->set_micro_batch_size(16);
       },
       "micro_batch_size"},
      {"unknown precision", [](v1::JobSpec* s) { s->set_precision("fp8"); }, "precision"},
      {"tf32 on CPU workers", [](v1::JobSpec* s) { s->set_precision("tf32"); }, "precision"},
      {"bf16 on CPU workers", [](v1::JobSpec* s) { s->set_precision("bf16"); }, "precision"},
      {"checkpoints without a directory",
       [](v1::JobSpec* s) { s->set_checkpoint_every_steps(10); }, "checkpoint_dir"},
      // Bounds: sizes and bytes nothing downstream should have to cope with.
      {"15 MB name", [](v1::JobSpec* s) { s->set_name(std::string(15 << 20, 'n')); }, "spec"},
      {"long name", [](v1::JobSpec* s) { s->set_name(std::string(300, 'n')); }, "name"},
      {"newline in name", [](v1::JobSpec* s) { s->set_name("job\n[fake] log line"); }, "name"},
      {"escape in name", [](v1::JobSpec* s) { s->set_name("\x1b[2Jjob"); }, "name"},
      {"NUL in a path",
       [](v1::JobSpec* s) { s->mutable_dataset()->set_path(std::string("/data\0/etc/shadow", 17)); },
       "dataset.path"},
      {"long path", [](v1::JobSpec* s) { s->set_checkpoint_dir("/" + std::string(5000, 'd')); },
       "checkpoint_dir"},
      {"control byte in output_dir", [](v1::JobSpec* s) { s->set_output_dir("/out\r"); },
       "output_dir"},
      {"100 hidden layers",
       [](v1::JobSpec* s) {
         for (int i = 0; i < 100; ++i) s->mutable_model()->mutable_mlp()->add_hidden_widths(4);
       },
       "model.mlp.hidden_widths"},
      {"many frozen patterns",
       [](v1::JobSpec* s) {
         for (int i = 0; i < 300; ++i) s->mutable_model()->add_frozen_parameters("x");
       },
       "model.frozen_parameters"},
      {"max_restarts 2^31-1",
       [](v1::JobSpec* s) { s->set_max_restarts(2147483647); }, "max_restarts"},
      {"huge synthetic test split",
       [](v1::JobSpec* s) {
         s->mutable_dataset()->mutable_synthetic()->set_test_samples(int64_t{1} << 26);
         s->mutable_dataset()->mutable_synthetic()->set_input_dim(65536);
       },
       "dataset.synthetic"},
  };
  ExpectRefused(ValidSpec(), cases);
}

v1::JobSpec GptSpec() {
  v1::JobSpec spec;
  v1::ModelSpec* m = spec.mutable_model();
  m->set_type("gpt");
  m->mutable_gpt()->set_vocab_size(256);
  m->mutable_gpt()->set_context_length(64);
  m->mutable_gpt()->set_n_layer(2);
  m->mutable_gpt()->set_n_head(4);
  m->mutable_gpt()->set_d_model(64);
  spec.mutable_dataset()->set_type("text");
  spec.mutable_dataset()->set_path("/usr/share/games/fortunes");
  spec.mutable_optimizer()->set_type("adamw");
  spec.mutable_optimizer()->set_learning_rate(0.001);
  spec.set_global_batch_size(16);
  spec.set_max_steps(10);
  return spec;
}

TEST(JobSpecTest, GptSpecWithDefaultsPasses) {
  v1::JobSpec spec = GptSpec();
  spec.mutable_sample()->set_max_tokens(50);
  spec.mutable_model()->add_frozen_parameters("wte.weight");
  spec.mutable_model()->add_frozen_parameters("h.1.*");
  ApplyJobSpecDefaults(&spec);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  EXPECT_DOUBLE_EQ(spec.dataset().validation_fraction(), 0.05);
  EXPECT_DOUBLE_EQ(spec.sample().temperature(), 1.0);
  EXPECT_FALSE(spec.model().has_mlp()) << "a GPT has no MLP fields";
}

// The model as JSON gives it (the CLI's and the Python client's path).
v1::ModelSpec ModelFromJson(const std::string& json) {
  v1::ModelSpec model;
  const auto parsed = google::protobuf::util::JsonStringToMessage(json, &model);
  EXPECT_TRUE(parsed.ok()) << parsed.ToString();
  return model;
}

// The form before the family messages (model.type and the family's fields beside it: saved
// jobs, old JSON) is moved into the family's message; a spec that names its family only by
// its message gets model.type; the two forms give the same canonical model.
TEST(JobSpecTest, ModelsOfTheOldFormLoadIntoTheirFamilysMessage) {
  v1::JobSpec old_gpt = GptSpec(), new_gpt = GptSpec();
  *old_gpt.mutable_model() = ModelFromJson(
      R"({"type": "gpt", "vocabSize": 256, "contextLength": 64, "nLayer": 2, "nHead": 4,
          "dModel": 64, "frozenParameters": ["wte.weight"]})");
  *new_gpt.mutable_model() = ModelFromJson(
      R"({"gpt": {"vocabSize": 256, "contextLength": 64, "nLayer": 2, "nHead": 4,
          "dModel": 64}, "frozenParameters": ["wte.weight"]})");
  for (v1::JobSpec* spec : {&old_gpt, &new_gpt}) {
    ApplyJobSpecDefaults(spec);
    EXPECT_TRUE(ValidateJobSpec(*spec).ok()) << ValidateJobSpec(*spec);
    EXPECT_EQ(spec->model().type(), "gpt");
    EXPECT_EQ(spec->model().gpt().n_layer(), 2);
    EXPECT_EQ(spec->model().gpt().d_model(), 64);
  }
  EXPECT_EQ(old_gpt.model().SerializeAsString(), new_gpt.model().SerializeAsString())
      << old_gpt.model().DebugString() << "\n" << new_gpt.model().DebugString();
  v1::JobSpec old_mlp = ValidSpec();
  *old_mlp.mutable_model() =
      ModelFromJson(R"({"type": "mlp", "hiddenWidths": [16, 8], "activation": "gelu"})");
  ApplyJobSpecDefaults(&old_mlp);
  EXPECT_TRUE(ValidateJobSpec(old_mlp).ok()) << ValidateJobSpec(old_mlp);
  EXPECT_EQ(old_mlp.model().mlp().hidden_widths_size(), 2);
  EXPECT_EQ(old_mlp.model().mlp().activation(), "gelu");
  // An MLP of no hidden layer, named only by its type: an empty family message.
  v1::JobSpec bare = ValidSpec();
  *bare.mutable_model() = ModelFromJson(R"({"type": "mlp"})");
  ApplyJobSpecDefaults(&bare);
  EXPECT_TRUE(ValidateJobSpec(bare).ok()) << ValidateJobSpec(bare);
  EXPECT_TRUE(bare.model().has_mlp());
}

// What cannot be one model is refused, naming the field.
TEST(JobSpecTest, ModelsMixingTheFormsOrTheFamiliesAreRefused) {
  const struct {
    const char* name;
    const char* json;
    const char* field;
  } cases[] = {
      {"an old field beside the family's message", R"({"gpt": {"nLayer": 2}, "nHead": 4})",
       "model.n_head: set it in model.gpt"},
      {"another family's old field", R"({"type": "gpt", "hiddenWidths": [8], "nLayer": 2})",
       "model.hidden_widths: not a field of the gpt family"},
      {"a type that is not the message's family", R"({"type": "mlp", "gpt": {"nLayer": 2}})",
       "model.type: \"mlp\", but the model's fields are in model.gpt"},
      {"an unknown type", R"({"type": "llama", "nLayer": 2})", "model.type: unknown model"},
  };
  for (const auto& c : cases) {
    v1::JobSpec spec = GptSpec();
    *spec.mutable_model() = ModelFromJson(c.json);
    ApplyJobSpecDefaults(&spec);
    const absl::Status status = ValidateJobSpec(spec);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << status;
    EXPECT_NE(status.message().find(c.field), std::string::npos) << c.name << ": " << status;
  }
}

TEST(JobSpecTest, GptOnGpuWorkersPasses) {
  v1::JobSpec spec = GptSpec();
  spec.set_device("cuda");
  spec.set_precision("tf32");
  spec.mutable_model()->mutable_gpt()->set_d_model(256);
  spec.mutable_model()->mutable_gpt()->set_n_head(2);  // heads of 128 channels: the GPU kernel's widest
  ApplyJobSpecDefaults(&spec);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.set_precision("bf16");
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.mutable_model()->add_frozen_parameters("wte.weight");  // GPU workers freeze tensors too
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
}

TEST(JobSpecTest, RefusesBadGptSpecsNamingTheField) {
  const std::vector<BadCase> cases = {
      {"d_model not divisible", [](v1::JobSpec* s) { s->mutable_model()->mutable_gpt()->set_d_model(66); },
       "model.gpt.d_model"},
      {"zero heads", [](v1::JobSpec* s) { s->mutable_model()->mutable_gpt()->set_n_head(0); }, "model.gpt.n_head"},
      {"negative layers", [](v1::JobSpec* s) { s->mutable_model()->mutable_gpt()->set_n_layer(-1); },
       "model.gpt.n_layer"},
      {"zero context", [](v1::JobSpec* s) { s->mutable_model()->mutable_gpt()->set_context_length(0); },
       "model.gpt.context_length"},
      {"zero vocab", [](v1::JobSpec* s) { s->mutable_model()->mutable_gpt()->set_vocab_size(0); },
       "model.gpt.vocab_size"},
      {"frozen pattern matching nothing",
       [](v1::JobSpec* s) { s->mutable_model()->add_frozen_parameters("h.7.*"); },
       "model.frozen_parameters[0]"},
      {"everything frozen", [](v1::JobSpec* s) { s->mutable_model()->add_frozen_parameters("*"); },
       "model.frozen_parameters"},
      {"gpt on images",
       [](v1::JobSpec* s) {
         s->mutable_dataset()->set_type("fashion_mnist");
       },
       "dataset.type"},
      {"tokens without validation file",
       [](v1::JobSpec* s) {
         s->mutable_dataset()->set_type("tokens");
         s->mutable_dataset()->set_path("/data/train.bin");
       },
       "dataset.validation_path"},
      {"validation fraction 1",
       [](v1::JobSpec* s) { s->mutable_dataset()->set_validation_fraction(1.0); },
       "dataset.validation_fraction"},
      {"unknown dataset", [](v1::JobSpec* s) { s->mutable_dataset()->set_type("parquet"); },
       "dataset.type"},
      {"negative clip", [](v1::JobSpec* s) { s->mutable_optimizer()->set_grad_clip_norm(-1); },
       "optimizer.grad_clip_norm"},
      // Infinite or absurd rates only train NaNs (weightDecay: Infinity was accepted).
      {"infinite clip",
       [](v1::JobSpec* s) {
         s->mutable_optimizer()->set_grad_clip_norm(std::numeric_limits<double>::infinity());
       },
       "optimizer.grad_clip_norm"},
      {"infinite decay",
       [](v1::JobSpec* s) {
         s->mutable_optimizer()->set_weight_decay(std::numeric_limits<double>::infinity());
       },
       "optimizer.weight_decay"},
      {"NaN decay",
       [](v1::JobSpec* s) {
         s->mutable_optimizer()->set_weight_decay(std::numeric_limits<double>::quiet_NaN());
       },
       "optimizer.weight_decay"},
      {"infinite epsilon",
       [](v1::JobSpec* s) {
         s->mutable_optimizer()->set_type("adamw");
         s->mutable_optimizer()->set_epsilon(std::numeric_limits<double>::infinity());
       },
       "optimizer.epsilon"},
      {"too long a sample", [](v1::JobSpec* s) { s->mutable_sample()->set_max_tokens(5000); },
       "sample.max_tokens"},
      {"prompt token beyond the vocabulary",
       [](v1::JobSpec* s) {
         s->mutable_sample()->set_max_tokens(5);
         s->mutable_sample()->add_prompt_tokens(300);
       },
       "sample.prompt_tokens[0]"},
      {"negative eval interval", [](v1::JobSpec* s) { s->set_eval_every_steps(-1); },
       "eval_every_steps"},
      {"an MLP's message", [](v1::JobSpec* s) { s->mutable_model()->mutable_mlp()->add_hidden_widths(8); },
       "model.type"},
      {"heads too wide for the GPU attention kernel",
       [](v1::JobSpec* s) {
         s->set_device("cuda");
         s->mutable_model()->mutable_gpt()->set_d_model(512);
         s->mutable_model()->mutable_gpt()->set_n_head(2);
       },
       "model.gpt.n_head"},
  };
  ExpectRefused(GptSpec(), cases);
  // An MLP cannot train on text, nor freeze a tensor it lacks.
  v1::JobSpec mlp = ValidSpec();
  mlp.mutable_dataset()->set_type("text");
  mlp.mutable_dataset()->set_path("/tmp/x.txt");
  ApplyJobSpecDefaults(&mlp);
  EXPECT_NE(ValidateJobSpec(mlp).message().find("dataset.type"), std::string::npos);
  mlp = ValidSpec();
  mlp.mutable_model()->add_frozen_parameters("fc3.*");  // fc1 and fc2 only
  ApplyJobSpecDefaults(&mlp);
  EXPECT_NE(ValidateJobSpec(mlp).message().find("fc3.*"), std::string::npos);
  mlp.mutable_model()->set_frozen_parameters(0, "fc1.*");
  EXPECT_TRUE(ValidateJobSpec(mlp).ok()) << ValidateJobSpec(mlp);
}

v1::JobSpec ProgramSpec() {
  v1::JobSpec spec;
  spec.set_min_workers(2);
  spec.set_max_workers(4);
  spec.mutable_program()->add_argv("/usr/bin/python3");
  spec.mutable_program()->add_argv("train.py");
  spec.mutable_program()->set_workdir("/srv/programs/ddp");
  return spec;
}

TEST(JobSpecTest, ProgramSpecWithDefaultsPasses) {
  v1::JobSpec spec = ProgramSpec();
  (*spec.mutable_program()->mutable_env())["NCCL_DEBUG"] = "INFO";
  spec.mutable_program()->set_local_rank_arg("--local_rank");
  spec.mutable_program()->add_fatal_exit_codes(3);
  ApplyJobSpecDefaults(&spec);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  EXPECT_EQ(spec.program().stop_grace_ms(), 5000);
  EXPECT_EQ(spec.step_timeout_ms(), 60000);
  EXPECT_EQ(spec.device(), "cpu");
  EXPECT_EQ(spec.threads_per_worker(), 1);
  // None of the built-in training's defaults: a program has no optimizer or micro-shards.
  EXPECT_FALSE(spec.has_optimizer());
  EXPECT_EQ(spec.micro_shards(), 0);
  EXPECT_EQ(spec.precision(), "");
  // The JSON form users write.
  v1::JobSpec parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(
                  R"({"minWorkers": 2, "program": {"argv": ["/usr/bin/python3", "train.py"],
                      "workdir": "/srv/p", "localRankArg": "--local-rank", "stopGraceMs": 100,
                      "fatalExitCodes": [2], "env": {"A": "b"}}})",
                  &parsed)
                  .ok());
  ApplyJobSpecDefaults(&parsed);
  EXPECT_TRUE(ValidateJobSpec(parsed).ok()) << ValidateJobSpec(parsed);
  // Saves persisted to disk every 10 (lockstep.torch.Checkpointer), the newest 2 steps kept.
  v1::JobSpec persisted = ProgramSpec();
  persisted.set_checkpoint_dir("/srv/checkpoints/ddp");
  persisted.set_keep_checkpoints(2);
  persisted.mutable_program()->set_persist_every_saves(10);
  ApplyJobSpecDefaults(&persisted);
  EXPECT_TRUE(ValidateJobSpec(persisted).ok()) << ValidateJobSpec(persisted);
}

TEST(JobSpecTest, RefusesBadProgramSpecsNamingTheField) {
  const std::vector<BadCase> cases = {
      {"model and program", [](v1::JobSpec* s) { s->mutable_model()->set_type("mlp"); },
       "model: a job runs either a built-in model or a program, not both"},
      {"a training field", [](v1::JobSpec* s) { s->set_global_batch_size(64); },
       "global_batch_size: means nothing for a program job"},
      {"an optimizer", [](v1::JobSpec* s) { s->mutable_optimizer()->set_type("sgd"); },
       "optimizer"},
      {"checkpoint_dir without persisting",
       [](v1::JobSpec* s) { s->set_checkpoint_dir("/ckpt"); },
       "program.persist_every_saves: required when checkpoint_dir is set"},
      {"persisting without a directory",
       [](v1::JobSpec* s) { s->mutable_program()->set_persist_every_saves(5); },
       "checkpoint_dir: required when program.persist_every_saves > 0"},
      {"negative persist_every_saves",
       [](v1::JobSpec* s) {
         s->set_checkpoint_dir("/ckpt");
         s->mutable_program()->set_persist_every_saves(-1);
       },
       "program.persist_every_saves: must be in [0, 1000000], got -1"},
      {"keep without persisting", [](v1::JobSpec* s) { s->set_keep_checkpoints(2); },
       "keep_checkpoints: means nothing without program.persist_every_saves"},
      {"the built-in checkpoint interval",
       [](v1::JobSpec* s) { s->set_checkpoint_every_steps(10); },
       "checkpoint_every_steps: means nothing for a program job"},
      {"empty argv", [](v1::JobSpec* s) { s->mutable_program()->clear_argv(); }, "program.argv"},
      {"empty interpreter", [](v1::JobSpec* s) { s->mutable_program()->set_argv(0, ""); },
       "program.argv[0]"},
      {"control byte in an argument",
       [](v1::JobSpec* s) { s->mutable_program()->set_argv(1, "train.py\n--evil"); },
       "program.argv[1]: holds control byte 10"},
      {"too many arguments",
       [](v1::JobSpec* s) {
         for (int i = 0; i < 300; ++i) s->mutable_program()->add_argv("-v");
       },
       "program.argv: at most 256"},
      {"missing workdir", [](v1::JobSpec* s) { s->mutable_program()->clear_workdir(); },
       "program.workdir: required"},
      {"relative workdir", [](v1::JobSpec* s) { s->mutable_program()->set_workdir("ddp"); },
       "program.workdir: must be an absolute path"},
      {"unknown local rank argument",
       [](v1::JobSpec* s) { s->mutable_program()->set_local_rank_arg("--rank"); },
       "program.local_rank_arg"},
      {"invalid variable name",
       [](v1::JobSpec* s) { (*s->mutable_program()->mutable_env())["1BAD"] = "x"; },
       "program.env: \"1BAD\" is not a variable name"},
      {"variable name with a dash",
       [](v1::JobSpec* s) { (*s->mutable_program()->mutable_env())["MY-VAR"] = "x"; },
       "program.env"},
      {"torchrun's own variable",
       [](v1::JobSpec* s) { (*s->mutable_program()->mutable_env())["RANK"] = "3"; },
       "program.env[RANK]: set by the worker itself"},
      {"lockstep's own variable",
       [](v1::JobSpec* s) { (*s->mutable_program()->mutable_env())["LOCKSTEP_AGENT_TOKEN"] = "x"; },
       "program.env[LOCKSTEP_AGENT_TOKEN]"},
      {"NUL in a value",
       [](v1::JobSpec* s) {
         (*s->mutable_program()->mutable_env())["A"] = std::string("x\0y", 3);
       },
       "program.env[A]: holds a NUL byte"},
      {"absurd grace", [](v1::JobSpec* s) { s->mutable_program()->set_stop_grace_ms(86400000); },
       "program.stop_grace_ms: must be in [0, 600000]"},
      {"negative grace", [](v1::JobSpec* s) { s->mutable_program()->set_stop_grace_ms(-1); },
       "program.stop_grace_ms"},
      {"exit code 0 fatal", [](v1::JobSpec* s) { s->mutable_program()->add_fatal_exit_codes(0); },
       "program.fatal_exit_codes[0]: must be an exit status in [1, 255]"},
      {"exit code 256 fatal",
       [](v1::JobSpec* s) { s->mutable_program()->add_fatal_exit_codes(256); },
       "program.fatal_exit_codes[0]"},
      {"min > max",
       [](v1::JobSpec* s) {
         s->set_min_workers(5);
         s->set_max_workers(2);
       },
       "max_workers"},
      {"unknown device", [](v1::JobSpec* s) { s->set_device("tpu"); }, "device"},
      {"negative step timeout", [](v1::JobSpec* s) { s->set_step_timeout_ms(-5); },
       "step_timeout_ms"},
  };
  ExpectRefused(ProgramSpec(), cases);
}

}  // namespace
}  // namespace lockstep::coordinator
