#!/usr/bin/env bash
# The GPU check, for a host with NVIDIA GPUs and no network (scripts/gpu_bundle.sh makes the
# bundle it runs from): the GPU tests, then the GPU training-step benchmark next to PyTorch
# eager on the same GPU, as a table. Exit status: 0 when every GPU test passed (none skipped).
#   check.sh [BUNDLE_DIR]   (default: the folder holding this script, i.e. gpu-bundle/)
# Writes gpu-check.json and gpu-check.log to $OUT (default: the current directory).
set -uo pipefail
bundle="${1:-$(dirname "$(readlink -f "$0")")}"
out="${OUT:-$PWD}"
mkdir -p "$out"
log="$out/gpu-check.log"
: >"$log"

# CUDA, cuBLAS and NCCL come from the host: its CUDA install, else PyTorch's nvidia wheels.
dirs=()
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  [[ -d "$d" ]] && dirs+=("$d")
done
while read -r d; do [[ -n "$d" ]] && dirs+=("$d"); done < <(python3 -c '
import glob, os
try:
    import nvidia
    for p in nvidia.__path__:
        print("\n".join(glob.glob(os.path.join(p, "*", "lib"))))
except Exception:
    pass' 2>/dev/null)
export LD_LIBRARY_PATH="$(IFS=:; echo "${dirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

echo "== GPUs" | tee -a "$log"
(nvidia-smi -L || echo "nvidia-smi not found") 2>&1 | tee -a "$log"

echo "== GPU tests" | tee -a "$log"
failed=0
for t in cuda_kernels_test gpu_mlp_test gpu_gpt_test gpu_trainer_test nccl_communicator_test; do
  if ! "$bundle/bin/$t" >>"$log" 2>&1; then
    echo "FAILED: $t (see $log)" | tee -a "$log"
    failed=1
  elif grep -q "SKIPPED" <(tail -n 20 "$log"); then
    echo "SKIPPED on a GPU host: $t (see $log)" | tee -a "$log"
    failed=1
  else
    echo "passed: $t" | tee -a "$log"
  fi
done

echo "== a job on a GPU worker: coordinator, lockstep-worker --device=cuda:0, lockstepctl" | tee -a "$log"
job_dir="$(mktemp -d)"
"$bundle/bin/lockstep-coordinator" --listen=127.0.0.1:0 --port_file="$job_dir/port" \
  --state_dir="$job_dir/state" >"$job_dir/coordinator.log" 2>&1 &
coordinator_pid=$!
for _ in $(seq 1 100); do [[ -s "$job_dir/port" ]] && break; sleep 0.1; done
address="127.0.0.1:$(cat "$job_dir/port" 2>/dev/null)"
"$bundle/bin/lockstep-worker" --coordinator="$address" --device=cuda:0 --name=gpu0 \
  --give_up_after=30s >"$job_dir/worker.log" 2>&1 &
worker_pid=$!
# job-1: the default mode with gradient accumulation (micro-batches of 256); job-2:
# deterministic mode with TF32 products.
cat >"$job_dir/job-1.json" <<'JOB'
{"name": "gpu-check", "model": {"type": "mlp", "hiddenWidths": [2048, 2048]},
 "dataset": {"type": "synthetic", "synthetic": {"trainSamples": 65536, "testSamples": 4096,
             "inputDim": 784, "numClasses": 10, "seed": 1}},
 "optimizer": {"type": "sgd", "learningRate": 0.05, "momentum": 0.9},
 "globalBatchSize": 1024, "microShards": 8, "microBatchSize": 256, "maxSteps": 300,
 "minWorkers": 1, "maxWorkers": 1, "device": "cuda"}
JOB
sed -e 's/"gpu-check"/"gpu-check-deterministic"/' -e 's/"microBatchSize": 256/"deterministic": true/' \
  -e 's/"device": "cuda"/"device": "cuda", "precision": "tf32"/' "$job_dir/job-1.json" >"$job_dir/job-2.json"
registered=0
for _ in $(seq 1 60); do
  kill -0 "$worker_pid" 2>/dev/null || break
  if "$bundle/bin/lockstepctl" --coordinator="$address" workers 2>/dev/null | grep -q " gpu0 "; then
    registered=1
    break
  fi
  sleep 0.5
done
if ((registered == 0)); then
  echo "FAILED: the GPU worker did not register:" | tee -a "$log"
  tail -n 5 "$job_dir/worker.log" | tee -a "$log"
  failed=1
else
  for job in job-1 job-2; do
    if timeout 300 "$bundle/bin/lockstepctl" --coordinator="$address" submit "$job_dir/$job.json" \
        --watch >"$job_dir/watch-$job.log" 2>&1; then
      tail -n 3 "$job_dir/watch-$job.log" | tee -a "$log"
      # submit prints the job's id (job-N-CLUSTER) on its first line.
      job_id="$(head -n 1 "$job_dir/watch-$job.log")"
      "$bundle/bin/lockstepctl" --coordinator="$address" status "$job_id" | tee -a "$log"
      echo "passed: GPU worker $job" | tee -a "$log"
    else
      echo "FAILED: GPU worker $job" | tee -a "$log"
      tail -n 20 "$job_dir/watch-$job.log" "$job_dir/worker.log" "$job_dir/coordinator.log" | tee -a "$log"
      failed=1
    fi
  done
  grep -E "micro-batches|finished at step|per step" "$job_dir/worker.log" | tee -a "$log"
fi
kill "$worker_pid" "$coordinator_pid" 2>/dev/null
wait 2>/dev/null

echo "== step benchmark: MLP 784-8192-8192-10, batch 8192, SGD momentum" | tee -a "$log"
# name, Lockstep flags, the PyTorch run it is compared with
configs=(
  "fp32|--micro_batch=0|fp32"
  "tf32|--tf32|tf32"
  "fp32-accumulate|--micro_batch=2048|fp32"
  "fp32-deterministic|--deterministic --micro_shards=8|fp32"
  "tf32-deterministic|--tf32 --deterministic --micro_shards=8|tf32"
)
for precision in fp32 tf32; do
  flag=""
  [[ "$precision" == tf32 ]] && flag="--tf32"
  python3 "$bundle/gpu_mlp_step.py" $flag >"$out/torch-$precision.json" 2>>"$log" ||
    echo "PyTorch baseline failed ($precision; see $log)" | tee -a "$log"
done
for config in "${configs[@]}"; do
  IFS='|' read -r name flags _ <<<"$config"
  # shellcheck disable=SC2086
  "$bundle/bin/mlp_step_bench" $flags --json="$out/lockstep-$name.json" 2>&1 | tee -a "$log"
done

python3 - "$out" "${configs[@]}" <<'PY' | tee -a "$log"
import json, os, sys
out, configs = sys.argv[1], [c.split("|") for c in sys.argv[2:]]
def load(name):
    try:
        with open(os.path.join(out, f"{name}.json")) as f:
            return json.loads(f.read().strip().splitlines()[-1])
    except Exception:
        return None
rows = []
print("\n| run | Lockstep step ms | Lockstep samples/s | PyTorch step ms | PyTorch samples/s "
      "| speed-up | model TFLOP/s | cuBLAS GEMM TFLOP/s | fraction of GEMM rate |")
print("|---|---|---|---|---|---|---|---|---|")
for name, _, torch_run in configs:
    ls, pt = load(f"lockstep-{name}"), load(f"torch-{torch_run}")
    if ls is None:
        print(f"| {name} | failed | | | | | | | |")
        continue
    ratio = pt["step_ms"] / ls["step_ms"] if pt else float("nan")
    print(f"| {name} | {ls['step_ms']:.2f} | {ls['samples_per_second']:,.0f} | "
          f"{pt['step_ms'] if pt else float('nan'):.2f} | "
          f"{pt['samples_per_second'] if pt else float('nan'):,.0f} | {ratio:.2f}x | "
          f"{ls['model_tflops']:.1f} | {ls['gemm_tflops']:.1f} | "
          f"{ls['model_tflops'] / ls['gemm_tflops']:.2f} |")
    rows.append({"run": name, "lockstep": ls, "torch": pt, "speedup": ratio})
with open(os.path.join(out, "gpu-check.json"), "w") as f:
    json.dump(rows, f, indent=1)
PY
exit "$failed"
