#!/usr/bin/env bash
# One-step set-up on a fresh Debian/Ubuntu machine: system packages (bcc from the
# distribution, kernel headers, tools the tests use), a venv that sees Debian's bcc, and
# the project installed into it.  Idempotent: a second run only checks and returns.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TRAINBPF_VENV:-$ROOT/.venv}"
STAMP="$VENV/.trainbpf-setup"
WITH_TEST=0
WITH_BENCH=0
for arg in "$@"; do
  case "$arg" in
    --test) WITH_TEST=1 ;;
    --bench) WITH_BENCH=1 ;;
    *) echo "usage: scripts/setup.sh [--test] [--bench]" >&2; exit 2 ;;
  esac
done

log() { printf '[setup] %s\n' "$*" >&2; }

# pip, with its output shown only when it fails (some machines' pip configs warn on
# every call about local package folders that do not exist)
pip_quiet() {
  local out
  if ! out="$("$VENV/bin/pip" "$@" 2>&1)"; then
    printf '%s\n' "$out" >&2
    return 1
  fi
}

if [ "$(id -u)" -ne 0 ]; then
  echo "setup: run as root (sudo scripts/setup.sh): it installs system packages" >&2
  exit 1
fi

# bcc comes from the distribution (PyPI's "bcc" is an unrelated package).
# libc6-dbg: glibc's local symbols (main_arena, the allocator's lock) name the futex a
# trainer waits on (tracer/symbols/addrs.py).
APT_PACKAGES=(python3-bpfcc bpfcc-tools libbpfcc python3-venv python3-dev bpftool linux-headers-amd64 libc6-dbg)
if [ "$WITH_TEST" -eq 1 ]; then
  # node_exporter for the health-check test, chromium for the HTML screenshot test,
  # sudo for the documented `sudo .venv/bin/trainbpf` invocation, gcc for the stand-in
  # NVML library (scripts/fake-nvml), prometheus for promtool (tests/test_deploy.py
  # checks and unit-tests deploy/prometheus/'s rules)
  APT_PACKAGES+=(prometheus-node-exporter chromium sudo gcc prometheus)
fi
if [ "$WITH_BENCH" -eq 1 ]; then
  # scripts/bench_*.py: gcc builds the context-switch storm, perf is a comparator
  APT_PACKAGES+=(gcc linux-perf)
fi
[ "$(uname -m)" = x86_64 ] || APT_PACKAGES=("${APT_PACKAGES[@]/linux-headers-amd64/linux-headers-$(dpkg --print-architecture)}")

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # Only promtool is wanted from the prometheus package: not a server on port 9090.
  if [[ " ${missing[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null; then
    systemctl disable --now prometheus.service >/dev/null 2>&1 || true
  fi
fi

# tracefs is where bcc reads tracepoint layouts; some machines do not mount it.
if [ ! -e /sys/kernel/tracing/events ]; then
  mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || log "could not mount tracefs (trainbpf doctor explains)"
fi

# The venv uses Debian's interpreter so that python3-bpfcc is importable.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi

# The stamp records pyproject.toml's hash and the extras installed.  Extras accumulate:
# a run keeps what an earlier one asked for (`--bench` after `--test` keeps [test]), so
# alternating flags neither reinstalls nor drops anything.
had="$(cat "$STAMP" 2>/dev/null || true)"
extra=""
if [ "$WITH_TEST" -eq 1 ] || [ "${had%"[test]"}" != "$had" ]; then extra="[test]"; fi
want="$(sha256sum < "$ROOT/pyproject.toml" | cut -c1-16)$extra"
if [ "$had" != "$want" ]; then
  log "installing trainbpf$extra into the venv"
  pip_quiet install --disable-pip-version-check -e "$ROOT$extra"
  echo "$want" > "$STAMP"
fi

# Build the kernel header tree bcc needs now, so the first record does not pay for it.
"$VENV/bin/python" -c "from trainbpf.tracer.kheaders import use_headers; print('[setup] kernel headers:', use_headers().origin)" >&2
log "ready: $VENV/bin/trainbpf"
