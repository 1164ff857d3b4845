"""Stage 2: why a thread was not doing useful work: the cause of each blocked interval, wake-up chains, host work, NUMA placement and node pressure."""
