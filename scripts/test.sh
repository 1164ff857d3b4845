#!/usr/bin/env bash
# Set everything up (as scripts/setup.sh --test) and run the whole test suite as root.
# pytest's "no tests ran" (exit 5) counts as failure.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh" --test || exit $?
cd "$ROOT"
"$ROOT/.venv/bin/python" -m pytest -p no:cacheprovider -ra --durations=25 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
