"""bench/public_results.yaml, the pre-registered corpus of published measurements, and its loader
(bench/public_results.py): the file loads and meets the corpus's own terms (entries, sources, multi-GPU, LoRA);
a malformed entry is refused naming the entry and the field. Reads YAML only; rehearses nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests import bench_script

REPO = Path(__file__).resolve().parents[2]
pr = bench_script.load(bench_script.BENCH / "public_results.py")


def test_the_corpus_loads_and_meets_its_terms():
    entries = pr.load()
    assert len(entries) >= 20
    sources = {(e.source.get("repo"), e.source.get("path")) for e in entries}
    assert len(sources) >= 5
    multi_gpu = [e for e in entries if 8 <= e.gpus <= 512]
    assert len(multi_gpu) > len(entries) / 2
    assert any(e.config["finetune"] == "lora" and e.not_expressible is None for e in entries)
    assert all(6.5e9 <= _params(e.model) <= 75e9 for e in entries)  # "7B" models: Llama 2 7B has 6.7B
    assert all(e.not_expressible or e.published_step_s > 0 for e in entries)
    # every published memory figure says what it measures, in GiB whatever the source's label
    kempner = next(e for e in entries if e.id == "kempnerforge-h200-7b-1gpu-single")
    assert kempner.memory["unit"] == "GiB" and kempner.published_memory_gib == kempner.published["memory_gb"]
    assert all(e.memory for e in entries if e.published_memory_gib is not None or "memory_gb" in e.published)


def _params(model: dict) -> float:
    """Parameters of a Llama-style decoder from its shape (embedding and head untied)."""
    h, kv = model["hidden"], model["hidden"] // model["heads"] * model["kv_heads"]
    block = 2 * h * h + 2 * h * kv + 3 * h * model["ffn"]
    return model["layers"] * block + 2 * model["vocab"] * h


def _write(tmp_path: Path, change) -> Path:
    data = yaml.safe_load((REPO / "bench" / "public_results.yaml").read_text())
    change(data["entries"][0])
    path = tmp_path / "corpus.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("change, words", [
    (lambda e: e.pop("published"), "missing keys ['published']"),
    (lambda e: e["published"].update(mfu=56.8), "published.mfu is 56.8: a fraction"),
    (lambda e: e["published"].update(tokens_s=1.0), "published.tokens_s is not a known figure"),
    (lambda e: e["published"].update(step_time_s=1.0), "implies 8192 tokens/s per GPU"),
    (lambda e: e["config"].update(seq=8192), "config.seq is not a known field"),
    (lambda e: e["config"].update(strategy="pp"), "config.strategy is 'pp'"),
    (lambda e: e["config"].update(dp=8), "dp x tp x cp x sp = 8 but nodes x gpus_per_node = 64"),
    (lambda e: e["model"].update(ffn=0), "model.ffn is 0"),
    (lambda e: e["source"].update(commit="main"), "is not a 40-digit hexadecimal commit"),
    (lambda e: e["published"].update(memory_gib=70.0), "published memory needs `memory:`"),
    (lambda e: e.update(memory={"measures": "max_reserved", "unit": "GiB", "cite": "x"}),
     "memory: is given but published has no memory"),
    (lambda e: (e["published"].update(memory_gib=70.0), e.update(memory={"measures": "nvidia-smi", "unit": "GiB",
                                                                           "cite": "x"})),
     "memory.measures is 'nvidia-smi'"),
])
def test_a_malformed_entry_is_refused_naming_it_and_the_field(tmp_path, change, words):
    path = _write(tmp_path, change)
    with pytest.raises(pr.CorpusError) as err:
        pr.load(path)
    assert "torchtitan-a100-llama3-8b-sel-layer" in str(err.value)
    assert words in str(err.value)
