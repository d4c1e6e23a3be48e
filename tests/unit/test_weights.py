"""Node-local weight copies (content-addressed, made once) and the warm actors' in-memory weights cache."""

from __future__ import annotations

import shutil

import pytest
import torch

from raybench.planning.plan import plan
from raybench.runtime import weights
from raybench.runtime.build import build_model
from raybench.spec.load import parse_sweep
from raybench.spec.sweep_spec import ModelSpec


def test_copy_is_made_once_and_addressed_by_content(tmp_path, model_dir):
    root = tmp_path / "local"
    copy, made = weights.node_local_copy(str(model_dir), root)
    assert made and copy == root / "weights" / weights.content_hash(model_dir)
    assert sorted(p.name for p in copy.iterdir()) == sorted([*(p.name for p in model_dir.iterdir()), weights.COMPLETE])
    assert weights.model_key(copy) == weights.content_hash(model_dir)
    again, made = weights.node_local_copy(str(model_dir), root)
    assert (again, made) == (copy, False)
    # The same bytes under another path share the copy; changed bytes get their own.
    twin = shutil.copytree(model_dir, tmp_path / "twin")
    assert weights.node_local_copy(str(twin), root) == (copy, False)
    (twin / "config.json").write_text((twin / "config.json").read_text() + "\n")
    changed, made = weights.node_local_copy(str(twin), root)
    assert made and changed != copy and (copy / "config.json").read_text() == (model_dir / "config.json").read_text()
    assert not [p for p in root.iterdir() if p.name.startswith(".copy-")]  # no temporary directory left


def test_interrupted_copy_is_redone(tmp_path, model_dir):
    root = tmp_path / "local"
    copy, _ = weights.node_local_copy(str(model_dir), root)
    (copy / weights.COMPLETE).unlink()  # as if the copying process died before finishing
    (copy / "config.json").unlink()
    again, made = weights.node_local_copy(str(model_dir), root)
    assert made and again == copy and (copy / "config.json").is_file() and (copy / weights.COMPLETE).is_file()


def test_build_model_loads_from_the_local_copy(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("RAYBENCH_LOCAL_DIR", str(tmp_path))
    model, info = build_model(ModelSpec(path=str(model_dir)), torch.device("cpu"), 0, local_copy="always")
    assert info["weights_copy_s"] > 0 and info["weights_cache"] is None
    assert (weights.local_root() / "weights" / weights.content_hash(model_dir) / weights.COMPLETE).is_file()
    plain, info = build_model(ModelSpec(path=str(model_dir)), torch.device("cpu"), 0, local_copy="never")
    assert info["weights_copy_s"] is None
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))


def test_auto_copies_only_off_network_filesystems(tmp_path):
    assert weights.wants_copy(str(tmp_path), "always") and not weights.wants_copy(str(tmp_path), "never")
    assert not weights.wants_copy(str(tmp_path), "auto")  # a local disk or tmpfs here


@pytest.mark.parametrize("spec", [ModelSpec(preset="tiny"), None], ids=["preset", "model-dir"])
def test_memory_cache_hit_gives_the_same_model(spec, model_dir):
    spec = spec or ModelSpec(path=str(model_dir))
    weights.STATE_CACHE.entries.clear()
    first, info = build_model(spec, torch.device("cpu"), seed=3, cache_gib=1)
    assert info["weights_cache"] == "miss"
    second, info = build_model(spec, torch.device("cpu"), seed=3, cache_gib=1)
    assert info["weights_cache"] == "hit"
    for (name, a), (_, b) in zip(first.named_buffers(), second.named_buffers()):
        assert torch.equal(a, b), name  # non-persistent buffers (rotary frequencies) too
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        next(second.parameters()).add_(1.0)  # training the hit model must not change the cached weights
    third, _ = build_model(spec, torch.device("cpu"), seed=3, cache_gib=1)
    assert torch.equal(next(third.parameters()), next(first.parameters()))
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(first(ids).logits, third(ids).logits)


def test_memory_cache_keeps_within_budget():
    cache = weights.StateCache()
    mib = 2**20
    cache.put("a", {"w": torch.zeros(mib // 4)}, budget_bytes=2 * mib)  # 1 MiB of fp32
    cache.put("b", {"w": torch.zeros(mib // 4)}, budget_bytes=2 * mib)
    assert cache.get("a") is not None  # now most recently used
    cache.put("c", {"w": torch.zeros(mib // 4)}, budget_bytes=2 * mib)
    assert list(cache.entries) == ["a", "c"]
    cache.put("huge", {"w": torch.zeros(mib)}, budget_bytes=2 * mib)  # larger than the budget: not kept
    assert "huge" not in cache.entries
    assert cache.nbytes() == 2 * mib  # what a warm actor holds: subtracted from its rows' host peaks


def test_memory_cap_is_the_trials_own_on_top_of_what_the_process_holds():
    import subprocess
    import sys

    code = ("import resource; from raybench.runtime import limits; limits.apply_memory_limit(2, held_bytes=2**29); "
            "print(resource.getrlimit(resource.RLIMIT_DATA)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) == 2 * 2**30 + 2**29


def test_a_cap_the_process_is_already_over_fails_the_trial_in_python():
    """Past the cap any thread's allocation fails, and one in a thread that cannot raise ends the process: a cap
    below what the process holds already is refused before it is set, with a MemoryError (an oom row)."""
    import subprocess
    import sys

    code = ("import resource; from raybench.runtime import limits\n"
            "before = resource.getrlimit(resource.RLIMIT_DATA)\n"
            "try:\n    limits.apply_memory_limit(0.001)\nexcept MemoryError as err:\n    print(err)\n"
            "assert resource.getrlimit(resource.RLIMIT_DATA) == before")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "over its cap of 0.00 GiB (resources.memory_limit_gib=0.001)" in out, out


def test_compile_cache_defaults_to_the_store():
    def payload(train: dict, **settings):
        sweep = {"name": "cc", "model": {"preset": "tiny"}, "train": train, **settings}
        return plan(parse_sweep(sweep))[0].payload.replace(cache_dir="/store/_cache")

    assert payload({"compile": True}).compile_cache_dir() == "/store/_cache/compile"
    assert payload({"compile": True}, caches={"compile_dir": "/fast/cc"}).compile_cache_dir() == "/fast/cc"
    explicit = payload({"compile": True, "compile_cache_dir": "/mine"}, caches={"compile_dir": "/x"})
    assert explicit.compile_cache_dir() == "/mine"
    assert payload({"compile": False}).compile_cache_dir() is None
