#!/usr/bin/env python3
"""PyTorch twin of bench/gpu/attention_bench.cc: causal scaled_dot_product_attention alone on
bf16 q/k/v of shape (batch, heads, context, head_size) (its flash kernel), forward and forward +
backward, timed with CUDA events. TFLOP/s as FlashAttention's benchmark counts them (forward
4 B H T^2 hs / 2 for the causal half, backward 2.5 times that). Prints one JSON line.
Usage: gpu_attention.py [--batch 16 --heads 12 --head_size 64 --context 1024] [--iters 20]"""
import argparse
import json

import torch
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head_size", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    shape = (a.batch, a.heads, a.context, a.head_size)
    torch.manual_seed(7)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def run(backward):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for i in range(3 + a.iters):
            if i == 3:
                start.record()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if backward:
                out.backward(dout)
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / a.iters

    forward = run(False)
    backward = run(True) - forward
    forward_flops = 4.0 * a.batch * a.heads * a.context ** 2 * a.head_size / 2
    print(json.dumps({
        "gpu": torch.cuda.get_device_name(), "batch": a.batch, "heads": a.heads,
        "head_size": a.head_size, "context": a.context, "torch": torch.__version__,
        "forward_ms": forward, "backward_ms": backward,
        "forward_tflops": forward_flops / (forward * 1e-3) / 1e12,
        "backward_tflops": 2.5 * forward_flops / (backward * 1e-3) / 1e12}))


if __name__ == "__main__":
    main()
