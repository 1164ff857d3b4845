"""Stage 3: over time: the host-side GPU timeline from CUDA calls, the GPU-starvation timeline against the GPU samples, and the node-level values the health check grades."""
