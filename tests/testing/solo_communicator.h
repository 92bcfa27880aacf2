// A communicator for a group of one: every collective is the identity. For tests that train on
// a single rank without forming a Gloo group.
#pragma once

#include "worker/comm/communicator.h"

namespace lockstep::testing {

class SoloCommunicator final : public worker::Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  absl::Status AllreduceSum(float*, size_t) override { return absl::OkStatus(); }
  absl::Status AllreduceSum(double*, size_t) override { return absl::OkStatus(); }
  absl::Status AllreduceSum(int64_t*, size_t) override { return absl::OkStatus(); }
  absl::Status Broadcast(void*, size_t, int) override { return absl::OkStatus(); }
  absl::Status Barrier() override { return absl::OkStatus(); }
};

}  // namespace lockstep::testing
