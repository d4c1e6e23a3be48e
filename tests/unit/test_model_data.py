"""Presets build the published shapes; local directories load safetensors only; data packing and padding."""

from __future__ import annotations

import pytest
import torch

from raybench import data
from raybench.config import ModelSpec
from raybench.model import build_model, count_params, decoder_blocks


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
    from types import SimpleNamespace

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
    packed = data.pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=4)
    assert packed.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    ids, mask = data.pad([[1, 2, 3, 4, 5], [6]], seq_len=3, pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [6, 0, 0]] and mask.sum().item() == 4


def test_text_batches_mask_padding_in_labels(model_dir, alpaca_file):
    from raybench.config import TrialConfig
    from raybench.plan import model_shape

    config = TrialConfig.model_validate({
        "model": {"path": str(model_dir)},
        "data": {"source": "json", "path": str(alpaca_file), "packing": False},
        "train": {"seq_len": 64, "micro_batch": 4},
    })
    batch = next(data.batches(config, model_shape(config), rank=0, world_size=2))
    assert batch["input_ids"].shape == (4, 64)
    assert ((batch["labels"] == data.IGNORE_INDEX) == (batch["attention_mask"] == 0)).all()
    assert 0 < batch["attention_mask"].sum() < 4 * 64


def test_tokenized_data_cached_as_arrow_and_keyed_by_content(tmp_path, model_dir, alpaca_file):
    from raybench.config import DataSpec

    spec = DataSpec(source="json", path=str(alpaca_file), packing=True)
    data._MEMORY_CACHE.clear()
    fresh = data.cached_text_dataset(spec, str(model_dir), 32, str(tmp_path))
    cached_files = list((tmp_path / "data").glob("*.arrow"))
    assert len(cached_files) == 1
    data._MEMORY_CACHE.clear()
    again = data.cached_text_dataset(spec, str(model_dir), 32, str(tmp_path))  # read back from Arrow
    assert all(torch.equal(a, b) for a, b in zip(fresh.tensors, again.tensors))
    assert data.dataset_cache_key(spec, str(model_dir), 64) != data.dataset_cache_key(spec, str(model_dir), 32)
    changed = tmp_path / "changed.jsonl"
    changed.write_text(alpaca_file.read_text().replace("fox", "cat"))
    other = DataSpec(source="json", path=str(changed), packing=True)
    assert data.dataset_cache_key(other, str(model_dir), 32) != data.dataset_cache_key(spec, str(model_dir), 32)
