#!/usr/bin/env python3
"""PyTorch twin of bench/gpu/gpu_gpt_step_bench.cc: the same GPT-2 (pre-LayerNorm blocks, causal
attention, 4x MLP with tanh GELU, final LayerNorm, LM head tied to wte; GPT-2 124M's shape by
default), AdamW (betas 0.9/0.95, weight decay 0.1 on matrices, fused) with global-norm clipping
at 1.0, on synthetic tokens copied from pinned host memory each step, one GPU. Attention is
PyTorch's scaled_dot_product_attention (its flash kernel in bf16, the memory-efficient one in
fp32/tf32), the strongest eager choice.
Precisions: fp32, tf32 (TF32 matmuls), bf16 (autocast: bf16 products and activations, fp32
master weights and optimizer state). --compile runs the model through torch.compile.
Each step reads the loss back, as the Lockstep step does. Prints one JSON line.
Usage: gpu_gpt_step.py [--layers 12 --heads 12 --d_model 768 --context 1024 --vocab 50257]
                       [--batch 16] [--steps 10] [--precision fp32|tf32|bf16] [--compile]"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

H200_BF16_PEAK_TFLOPS = 989.4


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(c, eps=1e-5)
        self.c_attn = nn.Linear(c, 3 * c)
        self.attn_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c, eps=1e-5)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        hs = c // self.heads
        q, k, v = (z.view(b, t, self.heads, hs).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, context, layers, heads, c):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(context, c)
        self.h = nn.ModuleList([Block(c, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(c, eps=1e-5)
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif "ln_" in name:
                nn.init.ones_(p)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--d_model", type=int, default=768)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default="tf32")
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = a.precision != "fp32"
    torch.backends.cudnn.allow_tf32 = a.precision != "fp32"
    dev = torch.device("cuda:0")
    torch.manual_seed(1)
    model = GPT(a.vocab, a.context, a.layers, a.heads, a.d_model).to(dev)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "wte" not in n and "wpe" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "wte" not in n and "wpe" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    run = torch.compile(model) if a.compile else model
    windows = torch.randint(0, a.vocab, (a.batch, a.context + 1), dtype=torch.int64).pin_memory()

    def step():
        w = windows.to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            loss = run(w[:, :-1], w[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    first_loss = step()
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    step_ms = (time.perf_counter() - start) * 1e3 / a.steps
    tokens = a.batch * a.context
    flops_per_token = 6.0 * params + 12.0 * a.layers * a.d_model * a.context
    tflops = flops_per_token * tokens / (step_ms * 1e-3) / 1e12
    print(json.dumps({
        "framework": "pytorch " + torch.__version__ + (" compile" if a.compile else " eager"),
        "gpu": torch.cuda.get_device_name(0), "params": params, "precision": a.precision,
        "compile": a.compile, "batch": a.batch, "context": a.context, "step_ms": step_ms,
        "tokens_per_second": tokens / (step_ms * 1e-3), "model_tflops": tflops,
        "mfu": tflops / H200_BF16_PEAK_TFLOPS, "first_loss": first_loss, "last_loss": loss,
        "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20}))


if __name__ == "__main__":
    main()
