// The GPU benchmarks' yardstick: cuBLAS's rate on one large product, measured in the same run.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace lockstep::bench {

// cuBLAS's rate, in TFLOP/s, on one 8192^3 product in `precision` ("fp32", "tf32", or "bf16":
// bf16 operands with FP32 sums and output), after 3 warm-up products.
absl::StatusOr<double> GemmTflops(const std::string& precision);

}  // namespace lockstep::bench
