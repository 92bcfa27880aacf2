#!/usr/bin/env python3
"""PyTorch eager baseline for bench/gpu/mlp_step_bench.cc: the same MLP (ReLU), batch, SGD with
momentum 0.9 and softmax cross-entropy on one GPU, timed with CUDA events. Each step copies its
batch from pinned host memory (non_blocking, as a DataLoader with pin_memory feeds it), as the
Lockstep step does. Prints one JSON line.
Usage: gpu_mlp_step.py [--dims 784,8192,8192,10] [--batch 8192] [--steps 50] [--tf32]"""
import argparse
import json

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dims", default="784,8192,8192,10")
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--tf32", action="store_true")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    torch.backends.cudnn.allow_tf32 = a.tf32
    dims = [int(d) for d in a.dims.split(",")]
    layers = []
    for i in range(len(dims) - 1):
        layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i + 2 < len(dims):
            layers.append(torch.nn.ReLU())
    dev = torch.device("cuda:0")
    model = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x_host = torch.randn(a.batch, dims[0]).pin_memory()
    y_host = torch.randint(0, dims[-1], (a.batch,)).pin_memory()
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        x = x_host.to(dev, non_blocking=True)
        y = y_host.to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(5):
        step()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.steps):
        loss = step()
    stop.record()
    torch.cuda.synchronize()
    step_ms = start.elapsed_time(stop) / a.steps
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "precision": "tf32" if a.tf32 else "fp32",
                      "dims": a.dims, "batch": a.batch, "step_ms": step_ms,
                      "samples_per_second": a.batch / (step_ms / 1000), "torch": torch.__version__,
                      "final_loss": float(loss)}))


if __name__ == "__main__":
    main()
