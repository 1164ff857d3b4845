"""`trainbpf health`: a short, scheduled check of one node, for cron, a systemd timer or
a Slurm prolog on every training node; the fleet view is the site's Prometheus.

One run takes a lock (an overlapping run skips), chooses targets (the given pids, else
processes holding a GPU device file open or whose command line matches a launcher
pattern), records one short trace (the targets' common process tree, or the whole
machine when there is no target or the targets share no tree), analyses it per target
(`trainbpf analyze`'s report) and for the node (run-queue latency, reclaim, dirty
throttling, PSI, NUMA: trainbpf.analyzers.timeline.node), grades every value against
warning/critical thresholds and writes a Prometheus textfile and a JSON document, each
atomically.  The status is the exit code: 0 ok, 1 warning, 2 critical, 3 could not
check.  A hard time limit bounds the run; probes never outlive it (bcc detaches them in
the recorder's `finally`, and the kernel drops whatever a killed process still held).

The modules, in the order a run uses them:

- config:  HealthConfig, thresholds and every default; the TOML file and its checks.
- targets: the processes to grade and the tree to record (/proc through tracer.proctree).
- run:     lock, time limit, recording, assess (analysis of the job, if any, and per target), run_health.
- results: Check, TargetResult (with the trainer's StepMetrics when its CUDA calls were
           traced), HealthResult and the grading.
- outputs: the Prometheus textfile, the JSON document, the summary.
"""
