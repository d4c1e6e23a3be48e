"""Scalar values of a sweep parsed without evaluating anything: sAC ratios, per-trial environment variables,
operator names of an op-level checkpointing policy."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Annotated, Any

from pydantic import BeforeValidator

from raybench.spec.redact import SECRET_PATTERN

_FRACTION = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
_DECIMAL = re.compile(r"^\s*\d+(\.\d+)?\s*$")


def parse_ratio(value: Any) -> Fraction:
    """Parse an AC ratio given as a number, "0.25" or "3/4" into an exact Fraction in [0, 1]. Never evaluates."""
    if isinstance(value, bool):
        raise ValueError("expected a number in [0, 1] or a fraction like '3/4', not a boolean")
    if isinstance(value, (int, float)):
        ratio = Fraction(str(value))
    elif isinstance(value, str) and (m := _FRACTION.match(value)):
        if int(m.group(2)) == 0:
            raise ValueError("fraction has a zero denominator; write a ratio in [0, 1] such as '3/4'")
        ratio = Fraction(int(m.group(1)), int(m.group(2)))
    elif isinstance(value, str) and _DECIMAL.match(value):
        ratio = Fraction(value.strip())
    else:
        raise ValueError("expected a number in [0, 1] or a fraction like '3/4' (expressions are not evaluated)")
    if not 0 <= ratio <= 1:
        raise ValueError(f"ratio {ratio} is outside [0, 1]; 0 checkpoints no block, 1 every block")
    return ratio


def canonical_ratio(value: Any) -> str:
    # One spelling per ratio ("0.5" and "1/2" both become "1/2") so equal configs hash to the same trial id.
    return str(parse_ratio(value))


Ratio = Annotated[str, BeforeValidator(canonical_ratio)]

# A trial may tune communication, threading and compiler knobs, but not redirect what runs (PATH, LD_PRELOAD,
# PYTHONPATH) or leak into the launcher: only these prefixes are accepted in train.env.
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "CUDA_", "OMP_", "MKL_", "KMP_", "UCX_",
                "FI_", "DS_")
# glibc's mmap threshold: raybench sets it on CPU trials (spec.payload); a trial may set its own, or "" for none.
MALLOC_MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
# glibc ignores a threshold above its DEFAULT_MMAP_THRESHOLD_MAX: 4 MiB x sizeof(long) on 64-bit (mallopt(3)).
MALLOC_MMAP_THRESHOLD_MAX_BYTES = 32 * 1024 * 1024
_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


def check_env(value: Any) -> Any:
    """train.env: names from ENV_PREFIXES (or MALLOC_MMAP_THRESHOLD_), scalar values (numbers become strings, as a
    shell would pass them)."""
    if not isinstance(value, dict):
        raise ValueError("expected a mapping of environment variable names to values, e.g. {NCCL_BUFFSIZE: 4194304}")
    out = {}
    for name, val in value.items():
        if name == MALLOC_MMAP_THRESHOLD:
            out[name] = _mmap_threshold(val)
            continue
        if not isinstance(name, str) or not _ENV_NAME.match(name) or not name.startswith(ENV_PREFIXES):
            raise ValueError(f"variable {name!r} is not allowed; use an upper-case name starting with one of "
                             f"{', '.join(ENV_PREFIXES)}, or {MALLOC_MMAP_THRESHOLD}")
        if SECRET_PATTERN.search(name):  # the sweep's config is stored with every row: no secrets in it
            raise ValueError(f"variable {name!r} looks like a secret; secrets must not be in a sweep file (it is "
                             "stored with every result row): export it in the environment that launches raybench")
        if isinstance(val, bool) or not isinstance(val, (str, int, float)):
            raise ValueError(f"{name}: value {val!r} must be a string or a number")
        out[name] = str(val)
    return out


def _mmap_threshold(value: Any) -> str:
    """MALLOC_MMAP_THRESHOLD_'s value: bytes glibc accepts, or "" (raybench sets none). An empty value must never
    reach glibc, which reads it as 0: every allocation mapped."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if text == "" or (text is not None and text.isdigit() and int(text) <= MALLOC_MMAP_THRESHOLD_MAX_BYTES):
        return text
    raise ValueError(f"{MALLOC_MMAP_THRESHOLD}: value {value!r} must be bytes from 0 to "
                     f"{MALLOC_MMAP_THRESHOLD_MAX_BYTES} (glibc ignores more), e.g. 131072, or '' to set none "
                     "(glibc's own threshold, which rises as large blocks are freed)")


_SAVED_OP = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(#[0-9]+)?")


def check_saved_ops(value: Any) -> Any:
    if isinstance(value, list):
        bad = [entry for entry in value if not (isinstance(entry, str) and _SAVED_OP.fullmatch(entry))]
        if bad:
            raise ValueError(f"{bad[0]!r} is not an operator name or name#call (e.g. mm, sdpa, mul#2)")
    return value
