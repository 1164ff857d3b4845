#!/usr/bin/env bash
# Set everything up, start the bundled demo trainer (a toy training loop with dataloader
# threads and a periodic checkpoint), record it for 10 s and print what trainbpf found.
# Without a real GPU the demo's simulated GPU is sampled through scripts/fake-nvidia-smi.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
TRAINBPF="$ROOT/.venv/bin/trainbpf"
OUT="${TRAINBPF_DEMO_DIR:-$ROOT/out}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
trap 'kill "$DEMO_PID" 2>/dev/null || true; rm -rf "$WORK"' EXIT

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "[demo] no nvidia-smi here: sampling the demo's simulated GPU instead" >&2
  ln -s "$ROOT/scripts/fake-nvidia-smi" "$WORK/nvidia-smi"
  export PATH="$WORK:$PATH"
fi
export TRAINBPF_SIM_GPU="$WORK/sim-gpu"

# Under sudo the recorder traces only the invoking user's own processes and writes where
# that user may (docs/security.md): so the demo trainer runs as that user, in folders of
# theirs.
AS_USER=()
if [ -n "${SUDO_UID:-}" ] && [ "$SUDO_UID" != 0 ]; then
  AS_USER=(setpriv --reuid="$SUDO_UID" --regid="$SUDO_GID" --clear-groups)
  chown "$SUDO_UID:$SUDO_GID" "$WORK"
  [ "$(stat -c %u "$OUT")" = "$SUDO_UID" ] || [ "$OUT" != "$ROOT/out" ] || chown "$SUDO_UID:$SUDO_GID" "$OUT"
fi

"${AS_USER[@]}" "$ROOT/.venv/bin/python" "$ROOT/scripts/workloads/demo_trainer.py" --seconds 30 > "$WORK/demo.log" &
DEMO_PID=$!
sleep 1
echo "[demo] recording the demo trainer (pid $DEMO_PID) for 10 s" >&2
"$TRAINBPF" record --pid "$DEMO_PID" --duration 10 --force -o "$OUT/demo-trace.parquet"
"$TRAINBPF" analyze "$OUT/demo-trace.parquet"
"$TRAINBPF" analyze "$OUT/demo-trace.parquet" --format html --force -o "$OUT/demo-report.html"
echo "[demo] trace: $OUT/demo-trace.parquet  report: $OUT/demo-report.html" >&2
