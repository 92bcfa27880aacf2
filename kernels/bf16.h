// bfloat16 values in device memory, for the headers of the CUDA kernels (which host code
// includes without CUDA's bf16 header): the bits of CUDA's __nv_bfloat16, rounded to nearest
// even from FP32. A type of its own, so an FP32 buffer and a bf16 one never mix unnoticed.
#ifndef LOCKSTEP_KERNELS_BF16_H_
#define LOCKSTEP_KERNELS_BF16_H_

#include <cstdint>

namespace lockstep::kernels::cuda {

struct Bf16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == 2, "the layout of __nv_bfloat16");

}  // namespace lockstep::kernels::cuda

#endif  // LOCKSTEP_KERNELS_BF16_H_
