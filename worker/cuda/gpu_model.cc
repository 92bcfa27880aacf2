#include "worker/cuda/gpu_model.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/device_memory.h"
#include "kernels/gpu_check.h"

namespace lockstep::worker {
namespace {

// The device model of each family (common/model_family.h); a new family adds its line.
struct DeviceFamily {
  const char* name;
  absl::StatusOr<std::unique_ptr<GpuModel>> (*create)(const v1::JobSpec& spec, const Model& host,
                                                      cudaStream_t stream);
};
constexpr DeviceFamily kDeviceFamilies[] = {{"mlp", CreateGpuMlp}, {"gpt", CreateGpuGpt}};

}  // namespace

absl::StatusOr<std::unique_ptr<GpuModel>> CreateGpuModel(const v1::JobSpec& spec,
                                                         const Model& host, cudaStream_t stream) {
  for (const DeviceFamily& family : kDeviceFamilies) {
    if (spec.model().type() == family.name) return family.create(spec, host, stream);
  }
  return absl::UnimplementedError(absl::StrCat("model.type \"", spec.model().type(),
                                               "\" does not train on GPU workers yet"));
}

GpuModel::~GpuModel() {
  kernels::cuda::DeviceFree(params_);
  kernels::cuda::DeviceFree(grads_);
  kernels::cuda::DeviceFree(loss_sum_);
}

absl::Status GpuModel::Init(size_t num_params, cudaStream_t stream) {
  num_params_ = num_params;
  stream_ = stream;
  absl::StatusOr<std::unique_ptr<kernels::cuda::Blas>> blas = kernels::cuda::Blas::Create(stream);
  if (!blas.ok()) return blas.status();
  blas_ = *std::move(blas);
  // At least one value each: a buffer of none is still a valid pointer.
  const size_t floats = std::max<size_t>(1, num_params);
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      kernels::cuda::DeviceMalloc(&params_, floats * sizeof(float)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      kernels::cuda::DeviceMalloc(&grads_, floats * sizeof(float)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      kernels::cuda::DeviceMalloc(&loss_sum_, sizeof(double)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemsetAsync(loss_sum_, 0, sizeof(double), stream));
  return absl::OkStatus();
}

absl::Status GpuModel::CopyAndWait(void* to, const void* from, size_t bytes,
                                   cudaMemcpyKind kind) const {
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemcpyAsync(to, from, bytes, kind, stream_));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status GpuModel::UploadParams(const float* host) {
  return CopyAndWait(params_, host, num_params_ * sizeof(float), cudaMemcpyHostToDevice);
}

absl::Status GpuModel::DownloadParams(float* host) const {
  return CopyAndWait(host, params_, num_params_ * sizeof(float), cudaMemcpyDeviceToHost);
}

absl::Status GpuModel::DownloadGrads(float* host) const {
  return CopyAndWait(host, grads_, num_params_ * sizeof(float), cudaMemcpyDeviceToHost);
}

absl::StatusOr<double> GpuModel::LossSum() {
  double value = 0;
  LOCKSTEP_RETURN_IF_ERROR(CopyAndWait(&value, loss_sum_, sizeof(double), cudaMemcpyDeviceToHost));
  return value;
}

}  // namespace lockstep::worker
