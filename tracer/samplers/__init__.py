"""Sources polled from user space while recording: GPU utilisation (NVML, nvidia-smi), /proc and /sys, taskstats, each traced process's rank variables (/proc/PID/environ)."""
