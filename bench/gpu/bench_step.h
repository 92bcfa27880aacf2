// What the GPU step benchmarks hand the worker's engine each step: n samples at once (or in
// micro-batches), the fixed-point range of deterministic mode over `shards` micro-shards, the
// mean over the batch. The learning rate and the step are the caller's.
#pragma once

#include <algorithm>

#include "worker/step/step_engine.h"

namespace lockstep::bench {

inline worker::StepArgs BenchStepArgs(int n, int micro_batch, bool deterministic, int shards) {
  worker::StepArgs args;
  args.n = n;
  args.micro_batch = micro_batch;
  args.deterministic = deterministic;
  args.micro_shard = n / std::max(1, shards);
  args.frac_bits = 40;
  args.grad_scale = 1.0f / n;
  return args;
}

}  // namespace lockstep::bench
