#!/usr/bin/env bash
# Starts or stops a local Lockstep cluster without containers: one coordinator and N CPU
# workers, each a plain process with its log in DIR. The same daemons and flags as the compose
# file and the systemd units (docs/deploy.md); the demo and the benchmarks use it.
#   cluster.sh start --dir DIR [--workers N] [--listen HOST:PORT] [--bin BUILD_DIR]
#                    [--token_file FILE] [--http_listen HOST:PORT]
#                    [--data_root DIRS] [--checkpoint_root DIRS]
#                    [--programs_root DIRS [--program_user USER] [--checkpoint_memory_dir DIR]]
#   cluster.sh stop  --dir DIR      (returns once every process has exited)
# After start, DIR/address holds the coordinator address (HOST:PORT). With --token_file, every
# process (and lockstepctl, given the same file or $LOCKSTEP_TOKEN) uses that token. With
# --http_listen the coordinator serves its web dashboard there (port 0: any), and
# DIR/dashboard holds its address (http://HOST:PORT/). Jobs read data only in the daemons'
# default data roots (/var/lib/lockstep/data, /usr/share/datasets, /usr/share/games/fortunes)
# or --data_root, and write checkpoints and exports only in DIR/checkpoints and
# /var/lib/lockstep/checkpoints or --checkpoint_root (comma-separated; "/" allows any path).
# With --programs_root the workers run program jobs (the user's own scripts) from there, as
# --program_user (default: nobody when started as root, else the caller), with BUILD_DIR/python
# on PYTHONPATH so that scripts import lockstep.torch from the build tree, and keep the programs'
# in-memory checkpoints under --checkpoint_memory_dir (default: the worker's, /dev/shm; a
# killed worker leaves its directory there until it starts again).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cmd="${1:-}"; shift || true
dir=""; workers=2; listen="127.0.0.1:0"; bin="$root/build"; token_file=""; http_listen=""
data_root=""; checkpoint_root=""; programs_root=""; program_user=""; memory_dir=""
while (($#)); do
  case "$1" in
    --dir) dir="$2"; shift ;;
    --workers) workers="$2"; shift ;;
    --listen) listen="$2"; shift ;;
    --bin) bin="$2"; shift ;;
    --token_file) token_file="$(realpath "$2")"; shift ;;
    --http_listen) http_listen="$2"; shift ;;
    --data_root) data_root="$2"; shift ;;
    --checkpoint_root) checkpoint_root="$2"; shift ;;
    --programs_root) programs_root="$2"; shift ;;
    --program_user) program_user="$2"; shift ;;
    --checkpoint_memory_dir) memory_dir="$2"; shift ;;
    *) echo "cluster.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[[ -n "$dir" ]] || { echo "cluster.sh: --dir is required" >&2; exit 2; }
# Absolute, so that the PYTHONPATH the workers hand to programs (which run in their own
# workdir) still finds BUILD_DIR/python.
[[ -d "$bin" ]] && bin="$(realpath "$bin")"

case "$cmd" in
  start)
    mkdir -p "$dir/state" "$dir/checkpoints"
    roots=(--checkpoint_root="${checkpoint_root:-$(realpath "$dir")/checkpoints,/var/lib/lockstep/checkpoints}")
    [[ -n "$data_root" ]] && roots+=(--data_root="$data_root")
    rm -f "$dir/port" "$dir/address" "$dir/http_port" "$dir/dashboard"
    auth=()
    [[ -n "$token_file" ]] && auth=(--token_file="$token_file")
    http=()
    [[ -n "$http_listen" ]] && http=(--http_listen="$http_listen" --http_port_file="$dir/http_port")
    "$bin/coordinator/lockstep-coordinator" --listen="$listen" --state_dir="$dir/state" \
      --port_file="$dir/port" "${auth[@]}" "${http[@]}" "${roots[@]}" >"$dir/coordinator.log" 2>&1 &
    echo $! >"$dir/coordinator.pid"
    for _ in $(seq 1 200); do [[ -f "$dir/port" ]] && break; sleep 0.05; done
    if [[ ! -f "$dir/port" ]]; then
      echo "cluster.sh: coordinator did not start; its log:" >&2
      tail -n 20 "$dir/coordinator.log" >&2
      exit 1
    fi
    address="${listen%:*}:$(cat "$dir/port")"
    echo "$address" >"$dir/address"
    if [[ -n "$http_listen" ]]; then
      echo "http://${http_listen%:*}:$(cat "$dir/http_port")/" >"$dir/dashboard"
    fi
    programs=()
    if [[ -n "$programs_root" ]]; then
      programs=(--programs_root="$programs_root")
      if [[ -n "$program_user" ]]; then
        programs+=(--program_user="$program_user")
      elif [[ $(id -u) -eq 0 ]]; then
        programs+=(--program_user=nobody)
      fi
      [[ -n "$memory_dir" ]] && programs+=(--checkpoint_memory_dir="$memory_dir")
    fi
    for ((i = 0; i < workers; i++)); do
      PYTHONPATH="$bin/python${PYTHONPATH:+:$PYTHONPATH}" \
      "$bin/worker/lockstep-worker" --coordinator="$address" --device=cpu --name="w$i" \
        --status_file="$dir/w$i.status" "${auth[@]}" "${roots[@]}" "${programs[@]}" \
        >"$dir/w$i.log" 2>&1 &
      echo $! >"$dir/w$i.pid"
    done
    # Wait until every worker has registered.
    for _ in $(seq 1 200); do
      idle=$("$bin/cli/lockstepctl" --coordinator="$address" "${auth[@]}" workers 2>/dev/null |
        grep -c " idle " || true)
      ((idle >= workers)) && break
      sleep 0.05
    done
    echo "cluster up: coordinator $address, $workers workers, logs in $dir"
    if [[ -n "$http_listen" ]]; then echo "dashboard: $(cat "$dir/dashboard")"; fi
    ;;
  stop)
    # SIGTERM to every process, then wait until they are gone (10 s, then SIGKILL): once stop
    # returns nothing of the cluster writes into DIR any more, so DIR can be removed.
    pids=()
    for pidfile in "$dir"/w*.pid "$dir"/coordinator.pid; do
      [[ -f "$pidfile" ]] || continue
      pid="$(cat "$pidfile")"
      if kill "$pid" 2>/dev/null; then pids+=("$pid"); fi
      rm -f "$pidfile"
    done
    for _ in $(seq 1 100); do
      alive=0
      for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
      ((alive)) || break
      sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    ;;
  *) echo "usage: cluster.sh start|stop --dir DIR [--workers N]" >&2; exit 2 ;;
esac
