"""lockstep.torch.Checkpointer with CUDA tensors, as a one-worker program job (tests/gpu/check.sh).

Generation 1 trains a model of about 400 MB of state (parameters and Adam's moments) on the
GPU, zeroes the state, queues a second of GPU work (torch.cuda._sleep) and the state's
restoration, saves step 5 with blocking=False, and at once adds 1 to every parameter and moment
in place and runs another step: the save's copies must wait for the work queued before it (or
they read zeros), and the work queued after must wait for the copies (or it races them). It
waits for the save's commit, writes the digest of the state at step 5 and exits with code 3:
the group restarts. Generation 2 loads: it must get step 5 with exactly that digest, its
optimizer's moments and a tensor of `extra` on the GPU again, and trains on from it. Prints
`gpu-checkpoint: ok ...` or `gpu-checkpoint: MISMATCH ...`, and exits with code 4 on a
mismatch (check.sh makes it fatal: no restart). On a machine without CUDA it runs the same on the CPU, smaller (a check of the
script itself).
Usage: gpu_checkpoint.py OUT_DIR
"""
import hashlib
import os
import sys

import torch
import torch.nn as nn

import lockstep.torch as lt

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
expected_path = os.path.join(out, "gpu-checkpoint.expected")
device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
torch.manual_seed(0)
WIDTH = 2048 if device.type == "cuda" else 256
LAYERS = 8 if device.type == "cuda" else 2
model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)],
                      nn.BatchNorm1d(WIDTH)).to(device)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)


def digest():
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().numpy().tobytes())
    for state in opt.state_dict()["state"].values():
        for k in sorted(state):
            if torch.is_tensor(state[k]):
                h.update(state[k].detach().cpu().numpy().tobytes())
    return h.hexdigest()


def step():
    x = torch.randn(64, WIDTH, device=device)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


ckpt = lt.Checkpointer()
start = ckpt.load(model, opt)
if start is None:
    for _ in range(5):
        step()
    expected = digest()
    moments = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    tensors = list(model.parameters()) + moments
    if device.type == "cuda":
        # The state still being written when save is called: zeroed, about a second of GPU
        # work, then written back, all queued on the current stream (the save's copies must
        # wait for it, or they read zeros).
        with torch.no_grad():
            kept = [t.clone() for t in tensors]
            torch._foreach_zero_(tensors)
            torch.cuda._sleep(2_000_000_000)
            for t, k in zip(tensors, kept):
                t.copy_(k)
    ema = torch.arange(1000.0, device=device)
    handle = ckpt.save(5, model, opt, extra={"ema": ema}, blocking=False)
    with torch.no_grad():  # queued behind the save's copies, or it races them
        torch._foreach_add_(tensors, 1.0)
    step()
    handle.wait()
    with open(expected_path + ".tmp", "w") as f:
        f.write(expected)
    os.rename(expected_path + ".tmp", expected_path)
    print(f"gpu-checkpoint: saved step 5 on {device} with blocking=False", flush=True)
    sys.exit(3)  # a failure: the group restarts and restores step 5
got = digest()
with open(expected_path) as f:
    expected = f.read()
state_devices = {t.device.type for s in opt.state.values() for k, t in s.items()
                 if torch.is_tensor(t) and k != "step"}
ema = (ckpt.extra or {}).get("ema")
ema_ok = torch.is_tensor(ema) and ema.device == device and \
    torch.equal(ema.cpu(), torch.arange(1000.0))
step()  # trains on from the restored state
if start == 5 and got == expected and state_devices == {device.type} and ema_ok:
    print(f"gpu-checkpoint: ok: restored step {start} on {device}, the digest saved "
          f"(optimizer state on {sorted(state_devices)}, extra's tensor on {ema.device})",
          flush=True)
else:
    print(f"gpu-checkpoint: MISMATCH: restored step {start}, digest {got[:16]} against "
          f"{expected[:16]}, moments on {sorted(state_devices)}, extra's tensor "
          f"{'on ' + str(ema.device) if torch.is_tensor(ema) else 'missing'} "
          f"({'same' if ema_ok else 'not the one saved'})", flush=True)
    sys.exit(4)  # fatal (check.sh's spec): a restart would load the same step again
