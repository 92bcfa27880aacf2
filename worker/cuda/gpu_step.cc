#include "worker/cuda/gpu_step.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "kernels/device_memory.h"
#include "kernels/gpu_check.h"

namespace lockstep::worker {

using kernels::cuda::DeviceFree;
using kernels::cuda::DeviceMalloc;
namespace {

// Hands a growing prefix of a device buffer to NCCL in buckets: each is summed on the NCCL
// stream after an event that orders it behind the compute-stream work that wrote it, while that
// stream goes on. The first error sticks and stops further sends.
template <typename T>
class BucketSender {
 public:
  BucketSender(T* data, cudaStream_t compute, cudaEvent_t ready, NcclCommunicator* comm)
      : data_(data), compute_(compute), ready_(ready), comm_(comm) {}

  // Sends [sent(), end).
  void SendUpTo(size_t end) {
    if (!status_.ok() || end <= sent_) return;
    status_ = [&]() -> absl::Status {
      LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventRecord(ready_, compute_));
      LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamWaitEvent(comm_->stream(), ready_, 0));
      return comm_->AllreduceSum(data_ + sent_, end - sent_);
    }();
    sent_ = end;
  }
  size_t sent() const { return sent_; }
  const absl::Status& status() const { return status_; }

 private:
  T* const data_;
  const cudaStream_t compute_;
  const cudaEvent_t ready_;
  NcclCommunicator* const comm_;
  size_t sent_ = 0;
  absl::Status status_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GpuStep>> GpuStep::Create(const v1::JobSpec& spec,
                                                         const SampleLayout& layout, Model* model,
                                                         Optimizer* optimizer) {
  std::unique_ptr<GpuStep> step(new GpuStep());
  // The device model's gradient buffer is laid out as its parameters: frozen tensors take room
  // in it, and RunPass keeps them zero (the update skips them).
  const std::vector<Tensor>& tensors = model->tensors();
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (!model->frozen(t)) continue;
    const size_t begin = tensors[t].offset, end = begin + tensors[t].count;
    if (!step->frozen_.empty() && step->frozen_.back().second == begin) {
      step->frozen_.back().second = end;
    } else {
      step->frozen_.emplace_back(begin, end);
    }
  }
  step->host_model_ = model;
  step->host_optimizer_ = optimizer;
  step->layout_ = layout;
  step->optimizer_ = spec.optimizer();
  // NCCL wants large messages: at least 16 MiB per bucket (the CPU's 256 KiB default would be
  // hundreds of tiny allreduces for a large model), or the job's bucket size if larger.
  step->bucket_floats_ =
      std::max<size_t>(size_t{4} << 20, static_cast<size_t>(spec.bucket_size_kib()) * 256);
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaGetDevice(&step->device_));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&step->stream_, cudaStreamNonBlocking));
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&step->copy_stream_, cudaStreamNonBlocking));
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&step->grads_ready_, cudaEventDisableTiming));
  for (int slot = 0; slot < 2; ++slot) {
    LOCKSTEP_GPU_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&step->uploaded_[slot], cudaEventDisableTiming));
    LOCKSTEP_GPU_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&step->consumed_[slot], cudaEventDisableTiming));
  }
  absl::StatusOr<std::unique_ptr<GpuModel>> device_model =
      CreateGpuModel(spec, *model, step->stream_);
  if (!device_model.ok()) return device_model.status();
  step->model_ = *std::move(device_model);
  if (step->model_->num_params() != model->num_params()) {
    return absl::InternalError(absl::StrCat("the device model holds ", step->model_->num_params(),
                                            " parameters, the host's ", model->num_params()));
  }
  step->plan_ = std::make_unique<BucketPlan>(step->model_->ReadyPoints(step->bucket_floats_),
                                             step->bucket_floats_, spec.deterministic() ? 2 : 0);
  absl::StatusOr<kernels::cuda::Blas::Precision> precision =
      kernels::cuda::Blas::ParsePrecision(spec.precision());
  if (!precision.ok()) return precision.status();
  LOCKSTEP_RETURN_IF_ERROR(step->model_->blas().SetPrecision(*precision));
  const size_t params = step->model_->num_params();
  step->segments_ = optimizer->segments();
  // The optimizer's state is the host's: trainable values only (gradient offsets).
  step->num_grads_ = model->num_grads();
  step->state_floats_ = (spec.optimizer().type() == "adamw" ? 2 : 1) * step->num_grads_;
  if (step->state_floats_ != optimizer->state().size()) {
    return absl::InternalError(absl::StrCat("the optimizer's state holds ",
                                            optimizer->state().size(), " values, the device's ",
                                            step->state_floats_));
  }
  LOCKSTEP_GPU_RETURN_IF_ERROR(DeviceMalloc(&step->state_, step->state_floats_ * sizeof(float)));
  if (spec.optimizer().grad_clip_norm() > 0) {
    LOCKSTEP_GPU_RETURN_IF_ERROR(DeviceMalloc(
        &step->clip_workspace_, (kernels::cuda::kClipWorkspace + 1) * sizeof(double)));
  }
  // On the step's stream (non-blocking, so a plain cudaMemset on the legacy stream could land
  // after an Upload and wipe the healed state).
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      cudaMemsetAsync(step->state_, 0, step->state_floats_ * sizeof(float), step->stream_));
  if (spec.deterministic()) {
    LOCKSTEP_GPU_RETURN_IF_ERROR(DeviceMalloc(&step->fixed_, (params + 2) * sizeof(int64_t)));
  }
  return step;
}

GpuStep::~GpuStep() {
  // The trainer that keeps this engine may go on another thread than the one that made it.
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (copy_stream_ != nullptr) cudaStreamSynchronize(copy_stream_);
  model_.reset();
  DeviceFree(state_);
  DeviceFree(clip_workspace_);
  DeviceFree(heal_);
  DeviceFree(fixed_);
  for (int slot = 0; slot < 2; ++slot) {
    DeviceFree(x_[slot]);
    DeviceFree(y_[slot]);
    if (uploaded_[slot] != nullptr) cudaEventDestroy(uploaded_[slot]);
    if (consumed_[slot] != nullptr) cudaEventDestroy(consumed_[slot]);
  }
  if (pinned_) {
    cudaFreeHost(host_x_);
    cudaFreeHost(host_y_);
  }
  if (grads_ready_ != nullptr) cudaEventDestroy(grads_ready_);
  if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status GpuStep::Upload(const float* params, const std::vector<float>& optimizer_state) {
  if (optimizer_state.size() != state_floats_) {
    return absl::InternalError("optimizer state size differs between host and device");
  }
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemcpyAsync(state_, optimizer_state.data(),
                                               state_floats_ * sizeof(float),
                                               cudaMemcpyHostToDevice, stream_));
  return model_->UploadParams(params);  // synchronizes the stream
}

absl::Status GpuStep::DownloadState(float* params, std::vector<float>* optimizer_state) {
  optimizer_state->resize(state_floats_);
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemcpyAsync(optimizer_state->data(), state_,
                                               state_floats_ * sizeof(float),
                                               cudaMemcpyDeviceToHost, stream_));
  return model_->DownloadParams(params);  // synchronizes the stream
}

absl::StatusOr<NcclCommunicator*> GpuStep::Nccl(const StepGroup& group) {
  if (group.device == nullptr) return nullptr;
  auto* nccl = dynamic_cast<NcclCommunicator*>(group.device);
  if (nccl == nullptr) return absl::InternalError("GpuStep: a device group that is not NCCL's");
  return nccl;
}

absl::Status GpuStep::Begin(const StepGroup& group) {
  absl::StatusOr<NcclCommunicator*> nccl = Nccl(group);
  if (!nccl.ok()) return nccl.status();
  // A group of several ranks sums on the devices: without their group this rank would train
  // alone and drift from the others.
  if (*nccl == nullptr && group.host != nullptr && group.host->size() > 1) {
    return absl::InternalError("GpuStep: a group of several ranks without its NCCL communicator");
  }
  // The device's copy from an earlier generation is kept when it is the host's state (the
  // last download, or a heal received into both); anything else is replaced by the host's.
  if (mirror_.upload_needed()) {
    mirror_.Diverged();  // until the whole upload is done
    LOCKSTEP_RETURN_IF_ERROR(Upload(host_model_->params(), host_optimizer_->state()));
    mirror_.Copied();
    ++uploads_;
  }
  comm_ = *nccl;
  return absl::OkStatus();
}

absl::Status GpuStep::End() {
  comm_ = nullptr;  // the device group goes with the generation
  absl::Status s = Sync();
  // After a failed download the trainer falls back to the host's older state; the device's
  // must never be read back over it, nor trained on: the next Begin uploads the host's.
  if (!s.ok()) mirror_.Diverged();
  return s;
}

absl::Status GpuStep::Sync() {
  if (state_unknown_) {
    state_unknown_ = false;
    mirror_.Diverged();
    return absl::InternalError(
        "a step failed after its update was queued: the device's state is not the last "
        "completed step's");
  }
  if (!mirror_.download_needed()) return absl::OkStatus();
  // Staged: the host's state changes only once both copies arrived (a half-written host
  // state could be a heal's source, under a checksum computed over the same mix).
  staged_params_.resize(model_->num_params());
  LOCKSTEP_RETURN_IF_ERROR(DownloadState(staged_params_.data(), &staged_state_));
  std::copy(staged_params_.begin(), staged_params_.end(), host_model_->params());
  host_optimizer_->state().swap(staged_state_);
  mirror_.Copied();
  return absl::OkStatus();
}

absl::StatusOr<StepResult> GpuStep::TakeStep(const StepArgs& args) {
  if (mirror_.upload_needed()) {
    // Never on a device state that is not the host's: the next generation's Begin uploads it.
    return absl::InternalError(
        "GpuStep: a step on a device state that is not the host's (no Begin since it changed)");
  }
  const absl::Time start = absl::Now();
  StepResult result;
  if (args.deterministic) {
    absl::StatusOr<DeterministicResult> r =
        StepDeterministic(last_batch_.features, HostInts(), args.n, args.micro_shard,
                          args.grad_scale, args.frac_bits, args.lr, args.step);
    if (!r.ok()) return r.status();
    result.loss = r->loss;
    result.rejected = r->rejected;
  } else {
    absl::StatusOr<double> loss = Step(last_batch_.features, HostInts(), args.n,
                                       args.micro_batch, args.grad_scale, args.lr, args.step);
    if (!loss.ok()) return loss.status();
    result.loss = *loss;
  }
  if (result.rejected == 0) mirror_.Stepped();
  result.compute = absl::Now() - start;  // the device step is one unit (no breakdown yet)
  return result;
}

absl::Status GpuStep::BroadcastState(const StepGroup& group, StatePart part, size_t offset,
                                     size_t count, float* host, int root, bool take) {
  absl::StatusOr<NcclCommunicator*> nccl = Nccl(group);
  if (!nccl.ok()) return nccl.status();
  NcclCommunicator* const comm = *nccl;
  if (comm == nullptr || comm->size() <= 1) {
    return absl::UnimplementedError("no NCCL group to broadcast over");
  }
  const bool params = part == StatePart::kParams;
  const size_t size = params ? model_->num_params() : state_floats_;
  const size_t host_size = params ? host_model_->num_params() : host_optimizer_->state().size();
  if (offset > size || count > size - offset || size != host_size) {
    return absl::InternalError(absl::StrCat("heal piece [", offset, ", ", offset + count, ") of ",
                                            params ? "the parameters" : "the optimizer state",
                                            ": the device holds ", size, " values, the host ",
                                            host_size));
  }
  float* const state = (params ? model_->params() : state_) + offset;
  const size_t bytes = count * sizeof(float);
  const bool sending = comm->rank() == root;
  // The root's device copy goes as it is when it is the host's state; otherwise (a device
  // that never held it, or after a failed download) the host's piece goes through scratch.
  const bool from_device = sending && mirror_.holds_host();
  // A member that takes the state receives straight into its device state: from the first
  // piece on, that is no longer the host's (the trainer commits the host's copy only once all
  // of it arrived and its checksum holds, and then says so: HostStateChanged(true)).
  const bool into_device = !sending && take;
  if (into_device) mirror_.Diverged();
  if (!from_device && !into_device && count > heal_capacity_) {
    // Every broadcast before ended in a successful Wait: nothing uses the old buffer.
    DeviceFree(heal_);
    heal_ = nullptr;
    heal_capacity_ = 0;
    const size_t capacity = std::max(count, kHealScratchFloats);
    LOCKSTEP_GPU_RETURN_IF_ERROR(DeviceMalloc(&heal_, capacity * sizeof(float)));
    heal_capacity_ = capacity;
  }
  float* const buffer = from_device || into_device ? state : heal_;
  // The device state was last written on the compute stream: done before NCCL reads or
  // overwrites it (idle between generations; this makes sure).
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  // All on the communicator's stream, in order. The download waits until the watchdog saw the
  // broadcast finish (a dead root must end in Wait, not in a copy that never returns); the
  // upload starts on an idle stream (the last piece's Wait returned).
  if (sending && !from_device) {
    LOCKSTEP_GPU_RETURN_IF_ERROR(
        cudaMemcpyAsync(heal_, host, bytes, cudaMemcpyHostToDevice, comm->stream()));
  }
  LOCKSTEP_RETURN_IF_ERROR(comm->Broadcast(buffer, bytes, root));
  LOCKSTEP_RETURN_IF_ERROR(comm->Wait());
  if (into_device) {
    LOCKSTEP_GPU_RETURN_IF_ERROR(
        cudaMemcpyAsync(host, buffer, bytes, cudaMemcpyDeviceToHost, comm->stream()));
  }
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamSynchronize(comm->stream()));
  return absl::OkStatus();
}

absl::StatusOr<HostBatch> GpuStep::HostBuffers(int n) {
  const size_t floats = layout_.feature_stride, ints = IntsPerSample();
  if (n > host_capacity_) {
    // Steps end with both streams idle, but be sure no copy still reads the old buffers.
    LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamSynchronize(copy_stream_));
    if (pinned_) {
      cudaFreeHost(host_x_);
      cudaFreeHost(host_y_);
    }
    host_x_ = nullptr;
    host_y_ = nullptr;
    pinned_ = false;
    host_capacity_ = 0;
    // At least a byte each: a model without features still gets a (tiny) pinned buffer.
    const size_t x_bytes = std::max<size_t>(1, n * floats * sizeof(float));
    const size_t y_bytes = std::max<size_t>(1, n * ints * sizeof(int32_t));
    void* x = nullptr;
    void* y = nullptr;
    const bool have_x = cudaHostAlloc(&x, x_bytes, cudaHostAllocDefault) == cudaSuccess;
    const bool have_y = have_x && cudaHostAlloc(&y, y_bytes, cudaHostAllocDefault) == cudaSuccess;
    if (have_y) {
      host_x_ = static_cast<float*>(x);
      host_y_ = static_cast<int32_t*>(y);
      pinned_ = true;
    } else {
      // Locked memory can be limited (RLIMIT_MEMLOCK in containers): ordinary memory works,
      // only the copies are no longer asynchronous.
      cudaGetLastError();
      if (have_x) cudaFreeHost(x);
      LOG(WARNING) << "no pinned host memory for " << n << " samples; copying batches from "
                   << "ordinary memory";
      pageable_x_.resize(std::max<size_t>(1, n * floats));
      pageable_y_.resize(std::max<size_t>(1, n * ints));
    }
    host_capacity_ = n;
  }
  last_batch_ = HostBatch{};
  float* const x = pinned_ ? host_x_ : pageable_x_.data();
  int32_t* const y = pinned_ ? host_y_ : pageable_y_.data();
  if (floats > 0) {
    last_batch_.features = x;
    last_batch_.feature_stride = layout_.feature_stride;
  }
  if (layout_.labels()) {
    last_batch_.labels = y;
  } else {
    last_batch_.tokens = y;
    last_batch_.token_stride = layout_.token_stride;
  }
  return last_batch_;
}

absl::Status GpuStep::Reserve(int n) {
  if (n <= capacity_) return absl::OkStatus();
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamSynchronize(copy_stream_));
  capacity_ = 0;  // nothing usable until every buffer exists again
  const size_t floats = layout_.feature_stride, ints = IntsPerSample();
  for (int slot = 0; slot < 2; ++slot) {
    DeviceFree(x_[slot]);
    DeviceFree(y_[slot]);
    x_[slot] = nullptr;
    y_[slot] = nullptr;
  }
  for (int slot = 0; slot < 2; ++slot) {
    LOCKSTEP_GPU_RETURN_IF_ERROR(
        DeviceMalloc(&x_[slot], std::max<size_t>(1, n * floats) * sizeof(float)));
    LOCKSTEP_GPU_RETURN_IF_ERROR(
        DeviceMalloc(&y_[slot], std::max<size_t>(1, n * ints) * sizeof(int32_t)));
  }
  capacity_ = n;
  return absl::OkStatus();
}

Batch GpuStep::SlotBatch(int slot, int n) const {
  Batch b;
  b.n = n;
  if (layout_.feature_stride > 0) {
    b.features = x_[slot];
    b.feature_stride = layout_.feature_stride;
  }
  if (layout_.labels()) {
    b.labels = y_[slot];
  } else {
    b.tokens = y_[slot];
    b.token_stride = layout_.token_stride;
  }
  return b;
}

absl::StatusOr<int> GpuStep::UploadPass(int pass, const float* x, const int32_t* y, int n) {
  LOCKSTEP_RETURN_IF_ERROR(Reserve(n));
  const int slot = pass % 2;
  const size_t floats = static_cast<size_t>(n) * layout_.feature_stride;
  const size_t ints = static_cast<size_t>(n) * IntsPerSample();
  // The copy may not overwrite the slot before the compute that reads it (two passes ago) ran.
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_stream_, consumed_[slot], 0));
  if (floats > 0) {
    LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemcpyAsync(x_[slot], x, floats * sizeof(float),
                                                 cudaMemcpyHostToDevice, copy_stream_));
  }
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemcpyAsync(y_[slot], y, ints * sizeof(int32_t),
                                               cudaMemcpyHostToDevice, copy_stream_));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventRecord(uploaded_[slot], copy_stream_));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, uploaded_[slot], 0));
  return slot;
}

absl::Status GpuStep::ReleaseSlot(int slot) {
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventRecord(consumed_[slot], stream_));
  return absl::OkStatus();
}

absl::Status GpuStep::ZeroFrozen(size_t begin, size_t end) {
  for (const auto& [first, last] : frozen_) {
    const size_t from = std::max(first, begin), to = std::min(last, end);
    if (from >= to) continue;
    LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemsetAsync(model_->grads() + from, 0,
                                                 (to - from) * sizeof(float), stream_));
  }
  return absl::OkStatus();
}

absl::Status GpuStep::RunPass(int pass, const float* x, const int32_t* y, int n, float grad_scale,
                              const std::function<void(size_t)>& on_ready, bool accumulate) {
  absl::StatusOr<int> slot = UploadPass(pass, x, y, n);
  if (!slot.ok()) return slot.status();
  // Frozen tensors' gradients are zeroed as backward finishes each piece, before anything
  // reads the piece (the group's sum, the fixed-point conversion, the clip's norm, the update):
  // the same stream orders the zeroing behind backward and ahead of them.
  size_t zeroed = 0;
  absl::Status zero_status;
  std::function<void(size_t)> ready = on_ready;
  if (on_ready != nullptr && !frozen_.empty()) {
    ready = [&](size_t end) {
      if (zero_status.ok()) zero_status = ZeroFrozen(zeroed, end);
      zeroed = end;
      on_ready(end);
    };
  }
  absl::Status run =
      model_->ForwardBackward(SlotBatch(*slot, n), grad_scale, bucket_floats_, ready, accumulate);
  if (run.ok()) run = zero_status;
  if (run.ok()) run = ZeroFrozen(zeroed, model_->num_params());
  // Released whatever happened: the slot's next upload waits for what this pass queued on it.
  absl::Status released = ReleaseSlot(*slot);
  return run.ok() ? released : run;
}

absl::StatusOr<double> GpuStep::Evaluate(const float* x, const int32_t* y, int n,
                                         int64_t* correct) {
  // In pieces no larger than the training micro-batch: the memory was planned for that.
  const int piece = capacity_ > 0 ? std::min(n, capacity_) : n;
  double loss = 0;
  for (int pass = 0, first = 0; first < n; ++pass, first += piece) {
    const int m = std::min(piece, n - first);
    absl::StatusOr<int> slot =
        UploadPass(pass, Features(x, first), Ints(y, first), m);
    if (!slot.ok()) return slot.status();
    absl::StatusOr<double> part = model_->Evaluate(SlotBatch(*slot, m), correct);
    if (!part.ok()) return part.status();
    loss += *part;
    LOCKSTEP_RETURN_IF_ERROR(ReleaseSlot(*slot));
  }
  return loss;
}

void GpuStep::AbortAfterFailure() {
  if (comm_ != nullptr && comm_->size() > 1) {
    comm_->Abort();
    (void)comm_->Wait();
  }
}

absl::StatusOr<double> GpuStep::Step(const float* x, const int32_t* y, int n, int micro_batch,
                                     float grad_scale, float lr, int64_t step) {
  updating_ = false;
  absl::StatusOr<double> result = RunStep(x, y, n, micro_batch, grad_scale, lr, step);
  if (!result.ok()) {
    state_unknown_ = state_unknown_ || updating_;
    AbortAfterFailure();
  }
  return result;
}

absl::Status GpuStep::Update(float lr, int64_t step) {
  if (timer_ != nullptr) timer_->Mark("clip and optimizer");
  absl::Status s = UpdateSegments(lr, step);
  if (timer_ != nullptr) timer_->Mark(nullptr);
  return s;
}

absl::Status GpuStep::UpdateSegments(float lr, int64_t step) {
  const size_t params = model_->num_params();
  // The summed gradient's global norm, clipped on the device as the CPU optimizer does it.
  if (optimizer_.grad_clip_norm() > 0) {
    LOCKSTEP_RETURN_IF_ERROR(kernels::cuda::ClipByGlobalNorm(
        model_->grads(), params, static_cast<float>(optimizer_.grad_clip_norm()), clip_workspace_,
        stream_));
  }
  // Segment by segment, as the CPU optimizer (elementwise: the same bits as one call where
  // the decay is the same). The device's gradient sits where its parameter does; the
  // optimizer's state where the host's gradient does (trainable values only).
  for (const Model::Segment& seg : segments_) {
    float* const p = model_->params() + seg.param_offset;
    const float* const g = model_->grads() + seg.param_offset;
    const float weight_decay = seg.decay ? static_cast<float>(optimizer_.weight_decay()) : 0.0f;
    LOCKSTEP_RETURN_IF_ERROR(
        optimizer_.type() == "adamw"
            ? kernels::cuda::AdamWUpdate(p, g, state_ + seg.grad_offset,
                                         state_ + num_grads_ + seg.grad_offset, seg.count, lr,
                                         static_cast<float>(optimizer_.beta1()),
                                         static_cast<float>(optimizer_.beta2()),
                                         static_cast<float>(optimizer_.epsilon()), weight_decay,
                                         step, stream_)
            : kernels::cuda::SgdMomentumUpdate(p, g, state_ + seg.grad_offset, seg.count, lr,
                                               static_cast<float>(optimizer_.momentum()),
                                               weight_decay, stream_));
  }
  return absl::OkStatus();
}

absl::StatusOr<double> GpuStep::RunStep(const float* x, const int32_t* y, int n, int micro_batch,
                                        float grad_scale, float lr, int64_t step) {
  const bool group = comm_ != nullptr && comm_->size() > 1;
  const int micro = std::clamp(micro_batch, 1, std::max(n, 1));
  // Buckets: each finished piece of the gradient is summed while backward goes on.
  BucketSender<float> buckets(model_->grads(), stream_, grads_ready_, comm_);
  BucketPlan::Cursor cursor(*plan_, [&](const BucketPlan::Bucket& b) {
    buckets.SendUpTo(b.offset + b.count);
  });
  const std::function<void(size_t)> on_ready = [&](size_t ready) { cursor.Ready(ready); };
  // Micro-batches with gradient accumulation; only the last one's backward hands buckets to
  // NCCL (the sums are final only then).
  for (int pass = 0, first = 0; first < n; ++pass, first += micro) {
    const int m = std::min(micro, n - first);
    const bool last = first + m >= n;
    LOCKSTEP_RETURN_IF_ERROR(RunPass(pass, Features(x, first), Ints(y, first), m, grad_scale,
                                     group && last ? on_ready : nullptr, /*accumulate=*/pass > 0));
  }
  if (group) {
    cursor.Finish();  // the rest, then the loss (ready with the forward pass, sent last)
    if (!buckets.status().ok()) return buckets.status();
    LOCKSTEP_RETURN_IF_ERROR(comm_->AllreduceSum(model_->loss_sum_device(), 1));
    // The watchdog: a dead or hung peer ends here with the communicator aborted.
    LOCKSTEP_RETURN_IF_ERROR(comm_->Wait());
  }
  updating_ = true;
  LOCKSTEP_RETURN_IF_ERROR(Update(lr, step));
  absl::StatusOr<double> loss_sum = model_->LossSum();  // waits for the update too
  if (!loss_sum.ok()) return loss_sum.status();
  return *loss_sum * grad_scale;
}

absl::Status GpuStep::AccumulateFixedPoint(const float* x, const int32_t* y, int n, int shard,
                                           float grad_scale, int frac_bits, bool group) {
  if (fixed_ == nullptr) {
    return absl::FailedPreconditionError("this GPU step was not created for deterministic mode");
  }
  if (shard <= 0 || n % shard != 0) {
    return absl::InvalidArgumentError("deterministic step: n must be whole micro-shards");
  }
  const size_t params = model_->num_params();
  int64_t* const loss = fixed_ + params;
  auto* const rejected = reinterpret_cast<unsigned long long*>(fixed_ + params + 1);
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemsetAsync(loss, 0, 2 * sizeof(int64_t), stream_));
  BucketSender<int64_t> buckets(fixed_, stream_, grads_ready_, comm_);
  BucketPlan::Cursor cursor(*plan_, [&](const BucketPlan::Bucket& b) {
    buckets.SendUpTo(b.offset + b.count);
  });
  const int shards = n / shard;
  for (int k = 0; k < shards; ++k) {
    const bool last = k + 1 == shards;
    auto to_fixed = [&](size_t begin, size_t end) {
      return k == 0 ? kernels::cuda::StoreFixedPoint(model_->grads() + begin, end - begin, frac_bits,
                                                     fixed_ + begin, rejected, stream_)
                    : kernels::cuda::AccumulateFixedPoint(model_->grads() + begin, end - begin,
                                                          frac_bits, fixed_ + begin, rejected,
                                                          stream_);
    };
    // In the last shard each finished piece is converted and, once a bucket's worth is, summed
    // over the group while backward goes on. Conversion is elementwise: the same bits in pieces.
    size_t converted = 0;
    absl::Status convert_status;
    const std::function<void(size_t)> on_ready = [&](size_t ready) {
      if (!convert_status.ok()) return;
      convert_status = to_fixed(converted, ready);
      converted = ready;
      cursor.Ready(ready);
    };
    // Slot 0 or its twin, slot 1: both come from cudaMalloc (256-byte aligned), so every
    // shard's products see the same shapes and alignments on every rank.
    LOCKSTEP_RETURN_IF_ERROR(RunPass(k, Features(x, k * shard), Ints(y, k * shard), shard,
                                     grad_scale, group && last ? on_ready : nullptr,
                                     /*accumulate=*/false));
    if (!convert_status.ok()) return convert_status;
    if (converted < params) {
      LOCKSTEP_RETURN_IF_ERROR(to_fixed(converted, params));
    }
    LOCKSTEP_RETURN_IF_ERROR(kernels::cuda::AccumulateLossFixedPoint(
        model_->loss_sum_device(), grad_scale, frac_bits, loss, rejected, stream_));
  }
  if (group) {
    cursor.Finish();  // the rest, with the loss and the rejection count
    return buckets.status();
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> GpuStep::FixedPointGradient(const Batch& batch, int shard,
                                                                 float grad_scale, int frac_bits) {
  if (mirror_.upload_needed()) {
    return absl::FailedPreconditionError("GpuStep: FixedPointGradient before Begin");
  }
  if (batch.feature_stride != layout_.feature_stride ||
      (!layout_.labels() && batch.token_stride != layout_.token_stride)) {
    return absl::InvalidArgumentError("GpuStep: a batch in another layout than the engine's");
  }
  LOCKSTEP_RETURN_IF_ERROR(
      AccumulateFixedPoint(batch.features, layout_.labels() ? batch.labels : batch.tokens, batch.n,
                           shard, grad_scale, frac_bits, /*group=*/false));
  std::vector<int64_t> sum(model_->num_params() + 2);
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemcpyAsync(sum.data(), fixed_, sum.size() * sizeof(int64_t),
                                               cudaMemcpyDeviceToHost, stream_));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return sum;
}

absl::StatusOr<GpuStep::DeterministicResult> GpuStep::StepDeterministic(
    const float* x, const int32_t* y, int n, int shard, float grad_scale, int frac_bits, float lr,
    int64_t step) {
  updating_ = false;
  absl::StatusOr<DeterministicResult> result =
      RunDeterministic(x, y, n, shard, grad_scale, frac_bits, lr, step);
  if (!result.ok()) {
    state_unknown_ = state_unknown_ || updating_;
    AbortAfterFailure();
  }
  return result;
}

absl::StatusOr<GpuStep::DeterministicResult> GpuStep::RunDeterministic(
    const float* x, const int32_t* y, int n, int shard, float grad_scale, int frac_bits, float lr,
    int64_t step) {
  const size_t params = model_->num_params();
  const bool group = comm_ != nullptr && comm_->size() > 1;
  LOCKSTEP_RETURN_IF_ERROR(AccumulateFixedPoint(x, y, n, shard, grad_scale, frac_bits, group));
  if (group) {
    LOCKSTEP_RETURN_IF_ERROR(comm_->Wait());  // the watchdog
  }
  int64_t tail[2] = {0, 0};  // the group's loss and rejection count
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      cudaMemcpyAsync(tail, fixed_ + params, sizeof(tail), cudaMemcpyDeviceToHost, stream_));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  DeterministicResult result;
  result.loss = static_cast<double>(tail[0]) / std::ldexp(1.0, frac_bits);
  result.rejected = tail[1];
  if (result.rejected != 0) return result;  // no update: the trainer fails the step
  LOCKSTEP_RETURN_IF_ERROR(
      kernels::cuda::FromFixedPoint(fixed_, params, frac_bits, model_->grads(), stream_));
  updating_ = true;
  LOCKSTEP_RETURN_IF_ERROR(Update(lr, step));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return result;
}

}  // namespace lockstep::worker
