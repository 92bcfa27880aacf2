// Limits of the GPU kernels that a job spec must respect, in one place for the coordinator
// (which refuses a spec beyond them at submit) and the kernels (kernels/cuda_transformer.h);
// and what the coordinator needs to know of a GPU worker to place it.
// No dependencies: nvcc and the CPU-only coordinator both include it.
#pragma once

namespace lockstep {

// The most channels per attention head the GPU attention kernel takes (d_model / n_head): it
// keeps a head's query, key and value rows in per-thread arrays of this size.
inline constexpr int kMaxGpuAttentionHead = 128;

// Device memory a GPU worker holds whatever the micro-batch, counted by the memory estimate
// (common/job_memory.h):
//  - the cuBLASLt workspace the worker's matrix products get (kernels/cuda_kernels.cu), and as
//    much again for cuBLAS's own workspace pool (its default on Hopper);
inline constexpr long long kGpuBlasWorkspaceBytes = 32ll << 20;
//  - NCCL's buffers for a group of two or more: NCCL_BUFFSIZE (4 MiB) for sending and for
//    receiving on each of up to 32 channels. The worker logs what its communicator really took
//    ("NCCL took ... of device memory"), to check this by.
inline constexpr long long kGpuNcclBufferBytes = 2ll * 32 * (4ll << 20);
//  - the LM head's logits, at most this many values at once (worker/cuda/gpu_gpt.h).
inline constexpr long long kGpuHeadChunkValues = 1ll << 26;

// The registration capability of a GPU worker whose NCCL lets several ranks of one group use
// the same GPU (NCCL 2.30.3 or later, with NCCL_MULTI_RANK_GPU_ENABLE=1): the coordinator puts
// two ranks on one GPU only when every worker there has it.
inline constexpr char kSharedGpuCapability[] = "nccl-shared-gpu";

}  // namespace lockstep
