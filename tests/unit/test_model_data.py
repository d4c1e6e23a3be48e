"""Presets build the published shapes; local directories load safetensors only; data packing and padding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raybench.data import json_rows
from raybench.runtime import data
from raybench.runtime.build import build_meta, build_model
from raybench.runtime.model import count_params, decoder_blocks
from raybench.spec.sweep_spec import ModelSpec


@pytest.mark.parametrize("preset, billions", [("llama-3.2-1b", 1.236), ("llama-3-8b", 8.03), ("qwen2.5-14b", 14.77)])
def test_presets_match_published_sizes(preset, billions):
    model = build_model(ModelSpec(preset=preset), torch.device("meta"), seed=0)[0]
    total, trainable = count_params(model)
    assert total / 1e9 == pytest.approx(billions, rel=0.01)
    assert trainable == total


def test_quantized_weights_count_their_original_shape():
    """A 4-bit weight holds two values per uint8 element; the count is of weights, from quant_state.shape.

    bitsandbytes needs CUDA, so the real Params4bit cannot be built here: the stand-in is a uint8 parameter of
    half the elements, packed as bitsandbytes packs it ([n / 2, 1]), carrying a quant_state with the original
    shape. tests/gpu/test_gpu_techniques.py checks the real class.
    """
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4, bias=False))
    unquantized = count_params(model)
    for layer in model:
        shape = layer.weight.shape
        packed = torch.nn.Parameter(torch.zeros(shape.numel() // 2, 1, dtype=torch.uint8), requires_grad=False)
        packed.quant_state = SimpleNamespace(shape=shape)
        layer.weight = packed
    assert sum(p.numel() for p in model.parameters()) < unquantized[0]  # what numel() alone would report
    assert count_params(model) == (unquantized[0], 6)  # only the first layer's bias is still trainable


def test_local_dir_loads_safetensors(model_dir):
    model = build_model(ModelSpec(path=str(model_dir)), torch.device("cpu"), seed=0)[0]
    assert len(decoder_blocks(model)) == 2
    reloaded = build_model(ModelSpec(path=str(model_dir)), torch.device("cpu"), seed=1)[0]
    for a, b in zip(model.parameters(), reloaded.parameters()):  # weights come from the file, not the seed
        assert torch.equal(a, b)


def test_pickle_only_dir_is_refused(tmp_path, model_dir):
    import shutil

    shutil.copy(model_dir / "config.json", tmp_path / "config.json")
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        build_model(ModelSpec(path=str(tmp_path)), torch.device("cpu"), seed=0)


def test_pack_and_pad():
    packed = json_rows.pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=4)
    assert packed.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    ids, mask = json_rows.pad([[1, 2, 3, 4, 5], [6]], seq_len=3, pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [6, 0, 0]] and mask.sum().item() == 4


def test_text_batches_mask_padding_in_labels(model_dir, alpaca_file):
    from raybench.spec.presets import model_shape
    from raybench.spec.sweep_spec import TrialConfig

    config = TrialConfig.model_validate({
        "model": {"path": str(model_dir)},
        "data": {"source": "json", "path": str(alpaca_file), "packing": False},
        "train": {"seq_len": 64, "micro_batch": 4},
    })
    batch = next(data.batches(config, model_shape(config), rank=0, world_size=2))
    assert batch["input_ids"].shape == (4, 64)
    assert ((batch["labels"] == data.IGNORE_INDEX) == (batch["attention_mask"] == 0)).all()
    assert 0 < batch["attention_mask"].sum() < 4 * 64


@pytest.mark.parametrize("packing", [True, False])
def test_tokenized_data_cached_as_arrow_and_keyed_by_content(tmp_path, model_dir, alpaca_file, packing):
    import pyarrow as pa

    from raybench.spec.sweep_spec import DataSpec

    spec = DataSpec(source="json", path=str(alpaca_file), packing=packing)
    json_rows._MEMORY_CACHE.clear()
    fresh = json_rows.cached_text_dataset(spec, str(model_dir), 32, str(tmp_path))
    cached_files = list((tmp_path / "data").glob("*.arrow"))
    assert len(cached_files) == 1
    with pa.memory_map(str(cached_files[0])) as source:  # one file format, with or without padding
        assert pa.ipc.open_file(source).schema.names == ["input_ids", "attention_mask"]
    json_rows._MEMORY_CACHE.clear()
    again = json_rows.cached_text_dataset(spec, str(model_dir), 32, str(tmp_path))  # read back from Arrow
    assert len(fresh.tensors) == len(again.tensors) == (1 if packing else 2)  # a mask only with padding
    assert all(torch.equal(a, b) for a, b in zip(fresh.tensors, again.tensors))
    key = json_rows.dataset_cache_key
    assert key(spec, str(model_dir), 64) != key(spec, str(model_dir), 32)
    changed = tmp_path / "changed.jsonl"
    changed.write_text(alpaca_file.read_text().replace("fox", "cat"))
    other = DataSpec(source="json", path=str(changed), packing=True)
    assert key(other, str(model_dir), 32) != key(spec, str(model_dir), 32)


@pytest.mark.parametrize("source, packing", [("synthetic", True), ("json", True), ("json", False)])
def test_only_padded_batches_reach_the_model_with_a_mask(model_dir, alpaca_file, source, packing):
    """Without padding the model gets no attention_mask (transformers would check an all-ones mask on the
    device, a host sync per micro-batch); the non-padding token count is the same as with a mask."""
    import contextlib

    from raybench.runtime import bench
    from raybench.runtime.strategies import Trainable
    from raybench.spec.presets import model_shape
    from raybench.spec.sweep_spec import TrialConfig

    config = TrialConfig.model_validate({
        "model": {"path": str(model_dir)},
        "data": {"source": source, "path": str(alpaca_file), "packing": packing},
        "train": {"seq_len": 64, "micro_batch": 4, "grad_accum": 2},
    })
    seen, calls = [], []

    def recorded():
        for batch in data.batches(config, model_shape(config), rank=0, world_size=1):
            seen.append(batch)
            yield batch

    def model(**kwargs):
        calls.append(kwargs)
        return SimpleNamespace(loss=torch.tensor(1.0))

    trainable = Trainable(model, None, backward=lambda loss: None, step=lambda: None,
                          no_grad_sync=contextlib.nullcontext, autocast=contextlib.nullcontext)
    _, counts = bench.train_step(trainable, recorded(), config.train, torch.device("cpu"),
                                 bench.PhaseClock(torch.device("cpu")))
    nonpad = counts.nonpad
    assert len(calls) == 2
    assert all(("attention_mask" in call) == (not packing) for call in calls)
    real = sum(int((b["labels"] != data.IGNORE_INDEX).sum()) for b in seen)  # padding is masked in the labels
    assert nonpad == real and counts.labels == real and counts.unlabelled == 0
    if packing:
        assert nonpad == 2 * 4 * 64
        assert all(torch.equal(b["labels"], b["input_ids"]) for b in seen)
    else:
        assert nonpad < 2 * 4 * 64


def test_large_presets_build_on_the_meta_device_without_allocating():
    """The worker builds every model on meta first; a 72B shape must cost no memory until its shards are made."""
    import resource

    from raybench.planning import estimate
    from raybench.runtime.build import build_meta
    from raybench.spec.presets import PRESETS
    from raybench.spec.sweep_spec import TrainSpec

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model, source, _ = build_meta(ModelSpec(preset="qwen2.5-72b"), seed=0)
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert source.weights_dir is None and source.state is None  # random init, drawn per shard later
    assert count_params(model)[0] == estimate.param_counts(PRESETS["qwen2.5-72b"], TrainSpec()).total
    assert grown_gib < 1.0  # the model is 290 GB in fp32


def test_a_tied_output_head_stays_the_embedding_after_materializing():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from raybench.runtime.materialize import materialize

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    materialize(model, torch.device("cpu"), seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(list(model.parameters())) == len(list(model.named_parameters(remove_duplicate=False))) - 1


@pytest.mark.parametrize("preset, tp_size", [("qwen2.5-72b", 1), ("qwen2.5-72b", 8), ("llama-3.2-1b", 4)])
def test_warm_up_miniature_keeps_the_architecture_and_divides_by_tp(preset, tp_size):
    """Every executor warms up on a miniature of the trial's architecture (warm_up.warm_up): same transformers
    class and tying, two blocks, heads a TP wrap can split."""
    from raybench.runtime.warm_up import miniature_shape
    from raybench.spec.presets import PRESETS

    shape = PRESETS[preset]
    mini = miniature_shape(shape, tp_size)
    model, _, _ = build_meta(ModelSpec(preset=preset), seed=0, shape=mini)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[shape.model_type]
    assert len(decoder_blocks(model)) == 2 and mini.tie_word_embeddings == shape.tie_word_embeddings
    assert mini.num_key_value_heads % tp_size == 0 and mini.num_attention_heads % tp_size == 0
    assert sum(p.numel() for p in model.parameters()) < 1_000_000  # a few MB at most
