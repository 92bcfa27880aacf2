// Parity with PyTorch: the job in tests/fixtures/gpt_parity/spec.json, trained by Lockstep from
// its own initialisation, has the per-step losses that PyTorch (bench/torch/train_gpt.py, one
// process) produced from the same initial weights on the same batches, to 1e-4 relative.
// bench/torch/gpt_parity.sh regenerates torch_losses.json where PyTorch is installed; this test
// needs only the fixture.
#include <cmath>
#include <fstream>
#include <sstream>

#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/testing/solo_communicator.h"
#include "worker/train/trainer.h"

namespace lockstep::worker {
namespace {

std::string Fixture(const std::string& name) {
  return std::string(LOCKSTEP_SOURCE_DIR) + "/tests/fixtures/gpt_parity/" + name;
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  EXPECT_TRUE(in.good() || in.eof()) << "cannot read " << path;
  return s.str();
}

TEST(GptParityTest, PerStepLossesMatchPyTorchFromTheSameWeights) {
  v1::JobSpec spec;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(Read(Fixture("spec.json")), &spec).ok());
  spec.mutable_dataset()->set_path(Fixture(spec.dataset().path()));
  google::protobuf::Struct torch;
  ASSERT_TRUE(
      google::protobuf::util::JsonStringToMessage(Read(Fixture("torch_losses.json")), &torch).ok());
  const auto& want = torch.fields().at("losses").list_value().values();
  ASSERT_EQ(want.size(), spec.max_steps());

  auto data = LoadDataset(spec.dataset());
  ASSERT_TRUE(data.ok()) << data.status();
  testing::SoloCommunicator comm;
  auto trainer = Trainer::Create("parity", spec, *data, &comm);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  std::vector<double> losses;
  std::atomic<bool> abort{false};
  ASSERT_TRUE((*trainer)
                  ->Train(1, abort, [&](const v1::ProgressReport& r) { losses.push_back(r.loss()); },
                          nullptr, absl::ZeroDuration())
                  .ok());
  ASSERT_EQ(losses.size(), want.size());
  double worst = 0;
  for (size_t i = 0; i < losses.size(); ++i) {
    const double w = want[i].number_value();
    const double rel = std::abs(losses[i] - w) / std::abs(w);
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 1e-4) << "step " << i + 1 << ": Lockstep " << losses[i] << ", PyTorch " << w;
  }
  // The losses move: a run that learned nothing would not be a comparison.
  EXPECT_LT(losses.back(), losses.front() - 0.5);
  std::cout << "worst relative difference over " << losses.size() << " steps: " << worst << "\n";
}

}  // namespace
}  // namespace lockstep::worker
