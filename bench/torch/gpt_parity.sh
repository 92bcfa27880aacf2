#!/usr/bin/env bash
# Parity of Lockstep's GPT with PyTorch. Lockstep writes the initial weights of the job in
# tests/fixtures/gpt_parity/spec.json (bench/gpt_init_export); the PyTorch twin loads them and
# trains the same batches (one process) and writes its per-step losses to
# tests/fixtures/gpt_parity/torch_losses.json; then gpt_parity_test trains the job in Lockstep and
# checks every step's loss against those to 1e-4 relative. CI runs only the last part, on the
# committed fixture. Usage: bench/torch/gpt_parity.sh [BUILD_DIR]   (needs python3-torch)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:-${LOCKSTEP_BUILD_DIR:-$root/build}}"
fixture="$root/tests/fixtures/gpt_parity"
cmake --build "$build" --target gpt_init_export gpt_parity_test
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$build/bench/gpt_init_export" --spec="$fixture/spec.json" --out="$tmp"
OMP_NUM_THREADS=1 /usr/bin/python3 "$root/bench/torch/train_gpt.py" --spec "$fixture/spec.json" \
  --init_safetensors "$tmp/model.safetensors" --no_eval --losses_out "$fixture/torch_losses.json" \
  | grep -v '^RESULT'
"$build/tests/gpt_parity_test"
