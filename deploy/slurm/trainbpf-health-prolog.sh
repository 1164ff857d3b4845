#!/bin/bash
# Slurm prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/*), run as root on every node of
# a job.  A prolog that exits non-zero drains the node and requeues the job, so this one
# always exits 0, whatever the check's verdict (docs/deploy.md, "Slurm").
#
#  1. Before the job starts there is no training process yet: check the node (~3 s of
#     recording plus probe compilation).
#  2. Start a transient systemd timer that checks the job once it runs (two minutes in);
#     the epilog stops it if the job ends first.  The timer runs this script again with
#     --job-check JOBID: it checks only while the job's cgroup still holds a process.
#
# Settings (environment, else these defaults):
#   TRAINBPF_HEALTH          the wrapper (scripts/trainbpf-health, linked here)
#   TRAINBPF_HEALTH_SHARED   folder of the JSON documents for `trainbpf fleet`
#   TRAINBPF_TEXTFILE_DIR    node_exporter's textfile folder
#   TRAINBPF_JOB_CHECK_DELAY seconds from the job's start to its check
#   TRAINBPF_SLURM_CGROUPS   cgroup roots where Slurm puts jobs (v2: the unified root,
#                            v1: each controller's root)
set -u
health="${TRAINBPF_HEALTH:-/usr/local/sbin/trainbpf-health}"
shared="${TRAINBPF_HEALTH_SHARED:-/shared/trainbpf-health}"
textfile_dir="${TRAINBPF_TEXTFILE_DIR:-/var/lib/prometheus/node-exporter}"
delay="${TRAINBPF_JOB_CHECK_DELAY:-120}"
host="$(hostname)"

# Whether job $1 still has a process: Slurm's job cgroup is
# ROOT/system.slice/slurmstepd.scope/job_ID (cgroup v2) or
# ROOT/slurm/uid_UID/job_ID (v1), its processes in the step and task cgroups below it.
job_running() {
  local root dir
  # shellcheck disable=SC2086  # a list of roots, split on spaces
  for root in ${TRAINBPF_SLURM_CGROUPS:-/sys/fs/cgroup /sys/fs/cgroup/*}; do
    for dir in "$root/system.slice/slurmstepd.scope/job_$1" "$root"/slurm/uid_*/"job_$1"; do
      [ -d "$dir" ] || continue
      if find "$dir" -name cgroup.procs -exec cat {} + 2>/dev/null | grep -q .; then
        return 0
      fi
    done
  done
  return 1
}

if [ "${1:-}" = "--job-check" ]; then
  job="${2:?--job-check needs the job id}"
  # The job ended before its check (and the epilog has not stopped the timer yet):
  # a check now would see another job's processes, or none.
  job_running "$job" || exit 0
  exec "$health" --textfile-dir "$textfile_dir" --json "$shared/$host.json"
fi

job="${SLURM_JOB_ID:-}"
if [ -z "$job" ]; then
  echo "trainbpf-health-prolog: SLURM_JOB_ID is not set (run it as a Slurm prolog)" >&2
  exit 0
fi
"$health" --duration 3 --json "$shared/$host-prolog.json" >/dev/null 2>&1
# A transient unit starts with systemd's environment, not this one: pass the settings on.
systemd-run --quiet --unit="trainbpf-health-job-$job" --on-active="$delay" \
  --setenv=TRAINBPF_HEALTH="$health" --setenv=TRAINBPF_HEALTH_SHARED="$shared" \
  --setenv=TRAINBPF_TEXTFILE_DIR="$textfile_dir" \
  ${TRAINBPF_SLURM_CGROUPS:+--setenv=TRAINBPF_SLURM_CGROUPS="$TRAINBPF_SLURM_CGROUPS"} \
  "$(readlink -f "${BASH_SOURCE[0]}")" --job-check "$job" >/dev/null 2>&1 || true
exit 0
