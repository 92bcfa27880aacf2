// The GPU's backend: the steps run on the GPU (worker/cuda's GpuStep) and sum over NCCL,
// formed through the generation's store under its own key; Gloo stays for the host's part of
// healing, evaluation and the small agreements. The trainer keeps its GPU step (and the
// device's copy of the state) across generations; each generation's NCCL communicator is the
// attachment's, and reaches the step through the trainer where it heals and begins. The
// worker's one CUDA file outside worker/cuda (CMake compiles device/no_cuda.cc without CUDA).
#include <cstring>
#include <string_view>
#include <utility>

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "common/gpu_limits.h"
#include "common/job_memory.h"
#include "glog/logging.h"
#include "kernels/device_memory.h"
#include "kernels/gpu_check.h"
#include "worker/cuda/nccl_communicator.h"
#include "worker/device/backend.h"
#include "worker/cuda/gpu_step.h"

namespace lockstep::worker {

absl::Status OpenCudaDevice(DeviceInfo& info) {
  const std::string& device = info.device;
  const int index = info.cuda_index;
  // cudaGetDeviceCount creates no context; cudaSetDevice makes N the device of every later
  // runtime call in this process, before anything else touches the GPU.
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--device=", device, ": no usable CUDA driver on this host (", cudaGetErrorString(e), ")"));
  }
  if (count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device=", device, ": this host has no GPU"));
  }
  if (index >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device=", device, ": this host has ", count, count == 1 ? " GPU" : " GPUs",
                     " (cuda:0", count == 1 ? "" : absl::StrCat(" to cuda:", count - 1), ")"));
  }
  if (cudaError_t e = cudaSetDevice(index); e != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device=", device, ": cannot select it (", cudaGetErrorString(e), ")"));
  }
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaError_t e = cudaMemGetInfo(&free_bytes, &total_bytes); e != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--device=", device, ": cannot create a context on it (", cudaGetErrorString(e), ")"));
  }
  cudaDeviceProp props{};
  if (cudaGetDeviceProperties(&props, index) == cudaSuccess) {
    info.name = props.name;
    unsigned char uuid[16];
    static_assert(sizeof(props.uuid.bytes) == sizeof(uuid));
    std::memcpy(uuid, props.uuid.bytes, sizeof(uuid));
    info.uuid = GpuUuidString(uuid);
  }
  info.free_memory_bytes = static_cast<int64_t>(free_bytes);
  info.total_memory_bytes = static_cast<int64_t>(total_bytes);
  return absl::OkStatus();
}

namespace {

// The generation's NCCL communicator (none for a group of one).
class CudaAttachment final : public DeviceAttachment {
 public:
  explicit CudaAttachment(std::unique_ptr<NcclCommunicator> nccl) : nccl_(std::move(nccl)) {}
  DeviceGroup* group() override { return nccl_.get(); }

 private:
  std::unique_ptr<NcclCommunicator> nccl_;
};

class CudaBackend final : public DeviceBackend {
 public:
  explicit CudaBackend(DeviceInfo info) : info_(std::move(info)) {}

  const DeviceInfo& info() const override { return info_; }

  absl::Status SelectAndMeasure(size_t* free_bytes, size_t* total_bytes) const {
    LOCKSTEP_GPU_RETURN_IF_ERROR(cudaSetDevice(info_.cuda_index));
    LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemGetInfo(free_bytes, total_bytes));
    return absl::OkStatus();
  }

  std::vector<std::string> capabilities() const override {
    // The coordinator puts another rank of a group on this GPU only when NCCL lets it.
    if (NcclSharedGpuAllowed()) return {kSharedGpuCapability};
    return {};
  }

  absl::StatusOr<std::unique_ptr<DeviceAttachment>> Attach(
      const v1::Assignment& a, Trainer& trainer, StoreClient& store,
      const std::shared_ptr<AbortSignal>& abort) override {
    const v1::JobSpec& spec = a.spec();
    // The current device is per host thread: the generation's thread must select it itself,
    // or its first CUDA call would create a context on GPU 0. Measured before this generation
    // allocates anything: the estimate counts it all. Ranks that share the GPU (tests) share
    // what is free: the ones that allocated first are counted in it already, so this is on the
    // safe side. A device that is busy or short of memory now (another process holds it, a
    // dropped job's state is being freed) ends this generation only (UNAVAILABLE).
    size_t free_bytes = 0, total_bytes = 0;
    if (absl::Status s = SelectAndMeasure(&free_bytes, &total_bytes); !s.ok()) {
      return absl::UnavailableError(s.message());
    }
    // A step kept from an earlier generation holds its memory already, and reuses it: the
    // budget is what is free plus what this worker holds (the kept step's; the last
    // generation's communicator is gone, and a dropped job's state is being freed).
    const int64_t held = kernels::cuda::DeviceBytesInUse();
    const int64_t sharing = std::max<int32_t>(1, a.ranks_on_device());
    if (sharing > 1) {
      LOG(INFO) << a.job_id() << " generation " << a.generation() << ": " << sharing
                << " ranks share this GPU; budgeting 1/" << sharing << " of its "
                << HumanBytes(static_cast<int64_t>(free_bytes)) << " free";
    }
    SetMemoryBudget(trainer, spec, a, static_cast<int64_t>(free_bytes) / sharing + held, 3);
    std::unique_ptr<NcclCommunicator> nccl;
    if (a.world_size() > 1) {
      const absl::Duration timeout = absl::Milliseconds(spec.collective_timeout_ms());
      NcclCommunicator::Options nccl_options;
      nccl_options.init_timeout = timeout;
      nccl_options.collective_timeout = timeout;
      nccl_options.abort = abort;
      // FAILED_PRECONDITION (fatal) for several ranks on one GPU that NCCL refuses: no new
      // generation would fare better.
      absl::StatusOr<std::unique_ptr<NcclCommunicator>> created =
          NcclCommunicator::Create(store, a.rank(), a.world_size(), nccl_options);
      if (!created.ok()) return created.status();
      nccl = *std::move(created);
      // What the memory estimate assumes for NCCL (kGpuNcclBufferBytes), against what its
      // init took (NCCL connects lazily: the buffers of its connections come with the first
      // collectives, on top; on a GPU shared with other ranks their allocations count too).
      size_t free_after = 0;
      if (cudaMemGetInfo(&free_after, &total_bytes) == cudaSuccess && free_after <= free_bytes) {
        LOG(INFO) << a.job_id() << " generation " << a.generation() << ": NCCL's init took "
                  << HumanBytes(static_cast<int64_t>(free_bytes - free_after))
                  << " of device memory for " << a.world_size() << " ranks (estimated "
                  << HumanBytes(kGpuNcclBufferBytes) << " with its connections)";
      }
    }
    // The trainer keeps its GPU step across generations (and the device's copy of the state
    // with it); a new trainer gets one.
    if (std::string_view(trainer.engine().device()) != "cuda") {
      // UNIMPLEMENTED or INVALID_ARGUMENT (fatal) for a model or mode the GPU does not train.
      absl::StatusOr<std::unique_ptr<GpuStep>> created = GpuStep::Create(
          spec, trainer.sample_layout(), &trainer.model(), &trainer.optimizer());
      if (!created.ok()) return created.status();
      trainer.set_engine(*std::move(created));
    }
    return std::make_unique<CudaAttachment>(std::move(nccl));
  }

 private:
  const DeviceInfo info_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeCudaBackend(DeviceInfo device) {
  return std::make_unique<CudaBackend>(std::move(device));
}

}  // namespace lockstep::worker
