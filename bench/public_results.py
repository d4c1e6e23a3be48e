"""The pre-registered corpus of published training measurements (bench/public_results.yaml): loaded and checked.

Each entry is one row of a public benchmark table: where it comes from (repository, path and commit, or a URL or
paper, and the table), the GPU, interconnect and node layout, the model's shape, every configuration field the
source states, the published figures and what was assumed where the source is silent. `load()` refuses a file
with a missing key, an unknown key, a value of the wrong kind or unit, or figures that contradict each other
(a published step time and tokens/s per GPU that disagree with the entry's tokens per step), naming the entry
and the field. bench/rehearse_public.py predicts the entries; tests/unit/test_public_results.py checks the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

CORPUS = Path(__file__).resolve().parent / "public_results.yaml"

REQUIRED = ("id", "source", "gpu", "interconnect", "nodes", "gpus_per_node", "model", "config", "published")
OPTIONAL = ("assumed", "seen", "not_expressible", "note", "memory")
MODEL_NUMBERS = ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab")
STRATEGIES = ("single", "fsdp", "hsdp", "tp", "fsdp+tp", "fsdp+cp", "zero3")
PRECISIONS = ("bf16", "fp8-tensorwise")
AC_KINDS = ("none", "full", "selective-op", "selective-layer")
FINETUNES = ("full", "lora", "qlora")
OPTIMIZERS = ("adamw", "adamw_fused")
MASTER_WEIGHTS = ("fp32", "none")  # none: pure bf16 (weights, gradients and optimizer state), raybench's train field
# Configuration fields and the kind of value each holds.
CONFIG_FIELDS = {"strategy": str, "dp": int, "tp": int, "cp": int, "sp": int, "seq_len": int, "micro_batch": int,
                 "grad_accum": int, "global_batch": int, "precision": str, "fp8_all_gather": bool, "ac": str,
                 "ac_every": int, "compile": bool, "optimizer": str, "finetune": str, "lora": dict, "packed": bool,
                 "cpu_offload": bool, "async_tp": bool, "master_weights": str}
# Published figures, by unit: tokens per second per GPU, seconds per optimizer step, a fraction, memory per GPU.
PUBLISHED_FIELDS = ("tokens_per_gpu_s", "step_time_s", "mfu", "memory_gib", "memory_gb")
# What a published memory figure measures (the source's own code says): the reserved peak, or a tensor peak.
MEMORY_MEASURES = ("max_reserved", "max_allocated", "max_active")
# not_comparable: why raybench cannot run the source's configuration (not scored); differs: what the source's stack
# does that raybench's trial does not, which the scored error holds.
MEMORY_KEYS = {"measures", "unit", "cite", "not_comparable", "differs"}
# A published step time and tokens/s per GPU agree with the entry's tokens per step to this (rounding in tables).
CONSISTENCY = 0.03


class CorpusError(ValueError):
    """The corpus file is malformed: the message names the entry and the field."""


@dataclass(frozen=True)
class PublicEntry:
    id: str
    source: dict
    gpu: str
    interconnect: str
    nodes: int
    gpus_per_node: int
    model: dict
    config: dict
    published: dict
    assumed: dict = field(default_factory=dict)
    seen: str | None = None  # the commit from which this entry was looked at while changing the model
    not_expressible: str | None = None  # why raybench cannot rehearse it
    note: str | None = None
    memory: dict | None = None  # what the published memory figure measures: measures, unit, cite (MEMORY_KEYS)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def tokens_per_gpu_step(self) -> float:
        """Tokens one GPU's share of an optimizer step holds: its data-parallel group's micro-batches, split over
        the tensor-, context- and sequence-parallel ranks that work on them together."""
        c = self.config
        tokens = c["micro_batch"] * c.get("grad_accum", 1) * c["seq_len"]
        return tokens / (c.get("tp", 1) * c.get("cp", 1) * c.get("sp", 1))

    @property
    def published_step_s(self) -> float:
        """The published step time, else the one the published tokens/s per GPU implies."""
        if "step_time_s" in self.published:
            return self.published["step_time_s"]
        return self.tokens_per_gpu_step / self.published["tokens_per_gpu_s"]

    @property
    def published_memory_gib(self) -> float | None:
        """The published memory figure in GiB, as the source's code measured it (memory.unit), whatever its label."""
        value = self.published.get("memory_gib", self.published.get("memory_gb"))
        if value is None:
            return None
        return value if self.memory["unit"] == "GiB" else value * 1e9 / 2**30

    @property
    def published_tokens_per_gpu_s(self) -> float:
        if "tokens_per_gpu_s" in self.published:
            return self.published["tokens_per_gpu_s"]
        return self.tokens_per_gpu_step / self.published["step_time_s"]


def _fail(entry_id: str, message: str) -> None:
    raise CorpusError(f"bench/public_results.yaml, entry {entry_id!r}: {message}")


def _check_source(eid: str, source) -> None:
    if not isinstance(source, dict) or "table" not in source:
        _fail(eid, "source must be a mapping with a `table` (which table or row of the source)")
    if "repo" in source:
        missing = [k for k in ("repo", "path", "commit") if not source.get(k)]
        if missing:
            _fail(eid, f"source names a repo but lacks {missing}: give repo, path and commit")
        if not re.fullmatch(r"[0-9a-f]{40}", str(source["commit"])):
            _fail(eid, f"source.commit {source['commit']!r} is not a 40-digit hexadecimal commit")
    elif not (source.get("url") or source.get("paper")):
        _fail(eid, "source needs repo + path + commit, or a url or paper")


def _check_model(eid: str, model) -> None:
    if not isinstance(model, dict) or not isinstance(model.get("name"), str):
        _fail(eid, "model must be a mapping with a name")
    for key in MODEL_NUMBERS:
        value = model.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            _fail(eid, f"model.{key} is {value!r}: give the published config's positive integer")
    if model["heads"] % model["kv_heads"] or model["hidden"] % model["heads"]:
        _fail(eid, f"model heads {model['heads']} / kv_heads {model['kv_heads']} / hidden {model['hidden']} "
                   "do not divide: check the published config")


def _check_config(eid: str, config) -> None:
    if not isinstance(config, dict):
        _fail(eid, "config must be a mapping")
    for key, value in config.items():
        kind = CONFIG_FIELDS.get(key)
        if kind is None:
            _fail(eid, f"config.{key} is not a known field ({', '.join(CONFIG_FIELDS)})")
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 1)):
            _fail(eid, f"config.{key} is {value!r}: expected {'a positive integer' if kind is int else kind.__name__}")
    for key in ("strategy", "seq_len", "micro_batch", "precision", "finetune"):
        if key not in config:
            _fail(eid, f"config.{key} is missing")
    for key, allowed in (("strategy", STRATEGIES), ("precision", PRECISIONS), ("ac", AC_KINDS),
                         ("finetune", FINETUNES), ("optimizer", OPTIMIZERS), ("master_weights", MASTER_WEIGHTS)):
        if key in config and config[key] not in allowed:
            _fail(eid, f"config.{key} is {config[key]!r}: one of {', '.join(allowed)}")
    if config.get("ac") == "selective-layer" and "ac_every" not in config:
        _fail(eid, "config.ac selective-layer needs ac_every (one block in how many is checkpointed)")


def _check_published(eid: str, published, entry: PublicEntry) -> None:
    if not isinstance(published, dict) or not published:
        _fail(eid, "published must be a mapping of figures")
    for key, value in published.items():
        if key not in PUBLISHED_FIELDS:
            _fail(eid, f"published.{key} is not a known figure ({', '.join(PUBLISHED_FIELDS)}; units in the name)")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            _fail(eid, f"published.{key} is {value!r}: a positive number")
    if "tokens_per_gpu_s" not in published and "step_time_s" not in published:
        _fail(eid, "published needs tokens_per_gpu_s or step_time_s")
    if "mfu" in published and published["mfu"] >= 1:
        _fail(eid, f"published.mfu is {published['mfu']}: a fraction (0.568 for 56.8%)")
    if "tokens_per_gpu_s" in published and "step_time_s" in published:
        implied = entry.tokens_per_gpu_step / published["step_time_s"]
        if abs(implied / published["tokens_per_gpu_s"] - 1) > CONSISTENCY:
            _fail(eid, f"published step_time_s {published['step_time_s']} implies {implied:.0f} tokens/s per GPU "
                       f"from the config's tokens per step, not the published {published['tokens_per_gpu_s']}")


def _check_memory(eid: str, memory, published: dict) -> None:
    """A published memory figure says what it measures, in which unit, and where the source's code shows it."""
    has_figure = any(k.startswith("memory") for k in published)
    if memory is None:
        if has_figure:
            _fail(eid, "published memory needs `memory:` (measures, unit, cite): what the source's code reports")
        return
    if not has_figure:
        _fail(eid, "memory: is given but published has no memory_gib or memory_gb")
    if not isinstance(memory, dict) or set(memory) - MEMORY_KEYS or not {"measures", "unit", "cite"} <= set(memory):
        _fail(eid, f"memory must map measures, unit and cite (and optionally not_comparable, differs), not "
                   f"{memory!r}")
    if memory["measures"] not in MEMORY_MEASURES:
        _fail(eid, f"memory.measures is {memory['measures']!r}: one of {', '.join(MEMORY_MEASURES)}")
    if memory["unit"] not in ("GiB", "GB"):
        _fail(eid, f"memory.unit is {memory['unit']!r}: GiB (2^30 bytes) or GB (10^9), as the source's code divides")


def _entry(raw) -> PublicEntry:
    eid = raw.get("id") if isinstance(raw, dict) else None
    if not isinstance(eid, str) or not eid:
        raise CorpusError(f"bench/public_results.yaml: an entry without an id: {str(raw)[:120]}")
    unknown = set(raw) - set(REQUIRED) - set(OPTIONAL)
    if unknown:
        _fail(eid, f"unknown keys {sorted(unknown)} (known: {', '.join(REQUIRED + OPTIONAL)})")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        _fail(eid, f"missing keys {missing}")
    _check_source(eid, raw["source"])
    _check_model(eid, raw["model"])
    _check_config(eid, raw["config"])
    for key in ("nodes", "gpus_per_node"):
        if not isinstance(raw[key], int) or raw[key] < 1:
            _fail(eid, f"{key} is {raw[key]!r}: a positive integer")
    assumed = raw.get("assumed") or {}
    if not isinstance(assumed, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in assumed.items()):
        _fail(eid, "assumed must map each assumed field to what was assumed and why")
    if "seen" in raw and not re.fullmatch(r"[0-9a-f]{7,40}", str(raw["seen"])):
        _fail(eid, f"seen is {raw['seen']!r}: the commit from which the entry was seen")
    _check_memory(eid, raw.get("memory"), raw["published"] if isinstance(raw["published"], dict) else {})
    entry = PublicEntry(**{**raw, "assumed": assumed})
    c = entry.config
    parallel = c.get("dp", 1) * c.get("tp", 1) * c.get("cp", 1) * c.get("sp", 1)
    if "dp" in c and parallel != entry.gpus:
        _fail(eid, f"dp x tp x cp x sp = {parallel} but nodes x gpus_per_node = {entry.gpus}")
    _check_published(eid, raw["published"], entry)
    return entry


def load(path: Path = CORPUS) -> list[PublicEntry]:
    """Every entry of the corpus, checked; CorpusError naming the entry and field otherwise."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise CorpusError(f"{path}: expected a mapping with an `entries` list")
    unknown = set(data) - {"entries", "shared"}
    if unknown:
        raise CorpusError(f"{path}: unknown top-level keys {sorted(unknown)} (entries, shared)")
    entries = [_entry(raw) for raw in data["entries"]]
    ids = [e.id for e in entries]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise CorpusError(f"{path}: entry ids used more than once: {repeated}")
    return entries
