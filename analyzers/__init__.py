"""trainbpf.analyzers: pure functions from trace frames to DataFrames (one module per
job), and `analyze` (analyzers/pipeline.py), which runs them in order over a trace."""

from trainbpf.analyzers.categories import CATEGORIES, REGISTRY
from trainbpf.analyzers.pipeline import Analysis, analyze, observed_ns
from trainbpf.analyzers.vocab import STATES

__all__ = ["Analysis", "analyze", "observed_ns", "CATEGORIES", "REGISTRY", "STATES"]
