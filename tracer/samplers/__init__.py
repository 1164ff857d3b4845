"""Sources polled from user space while recording: GPU utilisation (NVML, nvidia-smi), /proc and /sys, taskstats."""
