#!/usr/bin/env bash
# End-to-end test of deploy/: a real Docker engine builds the images from
# deploy/docker/Dockerfile on a Debian base made here without any registry (debootstrap +
# docker import), brings up deploy/compose/docker-compose.yml with a coordinator and 3 CPU
# workers, and trains a synthetic job submitted with lockstepctl from the host while:
#   - one worker is stopped with `docker kill` (the job shrinks to 2 and goes on);
#   - another worker's process is killed from the host, as a crash would (the restart policy
#     brings the container back, it registers again and rejoins the running job).
# The images are made from binaries of this build (scripts/docker_prebuilt.sh: a CPU build
# that reuses the build's compiler cache, and a bundle of its CUDA worker), not compiled
# inside Docker again; LOCKSTEP_E2E_FROM_SOURCE=1 compiles inside Docker as a user's
# `docker-compose up --build` does.
# Test hooks hold the job at each disturbance, so that it cannot end before them however fast
# or slow the machine: the workers hold before step 19999 (the docker kill comes before the
# job ends), and while they form generation 2, the one after the docker kill (the crash comes
# before it trains again); the test releases them once the crashed worker has rejoined.
# The compose file's Prometheus server scrapes every service: its HTTP API must return a
# Lockstep metric of the coordinator and of each worker, and the recovery counter must rise
# after the docker kill.
# The workers share one /dev/shm volume, so their sums take the shared-memory path; the test
# checks that in their logs.
# The job must succeed with exactly maxSteps steps and identical parameters on every rank.
# Bad input: a worker with a wrong token exits 3 and the coordinator lists it as rejected; a
# wrong coordinator address exits 4 after --give_up_after; a GPU device on a host without one
# exits 2; each with a log line that says why.
# Then deploy/compose/docker-compose.ha.yml (three etcd members, three coordinators on them, two
# workers) trains a job through a docker kill of the leading coordinator's container: it must
# cost the job nothing (one generation, no recovery, exact steps, one checksum).
# Then everything is torn down: containers, networks, volumes, the images it built, and, if it
# started the engine itself, the engine, its iptables chains, its bridges and ip_forward, which
# the test checks are back to what they were.
#
# Usage: tests/deploy/compose_e2e.sh [--lockstepctl PATH] [--build DIR]
# DIR: the build whose binaries the images get; default: the one lockstepctl is in
# (DIR/cli/lockstepctl), else build/.
# Exit 77 (ctest: skipped) when no Docker engine can run here. Needs root to start the engine.
# The debootstrapped base is cached in ${LOCKSTEP_CACHE_DIR:-$HOME/.cache/lockstep}.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
ctl="$root/build/cli/lockstepctl"
build=""
while (($#)); do
  case "$1" in
    --lockstepctl) ctl="${2:?--lockstepctl needs a path}"; shift 2 ;;
    --build) build="${2:?--build needs a directory}"; shift 2 ;;
    *) echo "usage: compose_e2e.sh [--lockstepctl PATH] [--build DIR]" >&2; exit 2 ;;
  esac
done
[[ -n "$build" ]] || build="$(dirname "$(dirname "$ctl")")"
from_source="${LOCKSTEP_E2E_FROM_SOURCE:-0}"
cache="${LOCKSTEP_CACHE_DIR:-$HOME/.cache/lockstep}"
mirror="${LOCKSTEP_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
base_tag="lockstep-e2e/debian:bookworm"
proj="lockstepe2e$$"
export LOCKSTEP_IMAGE_PREFIX="lockstep-e2e" LOCKSTEP_TAG="test-$$"
export LOCKSTEP_BUILD_IMAGE="$base_tag" LOCKSTEP_RUNTIME_IMAGE="$base_tag"
export LOCKSTEP_TOKEN="e2e-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
work="$(mktemp -d -t lockstep-e2e.XXXXXX)"
export LOCKSTEP_DATASETS="$work/datasets"
mkdir -p "$LOCKSTEP_DATASETS"
compose=(docker-compose -p "$proj" -f "$root/deploy/compose/docker-compose.yml")

log() { echo "[$(date +%H:%M:%S)] e2e: $*"; }
fail() { echo "[$(date +%H:%M:%S)] e2e: FAIL: $*" >&2; exit 1; }
skip() { echo "e2e: SKIP: $*"; exit 77; }

# Polls `cmd` every second until it succeeds or `seconds` pass.
wait_for() {
  local seconds="$1" what="$2"; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || fail "timed out after ${seconds}s waiting for: $what"
    sleep 1
  done
}

for tool in docker docker-compose; do
  command -v "$tool" >/dev/null || skip "$tool is not installed (scripts/install_deps.sh --test)"
done
[[ -x "$ctl" ]] || fail "lockstepctl not found at $ctl (build it first)"
if [[ "$from_source" != 1 && ! -f "$build/build.ninja" ]]; then
  fail "no build at $build for the images' binaries: pass --build DIR, or set LOCKSTEP_E2E_FROM_SOURCE=1"
fi

# ---- the engine: an existing one, or one of our own that we undo completely afterwards ----
own_engine=0
dockerd_pid=""
snapshot() {  # what an engine may change on the host, to compare before and after
  echo "ip_forward=$(cat /proc/sys/net/ipv4/ip_forward)"
  ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | sort | sed 's/^/link /'
  # Rules, chains and policies; an empty table with ACCEPT policies counts as no table (it
  # cannot always be removed once created).
  if command -v iptables-save >/dev/null; then
    iptables-save 2>/dev/null | grep -v '^#' | sed -E 's/ \[[0-9]+:[0-9]+\]$//' |
      grep -vE '^(\*|COMMIT$|:(INPUT|OUTPUT|FORWARD|PREROUTING|POSTROUTING) ACCEPT$)' |
      sed 's/^/ipt /' || true
  fi
}

teardown() {
  local rc=$?
  set +e
  if [[ -n "${DOCKER_HOST:-}" || $own_engine == 0 ]] && docker info >/dev/null 2>&1; then
    log "tearing down the cluster"
    "${compose[@]}" ps 2>/dev/null
    if ((rc != 0)); then "${compose[@]}" logs --no-color --tail=40 2>/dev/null; fi
    if [[ -n "${ha[*]:-}" ]]; then
      if ((rc != 0)); then "${ha[@]}" ps 2>/dev/null; "${ha[@]}" logs --no-color --tail=40 2>/dev/null; fi
      "${ha[@]}" --profile cli down --volumes --rmi all --remove-orphans >/dev/null 2>&1
    fi
    "${compose[@]}" --profile cli down --volumes --rmi all --remove-orphans >/dev/null 2>&1
    docker rmi "$base_tag" >/dev/null 2>&1
    # The untagged build stage that the classic builder leaves behind, and only that.
    docker image prune -f --filter label=org.lockstep.stage=build >/dev/null 2>&1
  fi
  if ((own_engine)); then
    log "stopping the engine and undoing its host changes"
    kill "$dockerd_pid" 2>/dev/null
    for _ in $(seq 1 30); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 1; done
    kill -9 "$dockerd_pid" 2>/dev/null
    pkill -f "containerd --config $work/exec" 2>/dev/null
    restore_host
    snapshot >"$work/after"
    if ! diff -u "$work/before" "$work/after" >"$work/host.diff"; then
      echo "e2e: FAIL: the host was not restored:" >&2
      cat "$work/host.diff" >&2
      rc=1
    else
      log "host restored: iptables, links and ip_forward as before"
    fi
    umount -R "$work/docker" 2>/dev/null
  fi
  rm -rf "$work" 2>/dev/null || true
  exit "$rc"
}

restore_host() {
  # iptables: put back each table the engine touched exactly as it was (an empty table with
  # ACCEPT policies if it had none), which also deletes the DOCKER chains.
  if command -v iptables-restore >/dev/null; then
    for table in filter nat; do
      if grep -q "^\*$table" "$work/iptables.before"; then
        sed -n "/^\*$table/,/^COMMIT/p" "$work/iptables.before" | iptables-restore -T "$table"
      else
        case "$table" in
          filter) printf '*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n' ;;
          nat) printf '*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n' ;;
        esac | iptables-restore -T "$table"
      fi
    done
  fi
  # Links the engine added (docker0, br-*, veth*).
  ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | while read -r link; do
    grep -qx "link $link" "$work/before" || ip link delete "$link" 2>/dev/null
  done
  echo "$ip_forward_before" >/proc/sys/net/ipv4/ip_forward
}

trap teardown EXIT
if docker info >/dev/null 2>&1; then
  log "using the running Docker engine"
else
  [[ $(id -u) == 0 ]] || skip "no Docker engine is running and starting one needs root"
  command -v dockerd >/dev/null || skip "dockerd is not installed (scripts/install_deps.sh --test)"
  ip_forward_before="$(cat /proc/sys/net/ipv4/ip_forward)"
  iptables-save >"$work/iptables.before" 2>/dev/null || true
  snapshot >"$work/before"
  own_engine=1
  export DOCKER_HOST="unix://$work/docker.sock"
  log "starting dockerd (data in $work)"
  dockerd --host="$DOCKER_HOST" --data-root="$work/docker" --exec-root="$work/exec" \
    --pidfile="$work/dockerd.pid" >"$work/dockerd.log" 2>&1 &
  dockerd_pid=$!
  deadline=$((SECONDS + 60))
  until docker info >/dev/null 2>&1; do
    if ! kill -0 "$dockerd_pid" 2>/dev/null || ((SECONDS > deadline)); then
      tail -n 20 "$work/dockerd.log"
      skip "the Docker engine cannot start on this machine (log above)"
    fi
    sleep 0.5
  done
fi

# ---- a Debian base image without a registry ----
mkdir -p "$cache"
if [[ ! -s "$cache/debian-bookworm-minbase.tar" ]]; then
  command -v debootstrap >/dev/null || skip "debootstrap is not installed (scripts/install_deps.sh --test)"
  log "debootstrapping Debian bookworm from $mirror (cached in $cache)"
  debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 ||
    { tail -n 20 "$work/debootstrap.log"; fail "debootstrap failed"; }
  tar -C "$work/rootfs" -cf "$cache/debian-bookworm-minbase.tar.tmp" .
  mv "$cache/debian-bookworm-minbase.tar.tmp" "$cache/debian-bookworm-minbase.tar"
  rm -rf "$work/rootfs"
fi
docker import "$cache/debian-bookworm-minbase.tar" "$base_tag" >/dev/null
# The image build fetches the dashboard's chart library from the npm registry over HTTPS. A host
# behind a TLS-intercepting proxy trusts the proxy's CA (/usr/local/share/ca-certificates); so
# must the build: the base image gets those certificates (ca-certificates picks them up when
# the build installs it), as a site's own base image would have them.
extra_cas=()
while IFS= read -r -d '' crt; do extra_cas+=("$crt"); done \
  < <(find /usr/local/share/ca-certificates -name '*.crt' -print0 2>/dev/null)
if ((${#extra_cas[@]})); then
  mkdir -p "$work/base-ca/certs"
  cp "${extra_cas[@]}" "$work/base-ca/certs/"
  printf 'FROM %s\nCOPY certs/ /usr/local/share/ca-certificates/\n' "$base_tag" >"$work/base-ca/Dockerfile"
  docker build -q -t "$base_tag" "$work/base-ca" >/dev/null || fail "adding the host's CA certificates to the base image"
  log "base image trusts the host's ${#extra_cas[@]} extra CA certificate(s)"
fi

# ---- build and start ----
# The hooks (common/test_hooks.h): each holds once per process, until $hooks/NAME.release
# exists or the worker's run is aborted. before_step@19999 holds the job at its end until the
# docker kill; store_set_R@2 holds the survivors' generation 2 (rank R has published its
# address) until the crash, since the docker kill's abort releases their first hold. The
# override gives the compose file's own worker command the hook flags, so that the command
# itself stays in one place.
# hook_override HOOKS DIR COMPOSE...: an override file (on stdout) that gives the worker
# service of the compose files COMPOSE --test_hooks=HOOKS with DIR as its hooks directory.
hook_override() {
  local hooks="$1" dir="$2"; shift 2
  "$@" config | python3 -c '
import json, sys, yaml
command = yaml.safe_load(sys.stdin)["services"]["worker"]["command"]
command += ["--test_hooks=" + sys.argv[1], "--test_hooks_dir=/hooks"]
print(json.dumps({"services": {"worker": {"command": command, "volumes": [sys.argv[2] + ":/hooks"]}}}))
' "$hooks" "$dir"
}
hooks="$work/hooks"
mkdir -m 0777 "$hooks"  # the workers run as uid 10001
hook_override "before_step@19999,store_set_0@2,store_set_1@2" "$hooks" "${compose[@]}" \
  >"$work/compose.hooks.yml" || fail "writing the test-hook override of the compose file"
compose+=(-f "$work/compose.hooks.yml")

if [[ "$from_source" == 1 ]]; then
  export LOCKSTEP_BINARIES=source
  log "building the images (compile inside Docker; a few minutes)"
else
  export LOCKSTEP_BINARIES=prebuilt
  log "staging the binaries of $build for the images (scripts/docker_prebuilt.sh)"
  SECONDS_BUILD=$SECONDS
  "$root/scripts/docker_prebuilt.sh" --build "$build" >"$work/prebuilt.log" 2>&1 ||
    { tail -n 40 "$work/prebuilt.log"; fail "scripts/docker_prebuilt.sh --build $build failed"; }
  log "binaries staged in $((SECONDS - SECONDS_BUILD))s: $(grep -h '^docker_prebuilt.sh\|^bundle.sh' "$work/prebuilt.log" | tr '\n' ' ')"
  log "building the images from them"
fi
SECONDS_BUILD=$SECONDS
"${compose[@]}" build >"$work/build.log" 2>&1 || { tail -n 40 "$work/build.log"; fail "image build failed"; }
log "images built in $((SECONDS - SECONDS_BUILD))s"
# Free host ports (published on 127.0.0.1 only), picked just before they are bound: other
# programs on the machine take ephemeral ports too.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
LOCKSTEP_PORT="$(free_port)" LOCKSTEP_PROMETHEUS_PORT="$(free_port)" LOCKSTEP_DASHBOARD_PORT="$(free_port)"
export LOCKSTEP_PORT LOCKSTEP_PROMETHEUS_PORT LOCKSTEP_DASHBOARD_PORT
"${compose[@]}" up -d --scale worker=3 >"$work/up.log" 2>&1 || { cat "$work/up.log"; fail "compose up failed"; }
published="$("${compose[@]}" port coordinator 7070)"
port="${published##*:}"
[[ -n "$port" ]] || fail "the coordinator port is not published"
[[ "$published" == 127.0.0.1:* ]] || fail "coordinator published on $published, not 127.0.0.1"
export LOCKSTEP_COORDINATOR="127.0.0.1:$port"
log "coordinator on $LOCKSTEP_COORDINATOR"

healthy_count() {
  local n=0 id
  for id in $("${compose[@]}" ps -q "$1"); do
    [[ "$(docker inspect -f '{{.State.Health.Status}}' "$id")" == healthy ]] && n=$((n + 1))
  done
  echo "$n"
}
wait_for 90 "3 healthy workers" bash -c "[[ \$($(declare -f healthy_count); compose=(${compose[*]}); healthy_count worker) -ge 3 ]]"
"$ctl" workers
[[ "$("$ctl" workers | grep -c ' idle ')" -ge 3 ]] || fail "the coordinator does not list 3 idle workers"

# ---- a job, a docker kill, and a crash that the restart policy heals ----
cat >"$work/job.json" <<'JOB'
{
  "name": "compose-e2e",
  "model": {"mlp": {"hiddenWidths": [256, 256]}},
  "dataset": {"type": "synthetic",
              "synthetic": {"trainSamples": 24000, "testSamples": 2000, "inputDim": 128,
                            "numClasses": 10, "seed": 3}},
  "optimizer": {"type": "sgd", "learningRate": 0.05, "momentum": 0.9},
  "globalBatchSize": 120,
  "maxSteps": 20000,
  "minWorkers": 2,
  "maxWorkers": 3,
  "stepTimeoutMs": 300000
}
JOB
# stepTimeoutMs: a hook may hold the job for up to 120 s; the default 60 s would re-form the
# job there, which releases the hold.
job="$("$ctl" submit "$work/job.json")"
log "submitted $job"
job_field() { "$ctl" --output=json status "$job" | python3 -c "import json,sys; j=json.load(sys.stdin); print($1)"; }
wait_for 60 "$job at step 300" bash -c "(( \$($(declare -f job_field); ctl=$ctl job=$job; job_field \"int(j.get('step', 0))\") >= 300 ))"

# The compose cluster's Prometheus server scrapes the coordinator and every worker: ask its
# HTTP API for a Lockstep metric of each service. prom_value QUERY prints the first result's value.
prom_value() {
  python3 - "$1" <<'PY'
import json, sys, urllib.parse, urllib.request, os
url = "http://127.0.0.1:%s/api/v1/query?query=%s" % (os.environ["LOCKSTEP_PROMETHEUS_PORT"],
                                                     urllib.parse.quote(sys.argv[1]))
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
result = json.load(opener.open(url, timeout=5))["data"]["result"]
print(result[0]["value"][1] if result else "")
PY
}
wait_for 90 "Prometheus scraping 3 workers" bash -c "[[ \$($(declare -f prom_value); prom_value 'count(lockstep_worker_steps_total > 0)') == 3 ]]"
wait_for 30 "Prometheus scraping the coordinator" bash -c "[[ \$($(declare -f prom_value); prom_value 'lockstep_coordinator_jobs{state=\"running\"}') == 1 ]]"
log "Prometheus: $(prom_value 'count(up == 1)') targets up, $(prom_value 'sum(lockstep_worker_steps_total)') steps counted"

mapfile -t workers < <("${compose[@]}" ps -q worker)
victim="${workers[0]}"
state="$(job_field "j['state']")"
[[ "$state" == JOB_STATE_RUNNING ]] ||
  fail "$job is $state before the docker kill although its workers hold before step 19999 (for 120 s at most)"
log "docker kill $(docker inspect -f '{{.Name}}' "$victim") at step $(job_field "j.get('step')")$(
  [[ -e "$hooks/before_step.reached" ]] && echo ", the workers holding before step 19999")"
docker kill "$victim" >/dev/null
# Re-formations after a loss, counted or not: on a loaded machine a loss right after the
# coordinator itself stalled is recorded as the coordinator's doing (kind "coordinator", not
# counted against max_restarts), which is still the recovery this test is after.
losses="len([r for r in j.get('recoveryHistory', []) if not r.get('scaleUp')])"
wait_for 60 "a recovery after the docker kill" bash -c "(( \$($(declare -f job_field); ctl=$ctl job=$job; job_field \"$losses\") >= 1 ))"
wait_for 60 "Prometheus seeing the recovery" bash -c "[[ \$($(declare -f prom_value); prom_value 'sum(lockstep_coordinator_recoveries_total{kind!=\"scale_up\"})') -ge 1 ]]"
log "Prometheus: lockstep_coordinator_recoveries_total{kind!=\"scale_up\"} = $(prom_value 'sum(lockstep_coordinator_recoveries_total{kind!="scale_up"})')"

# The dashboard, published by the coordinator's container: the token is required, and the job's
# membership timeline has the generation that replaced the killed worker.
dashboard_check() {
  python3 - "$job" <<'PY'
import json, os, sys, urllib.error, urllib.request
base = "http://127.0.0.1:%s" % os.environ["LOCKSTEP_DASHBOARD_PORT"]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    opener.open(base + "/api/v1/jobs", timeout=5)
    sys.exit("the dashboard answered without the token")
except urllib.error.HTTPError as e:
    assert e.code == 401, e.code
request = urllib.request.Request(base + "/api/v1/jobs/" + sys.argv[1],
                                 headers={"Authorization": "Bearer " + os.environ["LOCKSTEP_TOKEN"]})
job = json.load(opener.open(request, timeout=5))
assert len(job["generations"]) >= 2, job["generations"]
assert opener.open(base + "/", timeout=5).read().find(b"/assets/app.js") >= 0
print("%d generations; the latest: %s" % (len(job["generations"]), ", ".join(job["generations"][-1]["members"])))
PY
}
wait_for 30 "the dashboard showing the new generation" dashboard_check
log "dashboard: $(dashboard_check)"

crashed="${workers[1]}"
wait_for 60 "the 2 survivors holding while they form generation 2" \
  test -e "$hooks/store_set_0.reached" -a -e "$hooks/store_set_1.reached"
state="$(job_field "j['state']")"
[[ "$state" == JOB_STATE_RUNNING || "$state" == JOB_STATE_RECONFIGURING ]] ||
  fail "$job is $state before the crash although its workers hold (for 120 s at most)"
log "the 2 survivors hold in generation $(job_field "j.get('generation')") at step $(job_field "j.get('step')")"
pid="$(docker inspect -f '{{.State.Pid}}' "$crashed")"
log "kill -9 of the worker process in $(docker inspect -f '{{.Name}}' "$crashed") (host pid $pid)"
kill -9 "$pid"
wait_for 60 "the crashed container restarted" bash -c "(( \$(docker inspect -f '{{.RestartCount}}' $crashed) >= 1 ))"
host="${crashed:0:12}"  # the container's hostname, which the worker reports
log "restarted; waiting for $host to rejoin $job"
wait_for 120 "$host back among the members" bash -c "$(declare -f job_field); ctl=$ctl job=$job; job_field \"'$host' in [m['host'] for m in j.get('members', [])]\" | grep -qx True"
log "rejoined: members $(job_field "' '.join(m['host'] for m in j['members'])"), generation $(job_field "j.get('generation')")"
# Nothing holds any more: the restarted process is armed too, and holds before step 19999.
touch "$hooks/before_step.release"

"$ctl" watch "$job" >"$work/watch.log" 2>&1 || { cat "$work/watch.log"; fail "$job did not succeed"; }
"${compose[@]}" logs --no-color worker >"$work/workers.log" 2>&1
grep -q "no shared-memory fast path" "$work/workers.log" &&
  fail "the workers fell back to Gloo: $(grep -m1 'no shared-memory fast path' "$work/workers.log")"
waits="$(grep -o '[0-9.]* ms waiting for allreduce' "$work/workers.log" | head -n 3 | tr '\n' ' ')"
log "per-step wait for the gradient sum (shared /dev/shm): $waits"
"$ctl" status "$job"
[[ "$(job_field "j['state']")" == JOB_STATE_SUCCEEDED ]] || fail "$job not SUCCEEDED"
[[ "$(job_field "j['step']")" == 20000 ]] || fail "$job did not run exactly 20000 steps"
checksums="$(job_field "' '.join(sorted(set(m.get('parameterChecksum', '') for m in j['members'])))")"
[[ -n "$checksums" && "$checksums" != *" "* ]] || fail "ranks ended with different parameters: $checksums"
recoveries="$(job_field "$losses")"
redone="$(job_field "sum(int(r.get('stepsRedone', 0)) for r in j.get('recoveryHistory', []))")"
((recoveries >= 2)) || fail "expected at least 2 recoveries, saw $recoveries"
((redone == 0)) || fail "$redone committed steps were trained again"
[[ "$(job_field "'$host' in [m['host'] for m in j['members']]")" == True ]] ||
  fail "the restarted worker is not among the final members"
log "$job SUCCEEDED: 20000 steps, $recoveries recoveries, 0 redone, parameters $checksums"
[[ "$(docker inspect -f '{{.State.Status}}' "$victim")" == exited ]] || fail "docker kill'ed worker was restarted"

# ---- bad input: each container exits with a clear line and a distinct code ----
network="$(docker inspect -f '{{range $k, $v := .NetworkSettings.Networks}}{{$k}}{{end}}' "${workers[2]}")"
image="$LOCKSTEP_IMAGE_PREFIX/worker:$LOCKSTEP_TAG"
expect_exit() {
  local code="$1" pattern="$2" out rc; shift 2
  set +e; out="$(timeout 60 docker run --rm "$@" 2>&1)"; rc=$?; set -e
  [[ $rc == "$code" ]] || fail "expected exit $code, got $rc from docker run $*: $out"
  grep -q "$pattern" <<<"$out" || fail "no '$pattern' in the output of docker run $*: $out"
  log "exit $rc as expected: $(grep "$pattern" <<<"$out" | head -n1 | cut -c1-160)"
}
expect_exit 3 "wrong token" --network "$network" -e LOCKSTEP_TOKEN=not-the-token --name "${proj}_intruder" "$image"
expect_exit 3 "missing token" --network "$network" "$image"
"$ctl" workers | tee "$work/workers.txt"
grep -q "Rejected clients" "$work/workers.txt" || fail "the coordinator does not list rejected clients"
grep -q "wrong token" "$work/workers.txt" || fail "the coordinator does not say why it rejected"
expect_exit 4 "no session with coordinator nowhere:7070" --network "$network" \
  -e LOCKSTEP_TOKEN="$LOCKSTEP_TOKEN" "$image" --coordinator=nowhere:7070 --give_up_after=3s
expect_exit 2 "device=cuda:0" --network "$network" -e LOCKSTEP_TOKEN="$LOCKSTEP_TOKEN" "$image" \
  --coordinator=coordinator:7070 --device=cuda:0

# The cli service: lockstepctl inside the cluster network, token from the environment.
"${compose[@]}" --profile cli run --rm cli list >"$work/cli.txt" 2>&1 || { cat "$work/cli.txt"; fail "cli service"; }
grep -q "$job" "$work/cli.txt" || fail "the cli service does not list $job: $(cat "$work/cli.txt")"
log "cli service lists $job"

# ---- coordinators on etcd (docker-compose.ha.yml): the leader's container killed mid-job ----
# The first cluster goes (its images stay); three etcd members, three coordinators and two
# workers come up. The workers hold before step 1500 (test hook), so that the leader's
# container is killed mid-job on any machine. A standby must lead, the workers must come back
# to it with their group as it was (busy, generation 1), and once released the job must
# succeed with exactly its steps, one checksum, one generation and no recovery: the failover
# cost it nothing. The job queued behind it runs. lockstepctl on the host is given all three
# published addresses: a standby names the leader as coordinator-N:7070, which does not resolve
# here, and lockstepctl must go on to the next address.
"${compose[@]}" down --volumes >/dev/null 2>&1 || true
ha_hooks="$work/ha-hooks"
mkdir -m 0777 "$ha_hooks"
ha=(docker-compose -p "${proj}ha" -f "$root/deploy/compose/docker-compose.ha.yml")
hook_override "before_step@1500" "$ha_hooks" "${ha[@]}" >"$work/ha.hooks.yml" ||
  fail "writing the test-hook override of docker-compose.ha.yml"
ha+=(-f "$work/ha.hooks.yml")
ha_ports=()
for i in 1 2 3; do
  ha_ports+=("$(free_port)")
  dashboard_port="$(free_port)"
  export "LOCKSTEP_PORT_$i=${ha_ports[-1]}" "LOCKSTEP_DASHBOARD_PORT_$i=$dashboard_port"
done
SECONDS_BUILD=$SECONDS
"${ha[@]}" build >"$work/ha-build.log" 2>&1 || { tail -n 40 "$work/ha-build.log"; fail "docker-compose.ha.yml: image build failed"; }
log "docker-compose.ha.yml: images built in $((SECONDS - SECONDS_BUILD))s (etcd from Debian's etcd-server)"
"${ha[@]}" up -d --scale worker=2 >"$work/ha-up.log" 2>&1 || { cat "$work/ha-up.log"; fail "docker-compose.ha.yml: up failed"; }
export LOCKSTEP_COORDINATOR="127.0.0.1:${ha_ports[0]},127.0.0.1:${ha_ports[1]},127.0.0.1:${ha_ports[2]}"
# The coordinator (1, 2 or 3) that serves on its own published port.
ha_leader() {
  local i
  for i in 1 2 3; do
    "$ctl" --coordinator="127.0.0.1:${ha_ports[i-1]}" --timeout_ms=1000 health >/dev/null 2>&1 && { echo "$i"; return 0; }
  done
  return 1
}
wait_for 120 "a coordinator on etcd leading" ha_leader
first="$(ha_leader)"
log "coordinator-$first leads ($LOCKSTEP_COORDINATOR)"
wait_for 90 "2 idle workers with the leader" bash -c "(( \$('$ctl' workers | grep -c ' idle ') >= 2 ))"
standby=$((first % 3 + 1))
out="$("$ctl" --coordinator="127.0.0.1:${ha_ports[standby-1]}" list 2>&1)" &&
  fail "coordinator-$standby answered list as a leader: $out"
grep -q "the leader is at coordinator-$first:7070" <<<"$out" ||
  fail "coordinator-$standby does not name coordinator-$first:7070: $out"
"$ctl" --coordinator="127.0.0.1:${ha_ports[standby-1]},127.0.0.1:${ha_ports[first-1]}" list >/dev/null ||
  fail "lockstepctl did not pass over a leader name that does not resolve on the host"
ha_job() {  # ha_job NAME STEPS: a job spec on stdout
  cat <<JOB
{"name": "$1", "model": {"mlp": {"hiddenWidths": [64]}},
 "dataset": {"type": "synthetic", "synthetic": {"trainSamples": 4000, "testSamples": 400,
             "inputDim": 32, "numClasses": 10, "seed": 5}},
 "optimizer": {"type": "sgd", "learningRate": 0.05, "momentum": 0.9},
 "globalBatchSize": 40, "maxSteps": $2, "minWorkers": 2, "maxWorkers": 2, "stepTimeoutMs": 300000}
JOB
}
ha_job compose-ha 3000 >"$work/ha-job.json"
ha_job compose-ha-queued 100 >"$work/ha-queued.json"
job="$("$ctl" submit "$work/ha-job.json")"
queued="$("$ctl" submit "$work/ha-queued.json")"
log "submitted $job, and $queued behind it"
wait_for 120 "the workers holding before step 1500" test -e "$ha_hooks/before_step.reached"
[[ "$(job_field "j['state']")" == JOB_STATE_RUNNING ]] || fail "$job is not RUNNING while its workers hold"
leader_id="$("${ha[@]}" ps -q "coordinator-$first")"
step="$(job_field "j.get('step')")"
killed_at="$(date +%s.%N)"
docker kill "$leader_id" >/dev/null
log "docker kill coordinator-$first (the leader) at step $step"
wait_for 30 "a standby leading" bash -c "$(declare -f ha_leader); ctl=$ctl; ha_ports=(${ha_ports[*]}); i=\$(ha_leader) && [[ \$i != $first ]]"
log "coordinator-$(ha_leader) leads $(python3 -c "import time; print('%.1f' % (time.time() - $killed_at))") s after the kill"
wait_for 60 "both workers back, busy with $job" bash -c "(( \$('$ctl' workers | grep -c ' busy ') >= 2 ))"
log "both workers back $(python3 -c "import time; print('%.1f' % (time.time() - $killed_at))") s after the kill; generation $(job_field "j.get('generation')")"
touch "$ha_hooks/before_step.release"
"$ctl" watch "$job" >"$work/ha-watch.log" 2>&1 || { cat "$work/ha-watch.log"; fail "$job did not succeed after the failover"; }
"$ctl" status "$job"
[[ "$(job_field "j['state']")" == JOB_STATE_SUCCEEDED ]] || fail "$job not SUCCEEDED"
[[ "$(job_field "j['step']")" == 3000 ]] || fail "$job did not run exactly 3000 steps"
checksums="$(job_field "' '.join(sorted(set(m.get('parameterChecksum', '') for m in j['members'])))")"
[[ -n "$checksums" && "$checksums" != *" "* ]] || fail "ranks ended with different parameters: $checksums"
[[ "$(job_field "len(j.get('recoveryHistory', []))")" == 0 ]] ||
  fail "$job was re-formed after the leader's loss: $(job_field "j.get('recoveryHistory')")"
[[ "$(job_field "int(j.get('generation', 0))")" == 1 ]] ||
  fail "$job is in generation $(job_field "j.get('generation')"), not the one it ran before the failover"
log "$job SUCCEEDED through the failover: 3000 steps, generation 1, no recovery, parameters $checksums"
"$ctl" watch "$queued" >"$work/ha-watch-queued.log" 2>&1 || { cat "$work/ha-watch-queued.log"; fail "$queued (queued behind) did not succeed"; }
[[ "$(docker inspect -f '{{.State.Status}}' "$leader_id")" == exited ]] || fail "the killed coordinator was restarted"
"${ha[@]}" down --volumes >/dev/null 2>&1 || true
log "coordinators on etcd: PASS"

# The CUDA worker target: a CUDA build of the worker, bundled onto a base without Lockstep's
# runtime packages. NVIDIA's devel and runtime images are not reachable here, so a stand-in
# made from this host's CUDA toolkit plays both, laid out as NVIDIA's are (/usr/local/cuda
# through /etc/alternatives, NCCL in the system directories). Without a GPU the CUDA build must
# get as far as the driver and refuse --device=cuda:0 saying so (a CPU build would say it has no
# CUDA support).
cuda_root="$(readlink -f /usr/local/cuda 2>/dev/null || true)"
if [[ -x "$cuda_root/bin/nvcc" ]]; then
  ctx="$work/cuda-standin"
  dest="$ctx/usr/local/$(basename "$cuda_root")"
  mkdir -p "$dest/lib" "$ctx/usr/include" "$ctx/usr/lib/x86_64-linux-gnu" "$ctx/etc/alternatives"
  # Hard links: the stand-in's ~1 GB costs no copy (same file system; cp falls back otherwise).
  for part in bin nvvm include targets; do cp -a --link "$cuda_root/$part" "$dest/" 2>/dev/null ||
    cp -a "$cuda_root/$part" "$dest/"; done
  ln -s lib "$dest/lib64"
  for lib in "$cuda_root"/lib/{libcudart.so,libcublas.so,libcublasLt.so}* \
             "$cuda_root"/lib/{libcudart_static,libcudadevrt,libculibos}.a; do
    [[ -e "$lib" ]] && { cp -a --link "$lib" "$dest/lib/" 2>/dev/null || cp -a "$lib" "$dest/lib/"; }
  done
  [[ -d "$cuda_root/lib/cmake" ]] && cp -a "$cuda_root/lib/cmake" "$dest/lib/"
  rm -f "$dest"/include/nccl*.h
  nccl_h="" nccl_so=""
  for f in "$cuda_root/include/nccl.h" /usr/include/nccl.h; do [[ -e "$f" ]] && { nccl_h="$f"; break; }; done
  for d in "$cuda_root/lib" /usr/lib/x86_64-linux-gnu; do [[ -e "$d/libnccl.so.2" ]] && { nccl_so="$d"; break; }; done
  [[ -n "$nccl_h" && -n "$nccl_so" ]] || fail "nvcc is here but NCCL is not (nccl.h, libnccl.so.2)"
  cp "$nccl_h" "$ctx/usr/include/"
  cp -a "$nccl_so"/libnccl.so* "$ctx/usr/lib/x86_64-linux-gnu/"
  ln -s "/usr/local/$(basename "$cuda_root")" "$ctx/etc/alternatives/cuda"
  ln -s /etc/alternatives/cuda "$ctx/usr/local/cuda"
  cat >"$ctx/Dockerfile" <<STANDIN
FROM $base_tag
COPY etc/ /etc/
COPY usr/ /usr/
RUN echo /usr/local/cuda/lib64 >/etc/ld.so.conf.d/000_cuda.conf && ldconfig
STANDIN
  standin="lockstep-e2e/cuda-standin:$LOCKSTEP_TAG"
  log "CUDA stand-in image from $cuda_root ($(du -sh "$ctx" | cut -f1))"
  docker build -q -t "$standin" "$ctx" >"$work/standin.log" 2>&1 || { tail -n 20 "$work/standin.log"; fail "CUDA stand-in image"; }
  rm -rf "$ctx"
  cuda_image="$LOCKSTEP_IMAGE_PREFIX/worker-cuda:$LOCKSTEP_TAG"
  cuda_binaries="$LOCKSTEP_BINARIES"
  if [[ "$cuda_binaries" == prebuilt && ! -x "$root/deploy/docker/prebuilt/bundle-cuda/bin/lockstep-worker" ]]; then
    log "$build has no CUDA worker to bundle: the worker-cuda image compiles inside Docker"
    cuda_binaries=source
  fi
  SECONDS_BUILD=$SECONDS
  docker build -f "$root/deploy/docker/Dockerfile" --target worker-cuda \
    --build-arg BINARIES="$cuda_binaries" \
    --build-arg BUILD_IMAGE="$base_tag" --build-arg RUNTIME_IMAGE="$base_tag" \
    --build-arg CUDA_DEVEL_IMAGE="$standin" --build-arg CUDA_RUNTIME_IMAGE="$standin" \
    -t "$cuda_image" "$root" >"$work/cuda-build.log" 2>&1 || { tail -n 40 "$work/cuda-build.log"; fail "worker-cuda build"; }
  if [[ "$cuda_binaries" == source ]]; then
    grep -q "Lockstep: CUDA" "$work/cuda-build.log" || fail "the worker-cuda build did not enable CUDA: $(grep 'Lockstep:' "$work/cuda-build.log")"
  fi
  # Either way, the image's worker must load the CUDA runtime from the base image.
  libs="$(docker run --rm --entrypoint sh "$cuda_image" -c \
    'LD_LIBRARY_PATH=/opt/lockstep/lib ldd /opt/lockstep/libexec/lockstep-worker' 2>&1 || true)"
  cudart="$(grep -o 'libcudart[^ ]* => /[^ ]*' <<<"$libs" || true)"
  [[ -n "$cudart" ]] || fail "the worker-cuda image's worker does not load libcudart from its base: $(grep -m1 libcudart <<<"$libs" || echo not linked)"
  log "worker-cuda image ($cuda_binaries) built in $((SECONDS - SECONDS_BUILD))s: $cudart"
  expect_exit 2 "no usable CUDA driver" -e LOCKSTEP_TOKEN="$LOCKSTEP_TOKEN" "$cuda_image" \
    --coordinator=127.0.0.1:1 --device=cuda:0
  # The CPU device still works in the CUDA build: it starts and gives up on the bad address.
  expect_exit 4 "no session with coordinator 127.0.0.1:1" -e LOCKSTEP_TOKEN="$LOCKSTEP_TOKEN" \
    "$cuda_image" --coordinator=127.0.0.1:1 --device=cpu --give_up_after=2s
  docker rmi "$cuda_image" "$standin" >/dev/null
else
  log "SKIP the worker-cuda image: no CUDA toolkit at /usr/local/cuda on this host"
fi
log "PASS"
