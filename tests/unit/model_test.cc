// The Model interface and the bucket plan every step engine shares: a model's tensors cover its
// flat buffer exactly once, in order, under their export names; the plan closes buckets at ready
// points once they hold the minimum, carries the tail in the last one, and its cursor sends each
// bucket once, the last only at Finish.
#include <numeric>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/train/bucket_plan.h"
#include "worker/train/mlp.h"
#include "worker/train/model.h"

namespace lockstep::worker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ModelTest, MlpTensorsCoverTheBufferInOrderWithExportNames) {
  v1::ModelSpec spec;
  spec.set_type("mlp");
  spec.add_hidden_widths(7);
  absl::StatusOr<std::unique_ptr<Model>> model = CreateModel(spec, DataShape{5, 3});
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<Tensor>& t = (*model)->tensors();
  std::vector<std::string> names;
  size_t next = 0;
  for (const Tensor& x : t) {
    names.push_back(x.name);
    EXPECT_EQ(x.offset, next) << x.name;
    const int64_t elements =
        std::accumulate(x.shape.begin(), x.shape.end(), int64_t{1}, std::multiplies<int64_t>());
    EXPECT_EQ(static_cast<size_t>(elements), x.count) << x.name;
    next += x.count;
  }
  EXPECT_EQ(next, (*model)->num_params());
  // The last layer first: backward produces it first.
  EXPECT_THAT(names, ElementsAre("fc2.weight", "fc2.bias", "fc1.weight", "fc1.bias"));
  EXPECT_EQ(t[0].shape, (std::vector<int64_t>{3, 7}));
  EXPECT_EQ(t[2].shape, (std::vector<int64_t>{7, 5}));
  EXPECT_EQ((*model)->Describe(), "mlp/relu/5/7/3");
}

TEST(ModelTest, UnknownModelsAndActivationsNameTheField) {
  v1::ModelSpec spec;
  spec.set_type("transformer-xl");
  absl::StatusOr<std::unique_ptr<Model>> unknown = CreateModel(spec, DataShape{5, 3});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("model.type"));
  spec.set_type("mlp");
  spec.set_activation("swish");
  absl::StatusOr<std::unique_ptr<Model>> act = CreateModel(spec, DataShape{5, 3});
  EXPECT_EQ(act.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(act.status().message(), HasSubstr("model.activation"));
}

std::vector<std::pair<size_t, size_t>> Pairs(const BucketPlan& plan) {
  std::vector<std::pair<size_t, size_t>> out;
  for (const BucketPlan::Bucket& b : plan.buckets()) out.emplace_back(b.offset, b.count);
  return out;
}

TEST(BucketPlanTest, BucketsCloseAtReadyPointsOnceTheyHoldTheMinimum) {
  const std::vector<size_t> points = {3, 5, 9, 10, 16, 20};
  EXPECT_THAT(Pairs(BucketPlan(points, 4, 1)),
              ElementsAre(std::pair<size_t, size_t>{0, 5}, std::pair<size_t, size_t>{5, 4},
                          std::pair<size_t, size_t>{9, 7}, std::pair<size_t, size_t>{16, 5}));
  // A minimum larger than everything: one bucket with the tail.
  EXPECT_THAT(Pairs(BucketPlan(points, 100, 2)), ElementsAre(std::pair<size_t, size_t>{0, 22}));
  // The Mlp's row blocks: each layer of this one is cut into pieces of 10 values.
  Mlp mlp({5, 7, 3}, kernels::Activation::kRelu);
  const BucketPlan plan(mlp.ReadyPoints(10), 10, 1);
  size_t covered = 0;
  for (const BucketPlan::Bucket& b : plan.buckets()) {
    EXPECT_EQ(b.offset, covered);
    covered += b.count;
  }
  EXPECT_EQ(covered, mlp.num_params() + 1);
  EXPECT_EQ(plan.largest(), 14u);
}

TEST(BucketPlanTest, TheCursorSendsEachBucketOnceAndTheLastAtFinish) {
  const BucketPlan plan({3, 5, 9, 10, 16, 20}, 4, 1);
  std::vector<size_t> sent;
  BucketPlan::Cursor cursor(plan, [&](const BucketPlan::Bucket& b) { sent.push_back(b.offset); });
  cursor.Ready(3);
  EXPECT_TRUE(sent.empty());
  cursor.Ready(10);
  EXPECT_THAT(sent, ElementsAre(0, 5));
  cursor.Ready(20);
  EXPECT_THAT(sent, ElementsAre(0, 5, 9)) << "the last bucket waits for its tail";
  cursor.Finish();
  cursor.Finish();
  EXPECT_THAT(sent, ElementsAre(0, 5, 9, 16));
}

}  // namespace
}  // namespace lockstep::worker
