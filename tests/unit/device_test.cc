// The worker's device flag: what it accepts, the errors it gives, and the GPU UUID it reports
// for placement.
#include "worker/device/device.h"

#include "gtest/gtest.h"

namespace lockstep::worker {
namespace {

TEST(DeviceTest, GpuUuidIsWrittenAsNvidiaSmiWritesIt) {
  const unsigned char bytes[16] = {0x8a, 0x5d, 0x3e, 0x1f, 0x00, 0x01, 0xab, 0xcd,
                                   0xef, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0xff};
  EXPECT_EQ(GpuUuidString(bytes), "GPU-8a5d3e1f-0001-abcd-ef10-2030405060ff");
  const unsigned char zeros[16] = {};
  EXPECT_EQ(GpuUuidString(zeros), "GPU-00000000-0000-0000-0000-000000000000");
}

TEST(DeviceTest, CpuHasNoUuidAndMalformedFlagsNameTheProblem) {
  absl::StatusOr<DeviceInfo> cpu = OpenDevice("cpu");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->name, "cpu");
  EXPECT_TRUE(cpu->uuid.empty());
  EXPECT_GT(cpu->total_memory_bytes, 0);
  for (const char* bad : {"gpu0", "cuda:", "cuda:-1", "cuda:x"}) {
    absl::StatusOr<DeviceInfo> refused = OpenDevice(bad);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(refused.status().message().find("expected cpu or cuda:N"), std::string::npos)
        << refused.status();
  }
}

}  // namespace
}  // namespace lockstep::worker
