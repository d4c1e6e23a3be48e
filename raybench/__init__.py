"""raybench: benchmark LLM fine-tuning configurations as Ray-orchestrated sweeps with Parquet results."""

from raybench.api import load_sweep, plan, read_results, run_sweep

__all__ = ["load_sweep", "plan", "read_results", "run_sweep"]
