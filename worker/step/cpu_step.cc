// The CPU step: forward/backward through the model, bucketed sums as backward produces them.
#include "worker/step/cpu_step.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "kernels/cpu_kernels.h"

namespace lockstep::worker {

namespace {

// Backward's row blocks, of about bucket_size_kib.
size_t ChunkFloats(const v1::JobSpec& spec) {
  return static_cast<size_t>(std::max(1, spec.bucket_size_kib())) * 1024 / sizeof(float);
}

// Buckets close at the row blocks backward produces, once they hold bucket_size_kib: large
// layers span several buckets, so their communication overlaps their own computation. Default
// mode: the loss rides in the last bucket; deterministic mode: the loss and the out-of-range
// count.
BucketPlan Plan(const v1::JobSpec& spec, const Model& model) {
  const size_t chunk = ChunkFloats(spec);
  return BucketPlan(model.ReadyPoints(chunk), chunk, spec.deterministic() ? 2 : 1);
}

}  // namespace

CpuStep::CpuStep(const v1::JobSpec& spec, Model* model, Optimizer* optimizer,
                 const SampleLayout& layout)
    : deterministic_(spec.deterministic()),
      model_(model),
      optimizer_(optimizer),
      layout_(layout),
      chunk_floats_(ChunkFloats(spec)),
      plan_(Plan(spec, *model)) {}

size_t CpuStep::LargestCollectiveBytes(const v1::JobSpec& spec, const Model& model) {
  if (spec.deterministic()) return (model.num_grads() + 2) * sizeof(int64_t);
  return Plan(spec, model).largest() * sizeof(float);
}

absl::Status CpuStep::Begin(const StepGroup& group) {
  comm_ = group.host;
  reducer_ = std::make_unique<GradientReducer>(comm_);
  return absl::OkStatus();
}

absl::Status CpuStep::End() {
  reducer_.reset();  // joins its thread: nothing uses the communicator after this
  comm_ = nullptr;
  return absl::OkStatus();
}

absl::StatusOr<HostBatch> CpuStep::HostBuffers(int n) {
  features_.resize(static_cast<size_t>(n) * layout_.feature_stride);
  labels_.resize(layout_.labels() ? n : 0);
  tokens_.resize(static_cast<size_t>(n) * layout_.token_stride);
  HostBatch batch;
  batch.features = layout_.feature_stride > 0 ? features_.data() : nullptr;
  batch.feature_stride = layout_.feature_stride;
  batch.labels = layout_.labels() ? labels_.data() : nullptr;
  batch.tokens = layout_.token_stride > 0 ? tokens_.data() : nullptr;
  batch.token_stride = layout_.token_stride;
  return batch;
}

absl::StatusOr<StepResult> CpuStep::TakeStep(const StepArgs& args) {
  if (reducer_ == nullptr) return absl::FailedPreconditionError("CpuStep: TakeStep before Begin");
  return deterministic_ ? StepDeterministic(args) : Step(args);
}

absl::StatusOr<StepResult> CpuStep::Step(const StepArgs& args) {
  const int n = args.n;
  const Batch batch = HostBatch{features_.data(), layout_.feature_stride, labels_.data(),
                                tokens_.data(), layout_.token_stride}
                          .View(n);
  GradientReducer* reducer = reducer_.get();
  BucketPlan::Cursor buckets(plan_, [&](const BucketPlan::Bucket& b) {
    reducer->Enqueue(model_->grads() + b.offset, b.count);
  });
  const absl::Time t0 = absl::Now();
  // Micro-batches of the share with gradient accumulation; only the last one's backward
  // hands buckets to the reducer (their sums are final only then).
  const int micro = std::clamp(args.micro_batch, 1, std::max(n, 1));
  double loss_sum = 0;
  for (int first = 0; first < n; first += micro) {
    const int m = std::min(micro, n - first);
    const bool last = first + m >= n;
    loss_sum += model_->ForwardBackward(
        batch.Slice(first, m), args.grad_scale, chunk_floats_,
        [&](double pass) {
          // The loss rides in the last bucket, after the gradient.
          if (last) model_->loss_slot() = static_cast<float>(loss_sum + pass) * args.grad_scale;
        },
        last ? std::function<void(size_t)>([&](size_t ready) { buckets.Ready(ready); })
             : std::function<void(size_t)>(),
        /*accumulate=*/first > 0);
  }
  buckets.Finish();
  const absl::Time t1 = absl::Now();
  LOCKSTEP_RETURN_IF_ERROR(reducer->Wait());
  const absl::Time t2 = absl::Now();
  StepResult result;
  result.loss = model_->loss_slot();
  optimizer_->Step(model_->params(), model_->grads(), args.step);
  result.compute = t1 - t0;
  result.exposed_comm = t2 - t1;
  result.update = absl::Now() - t2;
  return result;
}

absl::StatusOr<StepResult> CpuStep::StepDeterministic(const StepArgs& args) {
  const int shard = args.micro_shard;
  if (shard <= 0 || args.n % shard != 0) {
    return absl::InternalError("deterministic step: the share must be whole micro-shards");
  }
  const size_t n = model_->num_grads();
  const int bits = args.frac_bits;
  const double scale = std::ldexp(1.0, bits);
  // This rank's integer sum goes straight into the communicator's shared memory when it has
  // some (ranks on one host), else into fixed_sum_ and through AllreduceSum. Every entry is
  // written before it is read: the first shard stores, later ones add.
  int64_t* const staged = comm_->StagingInt64(n + 2);
  if (staged == nullptr) fixed_sum_.resize(n + 2);
  int64_t* const sum = staged != nullptr ? staged : fixed_sum_.data();
  sum[n] = 0;
  int64_t out_of_range = 0;
  BucketPlan::Cursor buckets(plan_, [&](const BucketPlan::Bucket& b) {
    if (staged != nullptr) {
      reducer_->EnqueueStaged(b.offset, b.count);
    } else {
      reducer_->Enqueue(sum + b.offset, b.count);
    }
  });
  // Every shard goes through the same buffers (one shard's worth, at one address), so its
  // computation is the same whichever rank holds it and wherever it sits in the share.
  std::vector<float> shard_features(static_cast<size_t>(shard) * layout_.feature_stride);
  std::vector<int32_t> shard_labels(layout_.labels() ? shard : 0);
  std::vector<int32_t> shard_tokens(static_cast<size_t>(shard) * layout_.token_stride);
  const Batch one = HostBatch{shard_features.data(), layout_.feature_stride, shard_labels.data(),
                              shard_tokens.data(), layout_.token_stride}
                        .View(shard);
  const absl::Time t0 = absl::Now();
  // One micro-shard at a time, so every shard's gradient is computed by the same code on the
  // same shapes whichever rank holds it: the integer sum is then the same bits for any W.
  // The last shard's gradient is accumulated piece by piece as backward produces it, and each
  // finished bucket of the integer sum goes to the reducer at once, overlapping the rest of
  // backward (the loss and the out-of-range count ride in the last bucket).
  const int shards = args.n / shard;
  for (int k = 0; k < shards; ++k) {
    const bool last_shard = k + 1 == shards;
    std::copy_n(features_.data() + static_cast<size_t>(k) * shard_features.size(),
                shard_features.size(), shard_features.data());
    std::copy_n(labels_.data() + static_cast<size_t>(k) * shard_labels.size(),
                shard_labels.size(), shard_labels.data());
    std::copy_n(tokens_.data() + static_cast<size_t>(k) * shard_tokens.size(),
                shard_tokens.size(), shard_tokens.data());
    size_t accumulated = 0;
    auto to_fixed = k == 0 ? kernels::StoreFixedPoint : kernels::AccumulateFixedPoint;
    auto on_ready = [&](size_t ready) {
      out_of_range += to_fixed(model_->grads() + accumulated, ready - accumulated, bits,
                               sum + accumulated);
      accumulated = ready;
      buckets.Ready(ready);
    };
    // Every shard is computed with the same row blocks, last or not, so its bits do not
    // depend on its position in a rank's share.
    const double loss = model_->ForwardBackward(
        one, args.grad_scale, chunk_floats_, nullptr,
        last_shard ? std::function<void(size_t)>(on_ready) : std::function<void(size_t)>());
    if (!last_shard) out_of_range += to_fixed(model_->grads(), n, bits, sum);
    out_of_range += kernels::AccumulateLossFixedPoint(loss, args.grad_scale, bits, &sum[n]);
    if (last_shard) {
      sum[n + 1] = out_of_range;
      buckets.Finish();
    }
  }
  const absl::Time t1 = absl::Now();
  LOCKSTEP_RETURN_IF_ERROR(reducer_->Wait());
  const absl::Time t2 = absl::Now();
  const int64_t* reduced = staged != nullptr ? comm_->StagedResultInt64() : fixed_sum_.data();
  StepResult result;
  result.rejected = reduced[n + 1];
  result.loss = static_cast<double>(reduced[n]) / scale;
  if (result.rejected == 0) {
    optimizer_->StepFixedPoint(model_->params(), reduced, bits, args.step);
  }
  result.compute = t1 - t0;
  result.exposed_comm = t2 - t1;
  result.update = absl::Now() - t2;
  return result;
}

}  // namespace lockstep::worker
