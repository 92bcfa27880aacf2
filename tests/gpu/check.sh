#!/usr/bin/env bash
# The GPU check, for a host with NVIDIA GPUs and no network (scripts/gpu_bundle.sh makes the
# bundle it runs from), in order of what it is worth, each with a summary line ("passed: ...",
# "FAILED: ...", "not run: ..."): the GPU tests (a skip is a failure here); a program job
# (CUDA_VISIBLE_DEVICES, the torchrun example with NCCL, lockstep.torch's checkpoints of CUDA
# tensors); the MLP and GPT jobs on one GPU worker; two workers of one GPU kept out of one
# group when NCCL may not share it; a group of 3 ranks on the one GPU (when NCCL allows it)
# with one SIGKILLed mid-run, which must end with exact steps and the one-worker run's
# checksum; the GPT step benchmark (GPT-2 124M shape), attention alone and the MLP's, each next
# to PyTorch on the same GPU, as tables.
# It keeps to a time budget (LOCKSTEP_CHECK_SECONDS, default 510: a device command may run 600,
# and what ends a section, stopping its daemons and the tables, comes after): each wait is cut
# to what is left, and a section that cannot start in time says "not run: out of time". PyTorch's compiled GPT baseline runs only with LOCKSTEP_CHECK_COMPILE=1.
# Exit status: 0 when every test and job that ran passed (the benchmarks are measurements: a
# failed one shows as "failed" in its table, not in the status).
#   check.sh [BUNDLE_DIR]   (default: the folder holding this script, i.e. gpu-bundle/)
# Writes three files to $OUT (default: the current directory): gpu-check.log (everything, as it
# goes), gpu-check-summary.txt (every summary line, also printed last) and
# gpu-check-results.tar.gz (the benchmarks' JSON).
set -uo pipefail
bundle="${1:-$(dirname "$(readlink -f "$0")")}"
out="${OUT:-$PWD}"
mkdir -p "$out"
log="$out/gpu-check.log"
: >"$log"
scratch="$(mktemp -d)"  # the benchmarks' JSON: one file back in $OUT (a device returns few)
budget="${LOCKSTEP_CHECK_SECONDS:-510}"
end_at=$((SECONDS + budget))
left() { echo $((end_at - SECONDS)); }
# The smaller of N seconds and what is left of the budget (at least 1).
limit() {
  local l=$((end_at - SECONDS))
  ((l < $1)) && { ((l < 1)) && echo 1 || echo "$l"; } || echo "$1"
}
# True when at least N seconds are left; otherwise says WHAT is not run.
in_time() {  # N WHAT
  (($(left) >= $1)) && return 0
  echo "not run: out of time ($(left) s of ${budget} s left): $2" | tee -a "$log"
  return 1
}
summary() {
  {
    echo "== summary ($((SECONDS)) s of ${budget} s)"
    grep -E '^(passed|FAILED|not run|SKIPPED)' "$log"
  } >"$out/gpu-check-summary.txt"
  cat "$out/gpu-check-summary.txt"
  tar -C "$scratch" -czf "$out/gpu-check-results.tar.gz" . 2>/dev/null
}
trap summary EXIT

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
for t in cuda_kernels_test gpu_mlp_test gpu_gpt_test gpu_trainer_test nccl_communicator_test nccl_id_test; do
  in_time 20 "$t" || continue
  if ! timeout "$(limit 240)" "$bundle/bin/$t" >>"$log" 2>&1; then
    echo "FAILED: $t (see $log)" | tee -a "$log"
    failed=1
  elif grep -q "SKIPPED" <(tail -n 20 "$log"); then
    echo "SKIPPED on a GPU host: $t (see $log)" | tee -a "$log"
    failed=1
  else
    echo "passed: $t" | tee -a "$log"
  fi
done

# The NCCL the tests loaded, and whether it lets several ranks share this GPU (the
# TwoRanksOnOneGpu test prints it).
shared_gpu_line="$(grep -m1 "several ranks on one GPU" "$log")"
echo "${shared_gpu_line:-NCCL: unknown (nccl_communicator_test printed nothing)}" | tee -a "$log"

# ---- real jobs: a coordinator, lockstep-worker --device=cuda:0 (one or several), lockstepctl.
# LOCKSTEP_CHECK_DEVICE=cpu runs the same jobs, smaller, on CPU workers: a check of this script
# itself on a machine without a GPU (the multi-rank section then runs with Gloo).
device="${LOCKSTEP_CHECK_DEVICE:-cuda}"
worker_device=cuda:0
[[ "$device" == cpu ]] && worker_device=cpu
ctl() { timeout 30 "$bundle/bin/lockstepctl" --coordinator="$address" "$@"; }
# A field of a job's JSON status (python expression over j).
job_field() {
  ctl --output=json status "$1" | python3 -c "import json, sys; j = json.load(sys.stdin); print($2)"
}
# The members' parameter checksums, distinct, space-separated (one: they agree).
checksums() { job_field "$1" "' '.join(sorted(set(m.get('parameterChecksum', '') for m in j['members'])))"; }
# The check's jobs read and write in their mktemp directories: the daemons' roots.
roots=(--data_root="${TMPDIR:-/tmp}" --checkpoint_root="${TMPDIR:-/tmp}")
start_coordinator() {  # DIR: sets address and coordinator_pid
  "$bundle/bin/lockstep-coordinator" --listen=127.0.0.1:0 --port_file="$1/port" \
    --state_dir="$1/state" "${roots[@]}" >"$1/coordinator.log" 2>&1 &
  coordinator_pid=$!
  for _ in $(seq 1 100); do [[ -s "$1/port" ]] && break; sleep 0.1; done
  address="127.0.0.1:$(cat "$1/port" 2>/dev/null)"
}
declare -A worker_pids=()
start_worker() {  # DIR NAME [ENV=VALUE... | --worker-flag...]
  local dir="$1" name="$2" arg
  shift 2
  local envs=() flags=()
  for arg in "$@"; do
    if [[ "$arg" == --* ]]; then flags+=("$arg"); else envs+=("$arg"); fi
  done
  env "${envs[@]}" "$bundle/bin/lockstep-worker" --coordinator="$address" --device="$worker_device" \
    --name="$name" --give_up_after=30s "${roots[@]}" "${flags[@]}" >"$dir/worker-$name.log" 2>&1 &
  worker_pids[$name]=$!
}
wait_registered() {  # DIR NAME...: 0 when all are registered
  local dir="$1" name
  shift
  for _ in $(seq 1 60); do
    local missing=0
    local alive=0
    for name in "$@"; do
      ctl workers 2>/dev/null | grep -q " $name " || missing=1
      kill -0 "${worker_pids[$name]}" 2>/dev/null && alive=1
    done
    ((missing == 0)) && return 0
    ((alive == 1)) || break  # every worker has exited
    sleep 0.5
  done
  echo "FAILED: GPU workers did not register:" | tee -a "$log"
  for name in "$@"; do tail -n 5 "$dir/worker-$name.log" | tee -a "$log"; done
  return 1
}
# Submits DIR/JOB.json and follows it to the end: SUCCEEDED with exactly STEPS steps and one
# parameter checksum over the members prints the job id (the only line on stdout); otherwise a
# FAILED line (on stderr and in the log) and status 1.
run_job() {  # DIR JOB STEPS
  local dir="$1" job="$2" steps="$3" id sums
  ctl submit "$dir/$job.json" >"$dir/submit-$job.log" 2>&1 || {
    echo "FAILED: submit $job: $(cat "$dir/submit-$job.log")" | tee -a "$log" >&2
    return 1
  }
  id="$(head -n 1 "$dir/submit-$job.log")"
  if ! timeout "$(limit 600)" "$bundle/bin/lockstepctl" --coordinator="$address" watch "$id" \
      >"$dir/watch-$job.log" 2>&1; then
    echo "FAILED: $job ($id) did not succeed" | tee -a "$log" >&2
    tail -n 20 "$dir/watch-$job.log" "$dir"/worker-*.log "$dir/coordinator.log" | tee -a "$log" >&2
    return 1
  fi
  tail -n 3 "$dir/watch-$job.log" | tee -a "$log" >&2
  [[ "$(job_field "$id" "j['step']")" == "$steps" ]] || {
    echo "FAILED: $job ended at step $(job_field "$id" "j['step']"), not $steps" | tee -a "$log" >&2
    return 1
  }
  sums="$(checksums "$id")"
  [[ -n "$sums" && "$sums" != *" "* ]] || {
    echo "FAILED: $job: the ranks ended with different parameters: $sums" | tee -a "$log" >&2
    return 1
  }
  echo "$id"
}
stop_all() {  # SIGTERM, 20 s to exit (a GPU worker may be stuck in NCCL teardown), SIGKILL
  local pids=("${worker_pids[@]}" "$coordinator_pid") pid
  kill "${pids[@]}" 2>/dev/null
  for _ in $(seq 1 100); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive == 0)) && break
    sleep 0.2
  done
  kill -KILL "${pids[@]}" 2>/dev/null
  wait 2>/dev/null
  worker_pids=()
}

# Program jobs: the worker gives the program CUDA_VISIBLE_DEVICES (its host's members' GPUs by
# UUID, in local-rank order, so device LOCAL_RANK is its own GPU); then, where this host's
# PyTorch has CUDA, examples/torch/train.py with NCCL through lockstep.torch's store, and
# tests/gpu/gpu_checkpoint.py (memory checkpoints of CUDA tensors).
program_section() {
prog_dir="$(mktemp -d)"
chmod 755 "$prog_dir"
mkdir -p "$prog_dir/programs" "$prog_dir/programs/out"
chmod 755 "$prog_dir/programs"
chmod 777 "$prog_dir/programs/out"
cp "$bundle/examples/torch/train.py" "$bundle/gpu_checkpoint.py" "$prog_dir/programs/" 2>/dev/null
printf '#!/bin/sh\necho "visible=$CUDA_VISIBLE_DEVICES local_rank=$LOCAL_RANK"\n' >"$prog_dir/programs/devices.sh"
chmod 644 "$prog_dir/programs/"*
as_root=()
[[ $(id -u) -eq 0 ]] && as_root=(--allow_programs_as_root)
start_coordinator "$prog_dir"
start_worker "$prog_dir" prog-a PYTHONPATH="$bundle/python" --programs_root="$prog_dir/programs" \
  "${as_root[@]}"
# The program's output: rank 0's lines, after the job ended SUCCEEDED (else a FAILED line).
program_output() {  # DIR NAME ARGV_JSON [PROGRAM_FIELDS]: prints rank 0's lines; 1 when the job failed
  local dir="$1" name="$2" argv="$3" more="${4:-}" id
  printf '{"name": "%s", "device": "%s", "program": {"argv": %s, "workdir": "%s"%s}}\n' \
    "$name" "$device" "$argv" "$dir/programs" "$more" >"$dir/$name.json"
  id="$(ctl submit "$dir/$name.json" 2>&1 | head -n 1)"
  timeout "$(limit 600)" "$bundle/bin/lockstepctl" --coordinator="$address" watch "$id" >"$dir/watch-$name.log" 2>&1
  ctl logs "$id" --rank=0 | sed 's/^\[default0\]://'
  [[ "$(job_field "$id" "j.get('state', '')")" == JOB_STATE_SUCCEEDED ]] || {
    echo "FAILED: $name ($id): $(job_field "$id" "j.get('reason', '')")" | tee -a "$log" >&2
    return 1
  }
}
if wait_registered "$prog_dir" prog-a; then
  uuid="$(ctl --output=json workers | python3 -c "import json, sys; print([w.get('deviceUuid', '') for w in json.load(sys.stdin)['workers'] if w['name'] == 'prog-a'][0])")"
  seen="$(program_output "$prog_dir" gpu-devices '["/bin/sh", "devices.sh"]' | grep '^visible=')"
  echo "$seen (the worker's GPU: ${uuid:-none})" | tee -a "$log"
  if [[ "$seen" == "visible=$uuid local_rank=0" ]]; then
    echo "passed: the program sees its worker's GPU as device LOCAL_RANK" | tee -a "$log"
  else
    echo "FAILED: CUDA_VISIBLE_DEVICES is not the worker's GPU" | tee -a "$log"
    failed=1
  fi
  # (LOCKSTEP_CHECK_DEVICE=cpu: the same on the CPU, with Gloo: a check of this script.)
  local backend=nccl want_cuda=True
  [[ "$device" == cpu ]] && backend=gloo want_cuda=False
  if ! python3 -c "import torch, grpc, sys; sys.exit(0 if torch.cuda.is_available() or not $want_cuda else 1)" 2>/dev/null; then
    echo "not run: this host's PyTorch has no CUDA (or no python3-grpcio): the example with NCCL needs both" | tee -a "$log"
  elif ! import_error="$(PYTHONPATH="$bundle/python" python3 -c "import lockstep.torch, lockstep.checkpoint" 2>&1)"; then
    # (The example would fall back to plain torch.distributed and pass without Lockstep.)
    echo "$import_error" | tail -n 5 | tee -a "$log"
    echo "FAILED: the bundle's lockstep package does not import with this host's python3" | tee -a "$log"
    failed=1
  else
    out_example="$(program_output "$prog_dir" gpu-example \
      "[\"$(command -v python3)\", \"train.py\", \"--steps=100\", \"--backend=$backend\", \"--memory-checkpoint-every=10\", \"--checkpoint-dir=$prog_dir/programs/out/ck\"]")"
    echo "$out_example" | tail -n 3 | tee -a "$log"
    if [[ "$out_example" == *"final_loss="* ]]; then
      echo "passed: the torchrun example trains with NCCL on the GPU under Lockstep" | tee -a "$log"
    else
      echo "FAILED: the torchrun example with NCCL" | tee -a "$log"
      failed=1
    fi
    # lockstep.torch.Checkpointer with CUDA tensors: save(blocking=False) (device -> pinned
    # staging on a side stream) with the next step queued behind it, then a restart restores
    # exactly the state saved.
    # Its exit code 4 (a mismatch) fails the job at once: a restart would load the same step.
    # Its two slots of about 400 MB are on /dev/shm (a small one fails the saves).
    df -h /dev/shm | tail -n 1 | sed 's/^/\/dev\/shm: /' | tee -a "$log"
    out_ckpt="$(program_output "$prog_dir" gpu-checkpoint \
      "[\"$(command -v python3)\", \"gpu_checkpoint.py\", \"out\"]" ', "fatalExitCodes": [4]')"
    echo "$out_ckpt" | grep "gpu-checkpoint:" | tee -a "$log"
    if [[ "$out_ckpt" == *"gpu-checkpoint: ok"* && "$out_ckpt" != *MISMATCH* ]]; then
      echo "passed: a non-blocking save of CUDA tensors restores bit for bit" | tee -a "$log"
    else
      echo "FAILED: the GPU checkpoint (tests/gpu/gpu_checkpoint.py)" | tee -a "$log"
      failed=1
    fi
  fi
else
  failed=1
fi
stop_all
}
echo "== a program job on the GPU worker: CUDA_VISIBLE_DEVICES, then the torchrun example with NCCL" | tee -a "$log"
in_time 90 "the program jobs" && program_section


job_dir="$(mktemp -d)"
# A byte-level text for the GPT jobs (words of a small vocabulary, fixed by seed).
python3 - "$job_dir/corpus.txt" <<'PY'
import random, sys
r = random.Random(11)
words = "the cat sat on a mat and dog ran far away home while it rained".split()
lines = [" ".join(r.choice(words) for _ in range(r.randint(3, 9))) + "." for _ in range(40000)]
open(sys.argv[1], "w").write("\n".join(lines))
PY
# job-1: the MLP, default mode with gradient accumulation (micro-batches of 256); job-2: the
# MLP deterministic with TF32 products; job-3: the GPT (AdamW, clipping, warm-up and cosine);
# job-4: the GPT deterministic, whose checksum the multi-rank group must reproduce.
cat >"$job_dir/job-1.json" <<'JOB'
{"name": "gpu-check", "model": {"mlp": {"hiddenWidths": [2048, 2048]}},
 "dataset": {"type": "synthetic", "synthetic": {"trainSamples": 65536, "testSamples": 4096,
             "inputDim": 784, "numClasses": 10, "seed": 1}},
 "optimizer": {"type": "sgd", "learningRate": 0.05, "momentum": 0.9},
 "globalBatchSize": 1024, "microShards": 8, "microBatchSize": 256, "maxSteps": 300,
 "minWorkers": 1, "maxWorkers": 1, "device": "cuda"}
JOB
sed -e 's/"gpu-check"/"gpu-check-deterministic"/' -e 's/"microBatchSize": 256/"deterministic": true/' \
  -e 's/"device": "cuda"/"device": "cuda", "precision": "tf32"/' "$job_dir/job-1.json" >"$job_dir/job-2.json"
cat >"$job_dir/job-3.json" <<JOB
{"name": "gpu-check-gpt", "model": {"gpt": {"vocabSize": 256, "contextLength": 128,
  "nLayer": 4, "nHead": 4, "dModel": 256}},
 "dataset": {"type": "text", "path": "$job_dir/corpus.txt", "validationFraction": 0.05},
 "optimizer": {"type": "adamw", "learningRate": 0.003, "weightDecay": 0.1, "beta2": 0.99,
               "warmupSteps": 30, "cosineDecay": true, "gradClipNorm": 1.0},
 "globalBatchSize": 64, "microShards": 8, "maxSteps": 400, "seed": 1, "evalEverySteps": 200,
 "minWorkers": 1, "maxWorkers": 1, "device": "cuda", "precision": "tf32"}
JOB
# 1000 steps where the group of several ranks below runs (long enough to lose a rank and take it
# back), 300 where it cannot.
multi_rank=0
[[ "$shared_gpu_line" == *"allowed"* || "$device" == cpu ]] && multi_rank=1
gpt_steps=300
((multi_rank)) && gpt_steps=1000
sed -e 's/"gpu-check-gpt"/"gpu-check-gpt-deterministic"/' -e 's/"seed": 1,/"seed": 1, "deterministic": true,/' \
  -e "s/\"maxSteps\": 400/\"maxSteps\": $gpt_steps/" "$job_dir/job-3.json" >"$job_dir/job-4.json"

if [[ "$device" == cpu ]]; then
  for f in "$job_dir"/job-*.json; do
    sed -i -e 's/"device": "cuda"/"device": "cpu"/' -e 's/, "precision": "tf32"//' \
      -e 's/\[2048, 2048\]/[128]/' -e 's/"dModel": 256/"dModel": 64/' -e 's/"nLayer": 4/"nLayer": 2/' \
      -e 's/"contextLength": 128/"contextLength": 32/' "$f"
  done
fi
echo "== jobs on one GPU worker (MLP, MLP deterministic, GPT, GPT deterministic)" | tee -a "$log"
reference_sum=""
if ! in_time 60 "the jobs on one GPU worker"; then
  :
elif start_coordinator "$job_dir" && start_worker "$job_dir" gpu0 &&
    wait_registered "$job_dir" gpu0; then
  for job in job-1 job-2 job-3 job-4; do
    steps=300
    [[ "$job" == job-3 ]] && steps=400
    [[ "$job" == job-4 ]] && steps=$gpt_steps
    in_time 15 "$job" || continue
    if id="$(run_job "$job_dir" "$job" "$steps")" && [[ -n "$id" ]]; then
      ctl status "$id" | tee -a "$log"
      echo "passed: GPU worker $job" | tee -a "$log"
      if [[ "$job" == job-4 ]]; then
        reference_sum="$(job_field "$id" "j['members'][0].get('parameterChecksum', '')")"
      fi
    else
      failed=1
    fi
  done
  grep -hE "micro-batches|finished at step|per step|NCCL.s init took" "$job_dir"/worker-*.log | tee -a "$log"
else
  failed=1
fi
stop_all

# Placement: two workers on the one GPU whose NCCL may not share it (the variable is off) are
# never put in one group: a job for two waits, and its reason says why.
echo "== placement: a job for 2 on two workers of one GPU without NCCL_MULTI_RANK_GPU_ENABLE" | tee -a "$log"
if [[ "$device" == cpu ]]; then
  echo "not run: CPU workers have no GPU to share" | tee -a "$log"
elif in_time 20 "placement"; then
  place_dir="$(mktemp -d)"
  start_coordinator "$place_dir"
  for name in alone-a alone-b; do start_worker "$place_dir" "$name" NCCL_MULTI_RANK_GPU_ENABLE=0; done
  if wait_registered "$place_dir" alone-a alone-b; then
    ctl workers | tee -a "$log"
    sed -e 's/"maxWorkers": 1/"maxWorkers": 2/' -e 's/"minWorkers": 1/"minWorkers": 2/' \
      "$job_dir/job-1.json" >"$place_dir/pair.json"
    ctl submit "$place_dir/pair.json" >"$place_dir/submit.log" 2>&1
    id="$(head -n 1 "$place_dir/submit.log")"
    sleep 3
    state="$(job_field "$id" "j.get('state', '')" 2>/dev/null)"
    reason="$(job_field "$id" "j.get('reason', '')" 2>/dev/null)"
    echo "$id: $state: $reason" | tee -a "$log"
    uuids="$(ctl --output=json workers | python3 -c "import json, sys; print(len({w.get('deviceUuid', '') for w in json.load(sys.stdin).get('workers', [])}))")"
    if [[ "$state" == JOB_STATE_PENDING && "$reason" == *"left out for a GPU that another one uses"* && "$uuids" == 1 ]]; then
      echo "passed: two workers on one GPU are not put in one group without NCCL's consent" | tee -a "$log"
    else
      echo "FAILED: placement (state $state, $uuids distinct GPU UUIDs)" | tee -a "$log"
      failed=1
    fi
    ctl cancel "$id" >/dev/null 2>&1
  else
    failed=1
  fi
  stop_all
fi

echo "== a group of 3 ranks on the one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1), one SIGKILLed" | tee -a "$log"
if ((multi_rank == 0)); then
  echo "not run: ${shared_gpu_line:-NCCL unknown}; several ranks on one GPU need NCCL 2.30.3 or later" | tee -a "$log"
elif in_time 150 "the group of 3 ranks and the heal's window"; then
  group_dir="$(mktemp -d)"
  cp "$job_dir/corpus.txt" "$group_dir/"
  start_coordinator "$group_dir"
  for name in rank-a rank-b rank-c; do
    start_worker "$group_dir" "$name" NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_SOCKET_IFNAME=lo
  done
  if wait_registered "$group_dir" rank-a rank-b rank-c; then
    # The MLP in the default mode: float buckets through NCCL as backward writes them.
    sed -e 's/"maxWorkers": 1/"maxWorkers": 3/' -e 's/"minWorkers": 1/"minWorkers": 3/' \
      "$job_dir/job-1.json" >"$group_dir/group-mlp.json"
    if run_job "$group_dir" group-mlp 300 >/dev/null; then
      echo "passed: MLP on a group of 3 ranks on one GPU" | tee -a "$log"
    else
      failed=1
    fi
    # The deterministic GPT on 3, then 2 after a SIGKILL: the same bits as on one worker.
    sed -e "s|$job_dir|$group_dir|" -e 's/"maxWorkers": 1/"maxWorkers": 3/' \
      -e 's/"minWorkers": 1/"minWorkers": 2/' \
      "$job_dir/job-4.json" >"$group_dir/group-gpt.json"
    ctl submit "$group_dir/group-gpt.json" >"$group_dir/submit.log" 2>&1
    id="$(head -n 1 "$group_dir/submit.log")"
    victim=""
    for _ in $(seq 1 600); do
      if [[ "$(job_field "$id" "int(j.get('step', 0)) >= 100 and len(j.get('members', [])) == 3" 2>/dev/null)" == True ]]; then
        victim="$(job_field "$id" "[m['workerName'] for m in j['members'] if m.get('rank', 0) == 1][0]")"
        break
      fi
      sleep 0.2
    done
    if [[ -z "$victim" || -z "${worker_pids[$victim]:-}" ]]; then
      echo "FAILED: the group of 3 never reached step 100 (job $id)" | tee -a "$log"
      tail -n 20 "$group_dir"/worker-*.log | tee -a "$log"
      failed=1
    else
      kill -KILL "${worker_pids[$victim]}"
      echo "SIGKILLed $victim (rank 1) at step $(job_field "$id" "j['step']")" | tee -a "$log"
      # Once the two survivors train on, the victim comes back: the group grows to 3 again and
      # the newcomer heals from a survivor (over NCCL, between the devices).
      for _ in $(seq 1 300); do
        [[ "$(job_field "$id" "len(j.get('members', [])) == 2 and j.get('state') == 'JOB_STATE_RUNNING'" 2>/dev/null)" == True ]] && break
        sleep 0.2
      done
      start_worker "$group_dir" "$victim" NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_SOCKET_IFNAME=lo
      if timeout "$(limit 600)" "$bundle/bin/lockstepctl" --coordinator="$address" watch "$id" \
          >"$group_dir/watch.log" 2>&1; then
        steps="$(job_field "$id" "j['step']")"
        sums="$(checksums "$id")"
        recoveries="$(job_field "$id" "int(j.get('recoveries', 0))")"
        members="$(job_field "$id" "len(j.get('members', []))")"
        healed="$(grep -c "resumes after step" "$group_dir/worker-$victim.log")"
        echo "group: SUCCEEDED at step $steps, $recoveries recoveries, $members members at the end, checksum $sums (one worker: $reference_sum)" | tee -a "$log"
        if [[ "$steps" == "$gpt_steps" && -n "$sums" && "$sums" != *" "* && "$sums" == "$reference_sum" ]] &&
            ((recoveries >= 1)); then
          echo "passed: GPT on 3, 2, then 3 ranks of one GPU: SIGKILL survived, the one-worker bits" | tee -a "$log"
        else
          echo "FAILED: exact steps, one checksum equal to the one-worker run's, a recovery" | tee -a "$log"
          failed=1
        fi
        if ((members == 3 && healed >= 1)); then
          echo "passed: the restarted worker rejoined and healed from a survivor" | tee -a "$log"
        else
          echo "FAILED: the restarted worker did not rejoin and heal (members $members)" | tee -a "$log"
          failed=1
        fi
      else
        echo "FAILED: the group's job did not succeed after the SIGKILL" | tee -a "$log"
        tail -n 30 "$group_dir/watch.log" "$group_dir"/worker-*.log | tee -a "$log"
        failed=1
      fi
    fi
    grep -hE "NCCL.s init took|resumes after step|ranks share this GPU" "$group_dir"/worker-*.log | tee -a "$log"
  else
    failed=1
  fi
  stop_all

  # The heal's window: the source of a heal over NCCL is held by a test hook after its first
  # piece went out, and SIGKILLed there. The receiver must not keep a part of the state: the
  # job still ends with exactly 1000 steps and the one-worker bits.
  echo "== a heal source SIGKILLed in the middle of its NCCL broadcast" | tee -a "$log"
  window_dir="$(mktemp -d)"
  cp "$job_dir/corpus.txt" "$window_dir/"
  start_coordinator "$window_dir"
  start_worker "$window_dir" source NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_SOCKET_IFNAME=lo \
    --test_hooks=heal_broadcast --test_hooks_dir="$window_dir/hooks"
  if wait_registered "$window_dir" source; then
    sed -e "s|$job_dir|$window_dir|" -e 's/"maxWorkers": 1/"maxWorkers": 2/' \
      "$job_dir/job-4.json" >"$window_dir/window-gpt.json"
    ctl submit "$window_dir/window-gpt.json" >"$window_dir/submit.log" 2>&1
    id="$(head -n 1 "$window_dir/submit.log")"
    for _ in $(seq 1 600); do
      [[ "$(job_field "$id" "int(j.get('step', 0)) >= 200" 2>/dev/null)" == True ]] && break
      sleep 0.2
    done
    # A second worker: the group grows, and the source heals it.
    trained="$(job_field "$id" "j.get('step', 0)")"
    start_worker "$window_dir" receiver NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_SOCKET_IFNAME=lo
    held=0
    for _ in $(seq 1 600); do
      [[ -e "$window_dir/hooks/heal_broadcast.reached" ]] && held=1 && break
      sleep 0.1
    done
    if ((held == 0)); then
      echo "FAILED: the heal source never reached its hook (job $id)" | tee -a "$log"
      tail -n 20 "$window_dir"/worker-*.log | tee -a "$log"
      failed=1
    else
      kill -KILL "${worker_pids[source]}"
      echo "SIGKILLed the heal source in its broadcast (it had trained $trained steps alone)" | tee -a "$log"
      if timeout "$(limit 600)" "$bundle/bin/lockstepctl" --coordinator="$address" watch "$id" \
          >"$window_dir/watch.log" 2>&1; then
        steps="$(job_field "$id" "j['step']")"
        sums="$(checksums "$id")"
        echo "window: SUCCEEDED at step $steps, checksum $sums (one worker: $reference_sum)" | tee -a "$log"
        if [[ "$steps" == "$gpt_steps" && "$sums" == "$reference_sum" ]]; then
          echo "passed: a heal source killed mid-broadcast left no mixed state" | tee -a "$log"
        else
          echo "FAILED: exact steps and the one-worker checksum after a kill mid-heal" | tee -a "$log"
          failed=1
        fi
      else
        echo "FAILED: the job did not succeed after its heal source was killed" | tee -a "$log"
        tail -n 30 "$window_dir/watch.log" "$window_dir"/worker-*.log | tee -a "$log"
        failed=1
      fi
    fi
  else
    failed=1
  fi
  stop_all
fi

echo "== GPT step benchmark: GPT-2 124M shape, context 1024, AdamW" | tee -a "$log"
# In order of worth: bf16 (Lockstep's, then PyTorch's), then tf32 and fp32; PyTorch's compiled
# bf16 (a minute or more of compiling) only with LOCKSTEP_CHECK_COMPILE=1.
gpt_runs=("lockstep|bf16|--precision=bf16 --batch=16 --phases" "torch|bf16|--precision bf16"
  "lockstep|tf32|--precision=tf32 --batch=16" "torch|tf32|--precision tf32"
  "lockstep|fp32|--precision=fp32 --batch=16" "torch|fp32|--precision fp32")
[[ "${LOCKSTEP_CHECK_COMPILE:-0}" == 1 ]] && gpt_runs+=("torch|bf16-compile|--precision bf16 --compile")
for run in "${gpt_runs[@]}"; do
  IFS='|' read -r who name flags <<<"$run"
  in_time 30 "the GPT step benchmark, $who $name" || continue
  if [[ "$who" == torch ]]; then
    # shellcheck disable=SC2086
    timeout "$(limit 240)" python3 "$bundle/gpu_gpt_step.py" --batch 16 $flags >"$scratch/torch-gpt-$name.json" 2>>"$log" ||
      echo "PyTorch GPT baseline failed ($name; see $log)" | tee -a "$log"
  else
    # shellcheck disable=SC2086
    timeout "$(limit 240)" "$bundle/bin/gpu_gpt_step_bench" $flags --json="$scratch/lockstep-gpt-$name.json" 2>&1 | tee -a "$log"
  fi
done
python3 - "$scratch" <<'PY' | tee -a "$log"
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, f"{name}.json")) as f:
            return json.loads(f.read().strip().splitlines()[-1])
    except Exception:
        return None
# "Same precision" is the same name: Lockstep's bf16 runs the products and attention on bf16
# tensor cores and stores the activations in bf16 (all but the residual stream, as autocast);
# its fp32 and tf32 attention computes on FP32 CUDA cores, where PyTorch's uses its own kernels.
print("\n| run | step ms | tokens/s | model TFLOP/s | MFU (989 TFLOP/s bf16 peak) | vs PyTorch eager (same precision name) | vs PyTorch bf16 eager | vs PyTorch bf16 compile |")
print("|---|---|---|---|---|---|---|---|")
eager_bf16, compiled = load("torch-gpt-bf16"), load("torch-gpt-bf16-compile")
rows = []
for name in ["lockstep-gpt-bf16", "lockstep-gpt-tf32", "lockstep-gpt-fp32", "torch-gpt-fp32", "torch-gpt-tf32",
             "torch-gpt-bf16", "torch-gpt-bf16-compile"]:
    r = load(name)
    if r is None:
        print(f"| {name} | failed | | | | | | |")
        continue
    same = load("torch-gpt-" + r["precision"]) if name.startswith("lockstep") else None
    ratio = lambda other: f"{r['tokens_per_second'] / other['tokens_per_second']:.2f}x" if other else ""
    print(f"| {name} | {r['step_ms']:.1f} | {r['tokens_per_second']:,.0f} | {r['model_tflops']:.1f} | "
          f"{r['mfu']:.3f} | {ratio(same)} | {ratio(eager_bf16)} | {ratio(compiled)} |")
    rows.append({"run": name, **r})
with open(os.path.join(out, "gpu-check-gpt.json"), "w") as f:
    json.dump(rows, f, indent=1)
PY

echo "== attention alone: 16 x 1024 tokens, 12 heads of 64, causal" | tee -a "$log"
if in_time 30 "PyTorch's attention"; then
  timeout "$(limit 120)" python3 "$bundle/gpu_attention.py" >"$scratch/torch-attention.json" 2>>"$log" ||
    echo "PyTorch attention baseline failed (see $log)" | tee -a "$log"
fi
in_time 20 "Lockstep's attention" &&
  timeout "$(limit 120)" "$bundle/bin/attention_bench" --json="$scratch/lockstep-attention.json" 2>&1 | tee -a "$log"
python3 - "$scratch" <<'PY' | tee -a "$log"
import json, os, sys
def load(name):
    try:
        with open(os.path.join(sys.argv[1], f"{name}.json")) as f:
            return json.loads(f.read().strip().splitlines()[-1])
    except Exception:
        return None
ls, pt = load("lockstep-attention"), load("torch-attention")
print("\n| attention (bf16) | forward ms | forward TFLOP/s | backward ms | backward TFLOP/s |")
print("|---|---|---|---|---|")
if ls:
    print(f"| Lockstep tensor-core kernels | {ls['bf16_forward_ms']:.3f} | {ls['bf16_forward_tflops']:.1f} | "
          f"{ls['bf16_backward_ms']:.3f} | {ls['bf16_backward_tflops']:.1f} |")
else:
    print("| Lockstep tensor-core kernels | failed | | | |")
if pt:
    print(f"| PyTorch SDPA ({pt['torch']}) | {pt['forward_ms']:.3f} | {pt['forward_tflops']:.1f} | "
          f"{pt['backward_ms']:.3f} | {pt['backward_tflops']:.1f} |")
else:
    print("| PyTorch SDPA | failed | | | |")
PY

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
  in_time 20 "PyTorch's MLP step, $precision" || continue
  timeout "$(limit 120)" python3 "$bundle/gpu_mlp_step.py" $flag >"$scratch/torch-$precision.json" 2>>"$log" ||
    echo "PyTorch baseline failed ($precision; see $log)" | tee -a "$log"
done
for config in "${configs[@]}"; do
  IFS='|' read -r name flags _ <<<"$config"
  in_time 20 "Lockstep's MLP step, $name" || continue
  # shellcheck disable=SC2086
  timeout "$(limit 120)" "$bundle/bin/mlp_step_bench" $flags --json="$scratch/lockstep-$name.json" 2>&1 | tee -a "$log"
done

python3 - "$scratch" "${configs[@]}" <<'PY' | tee -a "$log"
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
