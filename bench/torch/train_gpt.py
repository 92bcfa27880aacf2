#!/usr/bin/python3
"""PyTorch twin of Lockstep's GPT job, for the benchmark and the parity check.

The same job as a Lockstep spec with model.type "gpt" on "text" data:
  - data: byte-level text, read as Lockstep reads a text directory (regular files that are not
    links, UTF-8 without NUL bytes, in name order, concatenated), the last validation_fraction
    held out; a sample is a window of context + 1 bytes at a stride of context;
  - data order: Lockstep's sampler, bit for bit (epoch e is a Fisher-Yates permutation from
    SplitMix64 seeded by MixSeed(seed, e); step s takes positions [s*B, (s+1)*B)); rank r of W
    takes the contiguous slice [r*B/W, (r+1)*B/W) of each step's batch;
  - model: GPT-2 (pre-LayerNorm blocks, causal attention, 4x MLP with tanh GELU, final LayerNorm,
    LM head tied to wte), tensors under Hugging Face's names and layouts (Conv1D: [in, out]);
    initialised like GPT-2 (N(0, 0.02), residual projections / sqrt(2 n_layer)) with torch's
    generator, or loaded from a Lockstep export (--init_safetensors) for the parity check;
  - optimizer: AdamW, weight decay on matrices only (not biases, LayerNorm, or embeddings unless
    --decay_embeddings), linear warm-up then cosine to 0 (Lockstep's schedule), gradient clipping
    by global norm after DDP's sum.
DDP under torchrun (Gloo, one thread per process); also runs as one plain process.

Prints, rank 0 only: "STEP <step> <unix_ms> <loss>" per step and "RESULT {json}" at the end
(tokens/s from the end of the first step to the end of the last, the validation loss, and the
per-step losses).
"""

import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

MASK64 = (1 << 64) - 1


class SplitMix64:
    def __init__(self, seed):
        self.state = seed & MASK64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, bound):
        return (self.next() * bound) >> 64


def mix_seed(a, b):
    r = SplitMix64(a ^ ((b * 0xD6E8FEB86659FD93 + 0x632BE59BD9B4E019) & MASK64))
    r.next()
    return r.next()


def epoch_permutation(seed, epoch, n):
    perm = list(range(n))
    rng = SplitMix64(mix_seed(seed, epoch))
    for i in range(n - 1, 0, -1):
        j = rng.below(i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def read_text(path):
    """Lockstep's reading of a text source (a file, or a directory's text files)."""
    if os.path.isfile(path):
        return open(path, "rb").read()
    out = []
    for name in sorted(os.listdir(path), key=lambda s: s.encode()):
        full = os.path.join(path, name)
        if os.path.islink(full) or not os.path.isfile(full):
            continue
        data = open(full, "rb").read()
        if b"\0" in data:
            continue
        try:
            data.decode("utf-8", errors="strict")
        except UnicodeDecodeError:
            continue
        out.append(data)
    return b"".join(out)


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(c, eps=1e-5)
        self.ln_2 = nn.LayerNorm(c, eps=1e-5)
        self.attn = nn.Module()
        self.attn.c_attn = Conv1D(c, 3 * c)
        self.attn.c_proj = Conv1D(c, c)
        self.mlp = nn.Module()
        self.mlp.c_fc = Conv1D(c, 4 * c)
        self.mlp.c_proj = Conv1D(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(c, dim=2)
        hs = c // self.heads
        q = q.view(b, t, self.heads, hs).transpose(1, 2)
        k = k.view(b, t, self.heads, hs).transpose(1, 2)
        v = v.view(b, t, self.heads, hs).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.attn.c_proj(y)
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight [in, out], y = x @ W + b."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], self.weight.shape[1])


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
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(t))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


def load_safetensors(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", info
        begin, end = info["data_offsets"]
        arr = np.frombuffer(data[begin:end], dtype="<f4").reshape(info["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return out


def apply_spec(args, path):
    """Sets the job's arguments from a Lockstep JobSpec in protobuf's JSON mapping."""
    spec = json.load(open(path))
    model, data, opt = spec["model"], spec["dataset"], spec.get("optimizer", {})
    if model.get("type", "gpt" if "gpt" in model else "") != "gpt" or data.get("type") != "text":
        raise SystemExit(f"{path}: the twin trains model type gpt on text data")
    # The family's fields are in model.gpt (or, in the form before it, beside model.type).
    model = model.get("gpt", model)
    args.vocab, args.context = model["vocabSize"], model["contextLength"]
    args.layers, args.heads, args.d_model = model["nLayer"], model["nHead"], model["dModel"]
    args.data = os.path.join(os.path.dirname(os.path.abspath(path)), data["path"])
    args.validation_fraction = data.get("validationFraction", 0.05)
    args.lr = opt["learningRate"]
    args.beta2 = opt.get("beta2", 0.999)
    args.weight_decay = opt.get("weightDecay", 0.0)
    args.decay_embeddings = opt.get("decayEmbeddings", False)
    args.warmup_steps = int(opt.get("warmupSteps", 0))
    args.cosine = 1 if opt.get("cosineDecay") else 0
    args.grad_clip = opt.get("gradClipNorm", 0.0)
    if opt.get("beta1", 0.9) != 0.9 or opt.get("epsilon", 1e-8) != 1e-8:
        raise SystemExit(f"{path}: the twin uses beta1 0.9 and epsilon 1e-8")
    args.batch = int(spec["globalBatchSize"])
    args.steps = int(spec["maxSteps"])
    args.seed = int(spec.get("seed", 0))


def learning_rate(args, step, total):
    if args.warmup_steps > 0 and step <= args.warmup_steps:
        return args.lr * step / args.warmup_steps
    if not args.cosine or total <= args.warmup_steps:
        return args.lr
    progress = (step - args.warmup_steps) / (total - args.warmup_steps)
    return 0.5 * args.lr * (1.0 + math.cos(math.pi * min(1.0, progress)))


def windows(tokens, context):
    return (len(tokens) - 1) // context if len(tokens) > context else 0


def batch_of(tokens, indices, context):
    rows = [tokens[w * context: w * context + context + 1] for w in indices]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def evaluate(model, valid, context, rank, world):
    total = windows(valid, context)
    begin, end = total * rank // world, total * (rank + 1) // world
    loss_sum = 0.0
    with torch.no_grad():
        for i in range(begin, end, 256):
            idx = list(range(i, min(end, i + 256)))
            x = batch_of(valid, idx, context)
            logits = model(x[:, :-1])
            per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                        x[:, 1:].reshape(-1), reduction="none")
            loss_sum += per_token.view(len(idx), context).mean(1).double().sum().item()
    t = torch.tensor([loss_sum, float(end - begin)], dtype=torch.float64)
    dist.all_reduce(t)
    return t[0].item() / t[1].item(), int(t[1].item())


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="/usr/share/games/fortunes")
    p.add_argument("--validation_fraction", type=float, default=0.05)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--batch", type=int, default=64, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--decay_embeddings", action="store_true")
    p.add_argument("--warmup_steps", type=int, default=30)
    p.add_argument("--cosine", type=int, default=1)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--init_safetensors", default="",
                   help="start from these weights (a Lockstep export) instead of torch's init")
    p.add_argument("--no_eval", action="store_true")
    p.add_argument("--spec", default="",
                   help="take the job from a Lockstep job spec (JSON) instead of the flags above; "
                        "a relative dataset path is relative to the spec's directory")
    p.add_argument("--losses_out", default="", help="write the per-step losses here (JSON)")
    args = p.parse_args()
    if args.spec:
        apply_spec(args, args.spec)
    torch.set_num_threads(1)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29581"))
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world != 0:
        raise SystemExit(f"batch {args.batch} is not divisible by {world} processes")

    text = np.frombuffer(read_text(args.data), dtype=np.uint8)
    held_out = int(math.floor(len(text) * args.validation_fraction + 0.5))
    train, valid = text[:len(text) - held_out], text[len(text) - held_out:]
    samples = windows(train, args.context)
    steps_per_epoch = samples // args.batch

    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.context, args.layers, args.heads, args.d_model)
    if args.init_safetensors:
        weights = load_safetensors(args.init_safetensors)
        state = {name: weights[name] for name, _ in model.named_parameters()}
        model.load_state_dict(state, strict=True)
    decay = [p for n, p in model.named_parameters()
             if p.dim() >= 2 and (args.decay_embeddings or not n.startswith(("wte", "wpe")))]
    no_decay = [p for n, p in model.named_parameters()
                if not (p.dim() >= 2 and (args.decay_embeddings or not n.startswith(("wte", "wpe"))))]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, args.beta2), eps=1e-8)
    ddp = DDP(model)

    local = args.batch // world
    losses = []
    perm_epoch, perm = -1, None
    first_end = None
    for step in range(1, args.steps + 1):
        epoch, in_epoch = (step - 1) // steps_per_epoch, (step - 1) % steps_per_epoch
        if epoch != perm_epoch:
            perm, perm_epoch = epoch_permutation(args.seed, epoch, samples), epoch
        begin = in_epoch * args.batch + rank * local
        x = batch_of(train, perm[begin:begin + local], args.context)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args, step, args.steps)
        logits = ddp(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), x[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if step == 1:
            first_end = time.time()
        if rank == 0:
            sys.stdout.write(f"STEP {step} {int(time.time() * 1000)} {losses[-1]:.6f}\n")
            sys.stdout.flush()
    elapsed = time.time() - first_end
    tokens_per_second = (args.steps - 1) * args.batch * args.context / elapsed if elapsed > 0 else 0
    result = {"world": world, "steps": args.steps, "tokens_per_second": tokens_per_second,
              "losses": losses}
    if not args.no_eval:
        result["validation_loss"], result["validation_windows"] = evaluate(
            model, valid, args.context, rank, world)
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump({"losses": losses, "steps": args.steps, "world": world,
                           "torch": torch.__version__}, f, indent=1)
                f.write("\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
