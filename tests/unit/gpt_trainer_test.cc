// The GPT as a job: byte-level text through the trainer (loss falls, validation in bits per
// byte), deterministic mode across world sizes over a real in-process Gloo group, frozen tensors
// (bitwise unchanged, not summed), the errors a user's bad spec gets, the sample, and the
// safetensors export read back by an independent JSON reader.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "cli/commands.h"
#include "common/job_memory.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/testing/gloo_group.h"
#include "tests/testing/gpt_job.h"
#include "tests/testing/solo_communicator.h"
#include "worker/comm/gloo_communicator.h"
#include "common/checkpoint.h"
#include "common/random.h"
#include "worker/train/trainer.h"

namespace lockstep::worker {
namespace {

using testing::SoloCommunicator;

v1::JobSpec GptSpec() { return testing::SmallGptSpec(); }

std::shared_ptr<const Dataset> Data(const v1::JobSpec& spec) {
  absl::StatusOr<std::shared_ptr<const Dataset>> data = LoadDataset(spec.dataset());
  EXPECT_TRUE(data.ok()) << data.status();
  return *data;
}

TEST(GptTrainerTest, LearnsTheTextAndReportsValidationInBitsPerByte) {
  v1::JobSpec spec = GptSpec();
  spec.set_eval_every_steps(20);
  SoloCommunicator comm;
  auto trainer = Trainer::Create("gpt-job", spec, Data(spec), &comm).value();
  EXPECT_EQ(trainer->steps_per_epoch(), (36000 - 1) / 16 / 16);
  std::atomic<bool> abort{false};
  std::vector<v1::ProgressReport> reports;
  ASSERT_TRUE(trainer
                  ->Train(1, abort, [&](const v1::ProgressReport& r) { reports.push_back(r); },
                          nullptr, absl::ZeroDuration())
                  .ok());
  ASSERT_EQ(reports.size(), 40u);
  EXPECT_GT(reports.front().loss(), 5.0) << "starts near ln 256 = 5.55";
  EXPECT_LT(reports.back().loss(), 2.8) << "learns the words";
  // eval_every_steps 20: step 20 carries an evaluation; the last step's is the final one's.
  EXPECT_TRUE(reports[19].has_eval());
  EXPECT_FALSE(reports[39].has_eval());
  EXPECT_GT(reports[39].tokens_per_second(), 0);
  absl::StatusOr<v1::EvalResult> eval = trainer->Evaluate();
  ASSERT_TRUE(eval.ok()) << eval.status();
  EXPECT_EQ(eval->test_samples(), (4000 - 1) / 16);
  EXPECT_LT(eval->test_loss(), reports[19].eval().test_loss());
  EXPECT_NEAR(eval->bits_per_byte(), eval->test_loss() / std::log(2.0), 1e-12);
  EXPECT_GT(eval->test_accuracy(), 0.2);
  EXPECT_GT(trainer->TrainTokensPerSecond(), 0);
}

// Trains `spec` on `world` ranks of an in-process Gloo group; returns every rank's checksum and
// rank 0's parameters.
std::pair<std::vector<std::string>, std::vector<float>> TrainOnGloo(const v1::JobSpec& spec,
                                                                    int world) {
  std::shared_ptr<const Dataset> data = Data(spec);
  std::vector<std::string> sums(world);
  std::vector<float> params;
  testing::RunInGlooGroup(world, [&](int r, std::unique_ptr<GlooCommunicator> gloo) {
    auto trainer = Trainer::Create("gpt-job", spec, data, gloo.get());
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    std::atomic<bool> abort{false};
    ASSERT_TRUE((*trainer)->Train(1, abort, [](const v1::ProgressReport&) {}).ok());
    sums[r] = (*trainer)->ParameterChecksum();
    if (r == 0) {
      const Model& m = (*trainer)->model();
      params.assign(m.params(), m.params() + m.num_params());
    }
  });
  return {sums, params};
}

TEST(GptTrainerTest, DeterministicModeIsBitwiseIdenticalForOneTwoAndThreeWorkers) {
  v1::JobSpec spec = GptSpec();
  spec.set_deterministic(true);
  spec.set_micro_shards(4);
  spec.set_max_steps(12);
  const auto [solo, solo_params] = TrainOnGloo(spec, 1);
  for (int world : {2, 3}) {
    const auto [sums, params] = TrainOnGloo(spec, world);
    for (int r = 0; r < world; ++r) EXPECT_EQ(sums[r], solo[0]) << "world " << world << " rank " << r;
  }
  // The default mode's float sums differ from it: the comparison above is not vacuous.
  spec.set_deterministic(false);
  EXPECT_NE(TrainOnGloo(spec, 1).first[0], solo[0]);
}

TEST(GptTrainerTest, FrozenTensorsStayBitwiseUnchangedAndAreNotSummed) {
  v1::JobSpec spec = GptSpec();
  spec.set_max_steps(10);
  SoloCommunicator comm;
  auto full = Trainer::Create("gpt-job", spec, Data(spec), &comm).value();
  spec.mutable_model()->add_frozen_parameters("wte.weight");
  spec.mutable_model()->add_frozen_parameters("h.0.*");
  auto frozen = Trainer::Create("gpt-job", spec, Data(spec), &comm).value();
  const Model& m = frozen->model();
  std::vector<float> init(m.params(), m.params() + m.num_params());
  size_t frozen_count = 0;
  for (size_t t = 0; t < m.tensors().size(); ++t) {
    const bool want = m.tensors()[t].name == "wte.weight" || m.tensors()[t].name.rfind("h.0.", 0) == 0;
    EXPECT_EQ(m.frozen(t), want) << m.tensors()[t].name;
    if (want) frozen_count += m.tensors()[t].count;
  }
  EXPECT_EQ(m.num_frozen_params(), frozen_count);
  EXPECT_EQ(m.num_grads(), m.num_params() - frozen_count);
  // No optimizer state for them, and the step's sums shrink by their size.
  EXPECT_EQ(frozen->optimizer().state().size(), 2 * m.num_grads());
  EXPECT_LT(frozen->largest_collective_bytes(), full->largest_collective_bytes() + 1);
  spec.set_deterministic(true);
  auto det = Trainer::Create("gpt-job", spec, Data(spec), &comm).value();
  v1::JobSpec det_spec = GptSpec();
  det_spec.set_deterministic(true);
  auto det_unfrozen = Trainer::Create("gpt-job", det_spec, Data(spec), &comm).value();
  EXPECT_EQ(det_unfrozen->largest_collective_bytes() - det->largest_collective_bytes(),
            frozen_count * sizeof(int64_t));

  std::atomic<bool> abort{false};
  ASSERT_TRUE(frozen->Train(1, abort, [](const v1::ProgressReport&) {}).ok());
  for (size_t t = 0; t < m.tensors().size(); ++t) {
    const Tensor& x = m.tensors()[t];
    const bool same = std::equal(init.begin() + x.offset, init.begin() + x.offset + x.count,
                                 m.params() + x.offset);
    EXPECT_EQ(same, m.frozen(t)) << x.name << (m.frozen(t) ? " changed" : " did not train");
  }
  // Two ranks agree with each other with frozen tensors too.
  spec.set_deterministic(false);
  const auto [sums, params] = TrainOnGloo(spec, 2);
  EXPECT_EQ(sums[0], sums[1]);
}

TEST(GptTrainerTest, BadSpecsFailWithTheFieldNamed) {
  struct Case {
    std::function<void(v1::JobSpec&)> change;
    std::string field;
  } cases[] = {
      {[](v1::JobSpec& s) { s.mutable_model()->mutable_gpt()->set_context_length(40000); }, "model.gpt.context_length"},
      {[](v1::JobSpec& s) { s.mutable_model()->mutable_gpt()->set_vocab_size(100); }, "model.gpt.vocab_size"},
      {[](v1::JobSpec& s) { s.mutable_model()->mutable_gpt()->set_d_model(33); }, "model.gpt.d_model"},
      {[](v1::JobSpec& s) { s.mutable_model()->mutable_gpt()->set_n_layer(0); }, "model.gpt.n_layer"},
      {[](v1::JobSpec& s) { s.mutable_model()->add_frozen_parameters("h.9.*"); },
       "model.frozen_parameters"},
      {[](v1::JobSpec& s) { s.mutable_model()->set_type("mlp"); }, "model.type"},
  };
  for (const Case& c : cases) {
    v1::JobSpec spec = GptSpec();
    c.change(spec);
    SoloCommunicator comm;
    auto trainer = Trainer::Create("gpt-job", spec, Data(GptSpec()), &comm);
    EXPECT_EQ(trainer.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(trainer.status().message().find(c.field), std::string::npos) << trainer.status();
  }
}

TEST(GptTrainerTest, SampleIsDeterministicForASeedAndContinuesThePrompt) {
  v1::JobSpec spec = GptSpec();
  spec.set_max_steps(30);
  v1::SampleSpec* sample = spec.mutable_sample();
  sample->set_prompt("the cat ");
  sample->set_max_tokens(40);
  sample->set_temperature(0.8);
  sample->set_top_k(10);
  sample->set_seed(5);
  SoloCommunicator comm;
  auto trainer = Trainer::Create("gpt-job", spec, Data(spec), &comm).value();
  std::atomic<bool> abort{false};
  ASSERT_TRUE(trainer->Train(1, abort, [](const v1::ProgressReport&) {}).ok());
  absl::StatusOr<v1::Sample> a = trainer->GenerateSample();
  absl::StatusOr<v1::Sample> b = trainer->GenerateSample();
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->tokens_size(), 40);
  EXPECT_EQ(a->text().rfind("the cat ", 0), 0u) << a->text();
  EXPECT_EQ(a->text(), b->text());
}

// The export's header, read with protobuf's JSON parser (not the writer's code): every tensor
// F32 with its shape, byte ranges tiling the data exactly, the values the parameters.
void ExpectSafetensors(const std::string& path, const Model& model) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int b = 0; b < 8; ++b) n |= uint64_t{static_cast<unsigned char>(bytes[b])} << (8 * b);
  ASSERT_EQ((8 + n) % 8, 0u) << "data aligned to 8 bytes";
  google::protobuf::Struct header;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(bytes.substr(8, n), &header).ok());
  const std::string data = bytes.substr(8 + n);
  ASSERT_EQ(data.size(), model.num_params() * sizeof(float));
  EXPECT_EQ(header.fields().size(), model.tensors().size() + 1);  // + __metadata__
  EXPECT_EQ(header.fields().at("__metadata__").struct_value().fields().at("format").string_value(),
            "pt");
  for (const Tensor& t : model.tensors()) {
    ASSERT_TRUE(header.fields().count(t.name)) << t.name;
    const auto& f = header.fields().at(t.name).struct_value().fields();
    EXPECT_EQ(f.at("dtype").string_value(), "F32");
    const auto& shape = f.at("shape").list_value().values();
    ASSERT_EQ(static_cast<size_t>(shape.size()), t.shape.size()) << t.name;
    for (int d = 0; d < shape.size(); ++d) EXPECT_EQ(shape[d].number_value(), t.shape[d]);
    const auto& range = f.at("data_offsets").list_value().values();
    const size_t begin = static_cast<size_t>(range[0].number_value());
    const size_t end = static_cast<size_t>(range[1].number_value());
    EXPECT_EQ(end - begin, t.count * sizeof(float)) << t.name;
    EXPECT_EQ(std::memcmp(data.data() + begin, model.params() + (begin / sizeof(float)),
                          end - begin), 0)
        << t.name;
    EXPECT_EQ(begin, t.offset * sizeof(float));
  }
}

TEST(GptTrainerTest, ExportAndCheckpointConversionWriteGpt2Safetensors) {
  v1::JobSpec spec = GptSpec();
  spec.set_max_steps(4);
  const std::string dir = absl::StrCat(::testing::TempDir(), "/gpt-export-", getpid());
  std::filesystem::remove_all(dir);
  spec.set_output_dir(dir + "/out");
  spec.set_checkpoint_every_steps(4);
  spec.set_checkpoint_dir(dir + "/ckpt");
  SoloCommunicator comm;
  auto trainer = Trainer::Create("gpt-job", spec, Data(spec), &comm).value();
  std::atomic<bool> abort{false};
  std::string checkpoint;
  ASSERT_TRUE(trainer
                  ->Train(1, abort, [](const v1::ProgressReport&) {},
                          [&](const v1::CheckpointReport& r) { checkpoint = r.path(); })
                  .ok());
  absl::StatusOr<std::string> exported = trainer->Export();
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(*exported, dir + "/out/model.safetensors");
  ExpectSafetensors(*exported, trainer->model());
  std::ifstream config(dir + "/out/config.json");
  std::stringstream text;
  text << config.rdbuf();
  google::protobuf::Struct parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(text.str(), &parsed).ok()) << text.str();
  EXPECT_EQ(parsed.fields().at("model_type").string_value(), "gpt2");
  EXPECT_EQ(parsed.fields().at("n_embd").number_value(), 32);
  EXPECT_EQ(parsed.fields().at("activation_function").string_value(), "gelu_new");
  // lockstepctl export of the step-4 checkpoint: the same file.
  ASSERT_FALSE(checkpoint.empty());
  std::ostringstream out;
  ASSERT_TRUE(cli::ExportCheckpoint(checkpoint, dir + "/conv/model.safetensors", out).ok());
  ExpectSafetensors(dir + "/conv/model.safetensors", trainer->model());
  EXPECT_TRUE(std::filesystem::exists(dir + "/conv/config.json"));
  EXPECT_EQ(cli::ExportCheckpoint(dir + "/none.ckpt", dir + "/x.safetensors", out).code(),
            absl::StatusCode::kNotFound);
}

// The MLP exports the same way: fcN.weight [out, in] and fcN.bias, PyTorch's nn.Linear names.
TEST(GptTrainerTest, TheMlpExportsUnderPyTorchNames) {
  v1::JobSpec spec;
  spec.mutable_model()->set_type("mlp");
  spec.mutable_model()->mutable_mlp()->add_hidden_widths(8);
  spec.mutable_model()->mutable_mlp()->set_activation("relu");
  spec.mutable_dataset()->set_type("synthetic");
  auto* s = spec.mutable_dataset()->mutable_synthetic();
  s->set_train_samples(256);
  s->set_test_samples(32);
  s->set_input_dim(6);
  s->set_num_classes(3);
  spec.mutable_optimizer()->set_type("sgd");
  spec.mutable_optimizer()->set_learning_rate(0.1);
  spec.set_global_batch_size(32);
  spec.set_micro_shards(4);
  spec.set_max_steps(3);
  const std::string dir = absl::StrCat(::testing::TempDir(), "/mlp-export-", getpid());
  std::filesystem::remove_all(dir);
  spec.set_output_dir(dir);
  SoloCommunicator comm;
  auto trainer = Trainer::Create("mlp-job", spec, Data(spec), &comm).value();
  std::atomic<bool> abort{false};
  ASSERT_TRUE(trainer->Train(1, abort, [](const v1::ProgressReport&) {}).ok());
  absl::StatusOr<std::string> exported = trainer->Export();
  ASSERT_TRUE(exported.ok()) << exported.status();
  ExpectSafetensors(*exported, trainer->model());
  const Model& m = trainer->model();
  EXPECT_EQ(m.tensors()[0].name, "fc2.weight");
  EXPECT_EQ(m.tensors()[0].shape, (std::vector<int64_t>{3, 8}));
  EXPECT_TRUE(std::filesystem::exists(dir + "/config.json"));
  // An unwritable directory is an error naming it, not a crash.
  spec.set_output_dir("/proc/lockstep-no-such-dir");
  auto other = Trainer::Create("mlp-job", spec, Data(spec), &comm).value();
  absl::StatusOr<std::string> refused = other->Export();
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("/proc/lockstep-no-such-dir"), std::string::npos)
      << refused.status();
}

// The memory preflight sizes the GPT: parameters, gradients and AdamW state shrink with frozen
// tensors, and activations grow with the micro-batch (attention keeps O(T) per row).
TEST(GptTrainerTest, MemoryEstimateCoversTheGpt) {
  v1::JobSpec spec = GptSpec();
  const MemoryEstimate one = EstimateWorkerMemory(spec, 1), eight = EstimateWorkerMemory(spec, 8);
  auto model = CreateModel(spec.model(), {}).value();
  EXPECT_EQ(one.parameters, static_cast<int64_t>(4 * model->num_params()));
  EXPECT_EQ(one.gradients, one.parameters);
  EXPECT_EQ(one.optimizer, 2 * one.parameters);
  EXPECT_GT(eight.activations, 7 * (one.activations - 4 * (int64_t{16} * 256)));
  spec.mutable_model()->add_frozen_parameters("wte.weight");
  const MemoryEstimate frozen = EstimateWorkerMemory(spec, 1);
  EXPECT_EQ(frozen.parameters, one.parameters);
  EXPECT_EQ(one.gradients - frozen.gradients, 4 * 256 * 32);
  EXPECT_EQ(one.optimizer - frozen.optimizer, 8 * 256 * 32);
  // GPT-2 small with a batch of 64 x 1024 tokens at once needs tens of GiB: the preflight says so.
  v1::JobSpec big = GptSpec();
  big.mutable_model()->mutable_gpt()->set_vocab_size(50257);
  big.mutable_model()->mutable_gpt()->set_context_length(1024);
  big.mutable_model()->mutable_gpt()->set_n_layer(12);
  big.mutable_model()->mutable_gpt()->set_n_head(12);
  big.mutable_model()->mutable_gpt()->set_d_model(768);
  EXPECT_GT(EstimateWorkerMemory(big, 64).total(), int64_t{40} << 30);
  EXPECT_LT(EstimateWorkerMemory(big, 1).total(), int64_t{4} << 30);
}

}  // namespace
}  // namespace lockstep::worker
