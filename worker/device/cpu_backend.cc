// The CPU's backend, and what every backend shares.
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/job_memory.h"
#include "glog/logging.h"
#include "worker/device/backend.h"

namespace lockstep::worker {

void SetMemoryBudget(Trainer& trainer, const v1::JobSpec& spec, const v1::Assignment& a,
                     int64_t free_bytes, int margin_percent) {
  trainer.set_memory_budget(free_bytes / 100 * (100 - margin_percent));
  const int64_t share = ShareSamples(spec, a.world_size());
  if (!spec.deterministic() && trainer.micro_batch() < share) {
    LOG(INFO) << a.job_id() << " generation " << a.generation() << ": micro-batches of "
              << trainer.micro_batch() << " samples with gradient accumulation ("
              << (spec.micro_batch_size() > 0
                      ? std::string("micro_batch_size")
                      : absl::StrCat("the share of ", share, " would need about ",
                                     HumanBytes(EstimateWorkerMemory(spec, share).total()), ", ",
                                     HumanBytes(free_bytes), " is free"))
              << ")";
  }
}

namespace {

class CpuBackend final : public DeviceBackend {
 public:
  explicit CpuBackend(DeviceInfo info) : info_(std::move(info)) {}

  const DeviceInfo& info() const override { return info_; }
  std::vector<std::string> capabilities() const override { return {}; }

  absl::StatusOr<std::unique_ptr<DeviceAttachment>> Attach(
      const v1::Assignment& a, Trainer& trainer, StoreClient& /*store*/,
      const std::shared_ptr<AbortSignal>& /*abort*/) override {
    // What the host has free now. The model is allocated by then, so this counts it twice: a
    // margin, on the safe side.
    if (absl::StatusOr<DeviceInfo> host = OpenDevice("cpu"); host.ok()) {
      SetMemoryBudget(trainer, a.spec(), a, host->free_memory_bytes, 10);
    }
    return std::make_unique<DeviceAttachment>();
  }

 private:
  const DeviceInfo info_;
};

}  // namespace

std::unique_ptr<DeviceBackend> MakeCpuBackend(DeviceInfo device) {
  return std::make_unique<CpuBackend>(std::move(device));
}

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeDeviceBackend(const DeviceInfo& device) {
  if (device.cuda_index >= 0) return MakeCudaBackend(device);
  return MakeCpuBackend(device);
}

}  // namespace lockstep::worker
