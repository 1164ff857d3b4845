"""Stage 1 of the analysis: every traced thread's state intervals and its role."""
