"""lockstep.torch.Checkpointer with CUDA tensors, as a one-worker program job (tests/gpu/check.sh).

Generation 1 trains a small model on the GPU, saves step 5 with blocking=False, at once runs
another step (it changes every parameter and Adam moment while the device-to-host copy may
still be in flight), waits for the save's commit, writes the digest of the state at step 5 and
exits with code 3: the group restarts. Generation 2 loads: it must get step 5 with exactly that
digest, and trains on from it (the optimizer's state on the GPU again). Prints
`gpu-checkpoint: ok ...` or `gpu-checkpoint: MISMATCH ...`, and exits non-zero on a mismatch.
On a machine without CUDA it runs the same on the CPU (a check of the script itself).
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
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256),
                      nn.BatchNorm1d(256)).to(device)
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
    x = torch.randn(64, 256, device=device)
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
    handle = ckpt.save(5, model, opt, blocking=False)
    step()  # the next step's kernels, queued behind the save's copies
    handle.wait()
    with open(expected_path + ".tmp", "w") as f:
        f.write(expected)
    os.rename(expected_path + ".tmp", expected_path)
    print(f"gpu-checkpoint: saved step 5 on {device} with blocking=False", flush=True)
    sys.exit(3)  # a failure: the group restarts and restores step 5
got = digest()
with open(expected_path) as f:
    expected = f.read()
state_devices = {t.device.type for s in opt.state.values() for t in s.values() if torch.is_tensor(t)}
step()  # trains on from the restored state
if start == 5 and got == expected:
    print(f"gpu-checkpoint: ok: restored step {start} on {device}, the digest saved "
          f"(optimizer state on {sorted(state_devices)})", flush=True)
else:
    print(f"gpu-checkpoint: MISMATCH: restored step {start}, digest {got[:16]} against "
          f"{expected[:16]}", flush=True)
    sys.exit(1)
