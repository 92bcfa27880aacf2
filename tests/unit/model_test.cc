// The Model interface and the bucket plan every step engine shares: a model's tensors cover its
// flat buffer exactly once, in order, under their export names; the plan closes buckets at ready
// points once they hold the minimum, carries the tail in the last one, and its cursor sends each
// bucket once, the last only at Finish.
#include <numeric>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "common/model_layout.h"
#include "worker/step/bucket_plan.h"
#include "worker/step/optimizer.h"
#include "common/random.h"
#include "worker/model/mlp.h"
#include "worker/model/model.h"

namespace lockstep::worker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ModelTest, MlpTensorsCoverTheBufferInOrderWithExportNames) {
  v1::ModelSpec spec;
  spec.set_type("mlp");
  spec.mutable_mlp()->add_hidden_widths(7);
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
  spec.mutable_mlp()->set_activation("swish");
  absl::StatusOr<std::unique_ptr<Model>> act = CreateModel(spec, DataShape{5, 3});
  EXPECT_EQ(act.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(act.status().message(), HasSubstr("model.mlp.activation"));
}

v1::ModelSpec TinyGpt() {
  v1::ModelSpec spec;
  spec.set_type("gpt");
  spec.mutable_gpt()->set_vocab_size(20);
  spec.mutable_gpt()->set_context_length(6);
  spec.mutable_gpt()->set_n_layer(2);
  spec.mutable_gpt()->set_n_head(2);
  spec.mutable_gpt()->set_d_model(8);
  return spec;
}

v1::ModelSpec TinyMlp() {
  v1::ModelSpec spec;
  spec.set_type("mlp");
  spec.mutable_mlp()->add_hidden_widths(7);
  spec.mutable_mlp()->add_hidden_widths(4);
  return spec;
}

// The coordinator sizes memory and checks frozen patterns with ModelTensors; the models must lay
// out exactly those tensors.
TEST(ModelTest, TheSpecsImpliedTensorsAreTheModelsTensors) {
  for (const v1::ModelSpec& spec : {TinyGpt(), TinyMlp()}) {
    auto model = CreateModel(spec, DataShape{5, 3}).value();
    const std::vector<TensorSize> implied = ModelTensors(spec, 5, 3);
    ASSERT_EQ(implied.size(), model->tensors().size()) << spec.type();
    for (size_t i = 0; i < implied.size(); ++i) {
      EXPECT_EQ(implied[i].name, model->tensors()[i].name);
      EXPECT_EQ(static_cast<size_t>(implied[i].count), model->tensors()[i].count);
    }
  }
}

// A batch for either model: 4 samples.
struct TinyBatch {
  std::vector<float> x;
  std::vector<int32_t> y, tokens;
  Batch batch;
};
TinyBatch MakeBatch(const v1::ModelSpec& spec) {
  TinyBatch b;
  SplitMix64 rng(4);
  if (spec.type() == "gpt") {
    for (int i = 0; i < 4 * 7; ++i) b.tokens.push_back(static_cast<int32_t>(rng.Below(20)));
    b.batch = Batch{4, nullptr, 0, nullptr, b.tokens.data(), 7};
  } else {
    for (int i = 0; i < 4 * 5; ++i) b.x.push_back(static_cast<float>(rng.Normal()));
    for (int i = 0; i < 4; ++i) b.y.push_back(static_cast<int32_t>(rng.Below(3)));
    b.batch = Batch{4, b.x.data(), 5, b.y.data(), nullptr, 0};
  }
  return b;
}

// Freezing takes the tensors out of the gradient buffer; the others' gradients are the bits they
// have without freezing, packed in buffer order, and the ready points cover the packed buffer.
TEST(ModelTest, FrozenTensorsGetNoGradientAndTheRestAreUnchanged) {
  for (const auto& [spec, patterns] :
       {std::pair<v1::ModelSpec, std::vector<std::string>>{TinyGpt(), {"wte.weight", "h.0.*"}},
        {TinyGpt(), {"ln_f.*", "wpe.weight"}},
        {TinyMlp(), {"fc2.*"}},
        {TinyMlp(), {"fc3.weight"}}}) {
    auto full = CreateModel(spec, DataShape{5, 3}).value();
    auto frozen = CreateModel(spec, DataShape{5, 3}).value();
    ASSERT_TRUE(frozen->Freeze(patterns).ok());
    full->Initialize(3);
    frozen->Initialize(3);
    TinyBatch b = MakeBatch(spec);
    std::vector<size_t> ready;
    full->ForwardBackward(b.batch, 0.25f, 16, nullptr, nullptr);
    frozen->ForwardBackward(b.batch, 0.25f, 16, nullptr, [&](size_t r) { ready.push_back(r); });
    EXPECT_EQ(ready, frozen->ReadyPoints(16)) << spec.type();
    ASSERT_EQ(ready.back(), frozen->num_grads());
    size_t g = 0, frozen_count = 0;
    for (size_t t = 0; t < full->tensors().size(); ++t) {
      const Tensor& x = full->tensors()[t];
      if (frozen->frozen(t)) {
        frozen_count += x.count;
        continue;
      }
      EXPECT_TRUE(std::equal(full->grads() + x.offset, full->grads() + x.offset + x.count,
                             frozen->grads() + g))
          << x.name;
      g += x.count;
    }
    EXPECT_EQ(g, frozen->num_grads());
    EXPECT_EQ(frozen->num_frozen_params(), frozen_count);
    EXPECT_GT(frozen_count, 0u);
  }
  auto model = CreateModel(TinyGpt(), DataShape{}).value();
  absl::Status none = model->Freeze({"h.*", "wte"});
  EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.message(), HasSubstr("\"wte\""));
  EXPECT_EQ(model->Freeze({"*"}).code(), absl::StatusCode::kInvalidArgument);
}

// AdamW decays the GPT's matrices only (and its embeddings when asked); clipping scales the
// summed gradient to the global norm, identically in the float and the fixed-point update.
TEST(OptimizerTest, DecayOnMatricesOnlyAndGlobalNormClipping) {
  auto model = CreateModel(TinyGpt(), DataShape{}).value();
  model->Initialize(1);
  v1::OptimizerSpec spec;
  spec.set_type("adamw");
  spec.set_learning_rate(0.1);
  spec.set_beta1(0.9);
  spec.set_beta2(0.999);
  spec.set_epsilon(1e-8);
  spec.set_weight_decay(0.5);
  for (bool decay_embeddings : {false, true}) {
    spec.set_decay_embeddings(decay_embeddings);
    Optimizer opt(spec, model->segments(), 10);
    std::vector<float> p(model->params(), model->params() + model->num_params());
    std::vector<float> zero(model->num_grads(), 0.0f);
    opt.Step(p.data(), zero.data(), 1);
    for (const Tensor& t : model->tensors()) {
      const bool changed = !std::equal(p.begin() + t.offset, p.begin() + t.offset + t.count,
                                       model->params() + t.offset);
      // With zero gradient only the decay moves a parameter (LayerNorm weights are 1, biases 0).
      const bool want = t.shape.size() >= 2 && (!t.embedding || decay_embeddings);
      if (t.name.find(".bias") == std::string::npos) {
        EXPECT_EQ(changed, want) << t.name;
      }
    }
  }
  spec.set_weight_decay(0);
  spec.set_grad_clip_norm(1.0);
  Optimizer clipped(spec, model->segments(), 10);
  v1::OptimizerSpec plain_spec = spec;
  plain_spec.set_grad_clip_norm(0);
  Optimizer plain(plain_spec, model->segments(), 10);
  SplitMix64 rng(9);
  std::vector<float> g(model->num_grads());
  double sq = 0;
  for (float& v : g) {
    v = static_cast<float>(rng.Normal());
    sq += double{v} * v;
  }
  const double norm = std::sqrt(sq);
  ASSERT_GT(norm, 2.0);
  std::vector<float> scaled = g;
  const float factor = static_cast<float>(1.0 / (norm + 1e-6));
  for (float& v : scaled) v *= factor;
  std::vector<float> a(model->params(), model->params() + model->num_params()), b = a, c = a;
  std::vector<float> g_copy = g;
  clipped.Step(a.data(), g_copy.data(), 1);
  plain.Step(b.data(), scaled.data(), 1);
  EXPECT_EQ(a, b) << "clipping is the gradient scaled by clip / (norm + 1e-6)";
  EXPECT_NEAR(clipped.last_grad_norm(), norm, 1e-9 * norm);
  // The fixed-point update clips with the norm of the integers: the same bits as the float
  // update fed their conversion.
  constexpr int kBits = 40;
  std::vector<int64_t> fixed(g.size());
  for (size_t i = 0; i < g.size(); ++i) fixed[i] = std::llround(std::ldexp(double{g[i]}, kBits));
  Optimizer fixed_opt(spec, model->segments(), 10), float_opt(spec, model->segments(), 10);
  std::vector<float> converted(g.size());
  for (size_t i = 0; i < g.size(); ++i) {
    converted[i] = static_cast<float>(std::ldexp(static_cast<double>(fixed[i]), -kBits));
  }
  std::vector<float> d = c;
  fixed_opt.StepFixedPoint(c.data(), fixed.data(), kBits, 1);
  float_opt.Step(d.data(), converted.data(), 1);
  double max_diff = 0;
  for (size_t i = 0; i < c.size(); ++i) max_diff = std::max(max_diff, std::abs(double{c[i]} - d[i]));
  EXPECT_LT(max_diff, 1e-6) << "the two norms differ only in rounding";
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
