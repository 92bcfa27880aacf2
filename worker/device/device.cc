#include "worker/device/device.h"

#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/device/backend.h"

namespace lockstep::worker {
namespace {

// A /proc/meminfo field ("MemAvailable:", "MemTotal:") in bytes; 0 when absent.
int64_t MeminfoBytes(const std::string& field) {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  int64_t kib = 0;
  while (meminfo >> key >> kib >> unit) {
    if (key == field) return kib * 1024;
  }
  return 0;
}

}  // namespace

std::string GpuUuidString(const unsigned char (&bytes)[16]) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    out += kHex[bytes[i] >> 4];
    out += kHex[bytes[i] & 0xf];
  }
  return out;
}

absl::StatusOr<DeviceInfo> OpenDevice(const std::string& device) {
  DeviceInfo info;
  info.device = device;
  if (device == "cpu") {
    info.name = "cpu";
    info.free_memory_bytes = MeminfoBytes("MemAvailable:");
    info.total_memory_bytes = MeminfoBytes("MemTotal:");
    return info;
  }
  int index = -1;
  if (!absl::StartsWith(device, "cuda:") || !absl::SimpleAtoi(device.substr(5), &index) ||
      index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device=", device, ": expected cpu or cuda:N (N = 0, 1, ...)"));
  }
  info.cuda_index = index;
  LOCKSTEP_RETURN_IF_ERROR(OpenCudaDevice(info));
  return info;
}

}  // namespace lockstep::worker
