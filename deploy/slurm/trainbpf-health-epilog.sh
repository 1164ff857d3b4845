#!/bin/bash
# Slurm epilog (slurm.conf: Epilog=/etc/slurm/epilog.d/*): stop the job's check timer
# that trainbpf-health-prolog.sh started, if the job ended before it fired.  Always
# exits 0: an epilog that fails drains the node.
systemctl stop "trainbpf-health-job-${SLURM_JOB_ID:-none}.timer" >/dev/null 2>&1 || true
exit 0
