"""raybench: benchmark LLM fine-tuning configurations as Ray-orchestrated sweeps with Parquet results.

The public API is loaded on first use, so that `import raybench` (and every `raybench.<module>` import, the
worker's included) loads no pyarrow, torch or Ray until something needs them.
"""

from __future__ import annotations

__all__ = ["load_sweep", "plan", "read_results", "run_sweep"]


def __getattr__(name: str):
    if name in __all__:
        from raybench.drivers import api  # the API's modules load pyarrow (the store): on first use only

        return getattr(api, name)
    raise AttributeError(f"module 'raybench' has no attribute {name!r}")
