#!/usr/bin/env bash
# Static checks of deploy/: every compose file passes `docker-compose config -q` (and refuses to
# start without a token, naming it), every systemd unit passes `systemd-analyze verify` with no
# finding at all, and the Dockerfile has the targets the compose files use. docker-compose.ha.yml
# (coordinators on etcd) publishes three coordinators that advertise themselves, on three etcd
# members.
# Usage: tests/deploy/config_test.sh BUILD_DIR   Exit 77 (skipped) when a tool is missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="$(realpath "${1:?usage: config_test.sh BUILD_DIR}")"
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
skipped=0

if command -v docker-compose >/dev/null; then
  cd "$root/deploy/compose"
  LOCKSTEP_TOKEN=t docker-compose -f docker-compose.yml config -q || fail "docker-compose.yml"
  LOCKSTEP_TOKEN=t docker-compose -f docker-compose.yml -f docker-compose.gpu.yml config -q ||
    fail "docker-compose.yml + docker-compose.gpu.yml"
  LOCKSTEP_TOKEN=t docker-compose -f docker-compose.yml --profile cli config -q || fail "profile cli"
  LOCKSTEP_TOKEN=t docker-compose -f docker-compose.ha.yml --profile cli config -q ||
    fail "docker-compose.ha.yml"
  # Coordinators on etcd: three of them, each naming itself, on three etcd members, published on
  # loopback; none keeps its state in a --state_dir.
  ha="$(LOCKSTEP_TOKEN=t docker-compose -f docker-compose.ha.yml config)"
  for i in 1 2 3; do
    grep -qE -- "- 127\.0\.0\.1:707$i:7070(/tcp)?\$" <<<"$ha" ||
      fail "docker-compose.ha.yml: coordinator-$i is not published on 127.0.0.1:707$i"
    grep -q -- "--advertise_address=coordinator-$i:7070" <<<"$ha" ||
      fail "docker-compose.ha.yml: coordinator-$i does not advertise itself"
    grep -q "ETCD_NAME: etcd-$i" <<<"$ha" || fail "docker-compose.ha.yml: no etcd member etcd-$i"
  done
  grep -q -- "--state_dir" <<<"$ha" && fail "docker-compose.ha.yml: a coordinator has a --state_dir"
  grep -q -- "--coordinator=coordinator-1:7070,coordinator-2:7070,coordinator-3:7070" <<<"$ha" ||
    fail "docker-compose.ha.yml: the workers are not given every coordinator"
  # Published on loopback only unless asked otherwise.
  resolved="$(LOCKSTEP_TOKEN=t docker-compose config)"
  grep -qE -- '- 127\.0\.0\.1:7070:7070(/tcp)?$' <<<"$resolved" ||
    fail "the coordinator port is not bound to 127.0.0.1 by default"
  # Users compile from source unless they ask for staged binaries (docs/deploy.md).
  grep -qE '^ +BINARIES: source$' <<<"$resolved" ||
    fail "the images do not build from source by default (BINARIES: source)"
  for file in docker-compose.yml docker-compose.ha.yml; do
    if out="$(env -u LOCKSTEP_TOKEN docker-compose -f "$file" config -q 2>&1)"; then
      fail "$file: docker-compose accepted a configuration without LOCKSTEP_TOKEN"
    elif ! grep -q "set LOCKSTEP_TOKEN" <<<"$out"; then
      fail "$file: no clear message without LOCKSTEP_TOKEN: $out"
    fi
  done
  echo "compose files: ok"
else
  echo "docker-compose not installed: compose checks skipped"
  skipped=1
fi

for target in coordinator worker worker-cuda worker-torch prometheus etcd; do
  grep -qE "^FROM .* AS $target\$" "$root/deploy/docker/Dockerfile" ||
    fail "deploy/docker/Dockerfile has no target $target"
done

if command -v systemd-analyze >/dev/null; then
  # verify checks that ExecStart= exists, so point the units at this build's binaries.
  units="$(mktemp -d)"
  trap 'rm -rf "$units"' EXIT
  for unit in "$root"/deploy/systemd/*.service; do
    sed -e "s|/usr/local/bin/lockstep-coordinator|$build/coordinator/lockstep-coordinator|" \
        -e "s|/usr/local/bin/lockstep-worker|$build/worker/lockstep-worker|" \
        "$unit" >"$units/$(basename "$unit")"
  done
  out="$(cd "$units" && systemd-analyze verify ./lockstep-coordinator.service \
    ./lockstep-worker@0.service 2>&1)" || fail "systemd-analyze verify: $out"
  # verify exits 0 on warnings such as unknown keys; any finding about our units fails.
  if grep -q "lockstep" <<<"$out"; then fail "systemd-analyze verify findings: $out"; fi
  echo "systemd units: ok"
else
  echo "systemd-analyze not available: unit checks skipped"
  skipped=1
fi

((failures == 0)) || exit 1
((skipped == 0)) || exit 77
echo "PASS"
