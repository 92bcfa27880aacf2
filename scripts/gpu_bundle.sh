#!/usr/bin/env bash
# Builds the GPU parts for Hopper (sm_90; CUDA_ARCH=... for others) in build-gpu/ and packs
# what tests/gpu/check.sh needs into out/gpu-bundle.tar.xz: the GPU tests, the step benchmarks,
# the daemons, their non-system libraries (not CUDA's or NCCL's: the GPU host has its own), the
# check script and the PyTorch baselines. Copy it to a GPU host (or carry it to the device
# machine) and run: tar xJf gpu-bundle.tar.xz && gpu-bundle/check.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build-gpu"
out="$root/out"
export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1 CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/lockstep-ccache}"
"$root/scripts/install_deps.sh"
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOCKSTEP_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" >/dev/null
fi
targets=(cuda_kernels_test gpu_mlp_test gpu_gpt_test gpu_trainer_test nccl_communicator_test nccl_id_test mlp_step_bench gpu_gpt_step_bench attention_bench lockstep-coordinator lockstep-worker lockstepctl lockstep_python lockstep_checkpoint_native)
ninja -C "$build" -j "${LOCKSTEP_JOBS:-2}" "${targets[@]}"
rm -rf "$out/gpu-bundle" "$out/gpu-bundle.tar.xz"
binaries=()
for t in "${targets[@]}"; do [[ "$t" == lockstep_* ]] || binaries+=("$t"); done
LOCKSTEP_BUNDLE_SYSTEM_CUDA=1 "$root/scripts/bundle.sh" --build "$build" "$out/gpu-bundle" \
  "${binaries[@]}"
# Program jobs: the torchrun example and the lockstep package (lockstep.torch) it imports.
cp -r "$build/python" "$out/gpu-bundle/python"
# The checkpoint's native copy finds its libxxhash beside it (its RPATH is $ORIGIN): the GPU
# host may have neither it nor the xxhash module.
native="$build/python/lockstep/liblockstep_checkpoint.so"
cp -L "$(ldd "$native" | awk '$1 ~ /^libxxhash/ {print $3}')" "$out/gpu-bundle/python/lockstep/"
install -D -m 0644 "$root/examples/torch/train.py" "$out/gpu-bundle/examples/torch/train.py"
install -m 0755 "$root/tests/gpu/check.sh" "$out/gpu-bundle/check.sh"
install -m 0644 "$root/tests/gpu/gpu_checkpoint.py" "$out/gpu-bundle/gpu_checkpoint.py"
install -m 0644 "$root/bench/torch/gpu_mlp_step.py" "$out/gpu-bundle/gpu_mlp_step.py"
install -m 0644 "$root/bench/torch/gpu_gpt_step.py" "$out/gpu-bundle/gpu_gpt_step.py"
install -m 0644 "$root/bench/torch/gpu_attention.py" "$out/gpu-bundle/gpu_attention.py"
tar -C "$out" -cJf "$out/gpu-bundle.tar.xz" gpu-bundle
echo "gpu_bundle.sh: $out/gpu-bundle.tar.xz ($(du -h "$out/gpu-bundle.tar.xz" | cut -f1))"
