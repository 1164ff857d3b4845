"""trainbpf.analyzers: pure functions from trace frames to DataFrames (one module per
job), and `analyze` (analyzers/pipeline.py), which runs them in order over a trace."""
