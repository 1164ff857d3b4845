"""Stage 3: the GPU side: the host-side GPU timeline from CUDA calls and the GPU-starvation timeline against the GPU samples."""
