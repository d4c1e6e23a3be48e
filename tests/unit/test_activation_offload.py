"""train.offload_activations, the option that proves the options seam (spec/options.py): its plan rules, its
technique's hooks (transparent on CPU, where nothing leaves its device), its rehearsal (what leaves the GPU and
the copies' time), and the seam's own guarantees (ids of the trials before an option, old rows). The GPU run is
tests/gpu/test_gpu_techniques.py::test_activation_offload_trains_in_less_memory."""

from __future__ import annotations

import json

import pytest
import torch

from raybench.planning.plan import plan
from raybench.rehearse import compiled, rehearsal
from raybench.rehearse.fake_world import fake_mode
from raybench.results.store import measured_trial_config
from raybench.runtime.build import TECHNIQUES
from raybench.runtime.model import decoder_blocks
from raybench.runtime.techniques import activation_checkpointing, activation_offload
from raybench.spec import options
from raybench.spec.errors import ConfigError
from raybench.spec.hardware import host_link_gb_per_s
from raybench.spec.load import parse_sweep
from raybench.spec.schema import GIB
from raybench.spec.sweep_spec import TrainSpec
from tests.rehearse_cases import tiny_trial

# Saved tensors of at least activation_offload.MIN_BYTES: the tiny model's at a long sequence.
LONG = {"seq_len": 2048, "micro_batch": 4, "loss": "chunked"}


def test_every_option_keeps_the_ids_of_the_trials_before_it():
    """An option left at its default leaves the dump (and so the id) as it was before the option existed; its
    technique, where it has one of its own, is in build's order right after the one it names."""
    names = [t.__name__.rpartition(".")[2] for t in TECHNIQUES]
    for option in options.OPTIONS:
        assert TrainSpec.model_fields[option.name].default in option.id_default, option.name
        if option.technique:
            assert names.index(option.technique) == names.index(option.after) + 1
    spec = {"name": "s", "model": {"preset": "tiny"}}
    default, explicit = (plan(parse_sweep({**spec, "train": train}))[0] for train in ({}, {"offload_activations": False}))
    assert default.trial_id == explicit.trial_id
    assert "offload_activations" not in default.config.train.model_dump(context={"trial_id": True})


def test_a_row_from_before_an_option_reads_as_what_it_ran():
    config = plan(parse_sweep({"name": "s", "model": {"preset": "tiny"}}))[0].config
    old = json.loads(config.model_dump_json())
    for option in options.OPTIONS:
        old["train"].pop(option.name, None)
    measured = measured_trial_config(json.dumps(old)).train
    assert {o.name: getattr(measured, o.name) for o in options.OPTIONS} == {o.name: o.before for o in options.OPTIONS}


@pytest.mark.parametrize("train, gpus, words", [
    ({}, 0, "on CPU they are there already"),
    ({"compile": True}, 1, "set train.compile: false"),
    ({"strategy": "tp", "tp_size": 2}, 1, "tp saves DTensors"),
    ({"ac_ratio": "1"}, 1, "nothing would be offloaded"),
])
def test_the_plan_refuses_offloading_where_it_cannot_run(train, gpus, words):
    spec = parse_sweep({"name": "s", "model": {"preset": "tiny"}, "train": {"offload_activations": True, **train},
                        "resources": {"workers": 2, "gpus_per_worker": gpus}})
    with pytest.raises(ConfigError) as err:
        plan(spec)
    assert "train.offload_activations" in str(err.value) and words in str(err.value)


def test_offloading_takes_activations_not_parameters_nor_small_tensors():
    weight = torch.nn.Parameter(torch.empty(1024, 1024))
    assert not activation_offload.offloads(weight) and not activation_offload.offloads(weight.t())
    assert activation_offload.offloads(torch.empty(1024, 1024))  # 4 MiB
    assert not activation_offload.offloads(torch.empty(16, 16))


def test_the_hooks_leave_a_cpu_step_as_it_was_checkpointed_blocks_included():
    """On CPU nothing leaves its device: the hooks around each block (outside its checkpoint) must change nothing,
    neither the loss and gradients nor what a checkpointed block recomputes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    train = TrainSpec(offload_activations=True, ac_ratio="1/2")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = activation_checkpointing.apply(LlamaForCausalLM(config), train)
        if offload:
            model = activation_offload.apply(model, train)
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        results.append((loss.item(), [p.grad for p in model.parameters()]))
    assert all(len(block._forward_pre_hooks) == 1 for block in decoder_blocks(model))  # on the checkpoint's wrapper
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == loss_b
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_the_rehearsal_moves_what_each_block_saves_to_the_host_and_prices_the_copies():
    """Each block not checkpointed sends what its forward saves (beyond parameters and small tensors) to the host;
    at the peak all of it is there but the last block's; the copies go out and back over the host link per
    micro-batch, on the compute stream."""
    kept, offloaded = (tiny_trial(2, gpus=1, strategy="fsdp2", grad_accum=2, **LONG, offload_activations=o)
                       for o in (False, True))
    base = rehearsal.rehearse(kept.config, kept.shape, "H100 SXM")
    moved = rehearsal.rehearse(offloaded.config, offloaded.shape, "H100 SXM")
    block = compiled.offloaded_block_bytes(offloaded.config, offloaded.shape, activation_offload.offloads)
    blocks = offloaded.shape.num_hidden_layers
    # An independent count of what the block keeps (compiled.py, storages apart from parameters) bounds it.
    assert 0 < block <= compiled._block_kept_bytes(kept.config, kept.shape, False, False)
    assert moved.memory_gib["activations"] == pytest.approx(base.memory_gib["activations"] - (blocks - 1) * block / GIB)
    copies_s = 2 * blocks * block / (host_link_gb_per_s("H100 SXM") * 1e9) * 2  # out and back, 2 micro-batches
    assert moved.step_time_s == pytest.approx(base.step_time_s + copies_s)
    assert any(n.startswith("activations offloaded") for n in moved.notes)
    half = tiny_trial(2, gpus=1, strategy="fsdp2", ac_ratio="1/2", **LONG, offload_activations=True)
    assert f"from {blocks // 2} blocks" in next(n for n in rehearsal.rehearse(half.config, half.shape, "H100 SXM").notes
                                                 if n.startswith("activations offloaded"))


def test_a_block_counted_for_offloading_holds_no_hooks_of_its_own():
    """The trace runs without the technique (TRACED = False): its hooks would hide the block's saves from the
    count, and, inside a checkpoint, from the checkpoint."""
    trial = tiny_trial(2, gpus=1, strategy="fsdp2", **LONG, offload_activations=True)
    mode = fake_mode()
    block = compiled.block_and_inputs(trial.config, trial.shape, mode)
    assert not block.module._forward_pre_hooks
