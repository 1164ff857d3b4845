#!/usr/bin/env bash
# Set everything up (as scripts/setup.sh --test) and run the whole test suite as root.
# pytest's "no tests ran" (exit 5) counts as failure.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh" --test || exit $?
cd "$ROOT"
# The suite runs as root; the tests of sudo's rules set SUDO_UID/SUDO_GID themselves.
# Inherited from `sudo scripts/test.sh`, they would make every recording the invoking
# user's (only their processes traced, outputs opened with their rights).
unset SUDO_UID SUDO_GID SUDO_USER SUDO_COMMAND
"$ROOT/.venv/bin/python" -m pytest -p no:cacheprovider -ra --durations=25 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
