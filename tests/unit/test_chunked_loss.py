"""train.loss chunked (runtime/techniques/chunked_loss.py): the same loss and gradients as transformers' loss over
the whole logits, to fp32 rounding; the logits never exist whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from raybench.runtime.techniques import chunked_loss
from raybench.spec.sweep_spec import TrainSpec

VOCAB, HIDDEN = 96, 16


def _model(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).train()


def _batch(rows: int = 2, seq: int = 13) -> dict:
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (rows, seq))
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt the loss ignores
    labels[1, -3:] = -100  # padding
    return {"input_ids": ids, "labels": labels}


def _loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch, use_cache=False).loss
    (loss / 2).backward()  # as the loop divides by grad_accum: backward scales the gradients made in forward
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_model_loss_and_gradients_equal_the_full_loss(tied):
    """Tied and untied heads, ignored labels, 26 tokens in chunks of 8 (the last chunk short)."""
    model, batch = _model(tied), _batch()
    full_loss, full_grads = _loss_and_grads(model, batch)
    chunked = chunked_loss.apply(model, TrainSpec())
    assert chunked.forward.__func__ is chunked_loss._chunked_forward
    chunk_rows = chunked_loss.chunk_rows
    try:
        chunked_loss.chunk_rows = lambda rows, hidden, vocab: 8
        loss, grads = _loss_and_grads(chunked, batch)
    finally:
        chunked_loss.chunk_rows = chunk_rows
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == full_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, full_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("rows_per_chunk", [1, 5, 7, 64])
@pytest.mark.parametrize("frozen_head", [False, True])
def test_linear_cross_entropy_matches_cross_entropy_on_whole_logits(rows_per_chunk, frozen_head):
    torch.manual_seed(2)
    hidden = torch.randn(3, 7, HIDDEN, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, requires_grad=not frozen_head)
    labels = torch.randint(0, VOCAB, (3, 7))
    labels[2] = -100
    labels[0, 3] = -100
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    full = F.cross_entropy((hidden @ weight.t()).float().reshape(-1, VOCAB), shifted.reshape(-1))
    full_grads = torch.autograd.grad(full * 3, [hidden] + ([] if frozen_head else [weight]))
    loss = chunked_loss.linear_cross_entropy(hidden, weight, labels, rows_per_chunk=rows_per_chunk)
    grads = torch.autograd.grad(loss * 3, [hidden] + ([] if frozen_head else [weight]))
    torch.testing.assert_close(loss, full, rtol=1e-6, atol=1e-6)
    for grad, expected in zip(grads, full_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


def test_num_items_in_batch_divides_the_summed_loss_as_transformers_does():
    """A caller's count across micro-batches (or ranks) replaces the micro-batch's own label count."""
    torch.manual_seed(3)
    hidden, weight = torch.randn(2, 5, HIDDEN), torch.randn(VOCAB, HIDDEN)
    labels = torch.randint(0, VOCAB, (2, 5))
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    summed = F.cross_entropy((hidden @ weight.t()).reshape(-1, VOCAB), shifted.reshape(-1), reduction="sum")
    loss = chunked_loss.linear_cross_entropy(hidden, weight, labels, num_items_in_batch=torch.tensor(40))
    torch.testing.assert_close(loss, summed / 40)


def test_a_micro_batch_without_labels_gives_nan_as_the_full_loss_does():
    hidden, weight = torch.randn(1, 4, HIDDEN, requires_grad=True), torch.randn(VOCAB, HIDDEN)
    labels = torch.full((1, 4), -100)
    full = F.cross_entropy((hidden @ weight.t()).reshape(-1, VOCAB), labels.reshape(-1))
    assert full.isnan() and chunked_loss.linear_cross_entropy(hidden, weight, labels).isnan()


def test_autocast_runs_the_head_in_its_dtype_as_the_full_loss_does():
    """Under bf16 autocast the head's matmuls run in bf16 in both, the softmax in fp32: the same loss to bf16
    rounding of the logits, and gradients within bf16 rounding."""
    model, batch = _model(tied=False), _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full_loss, full_grads = _loss_and_grads(model, batch)
        loss, grads = _loss_and_grads(chunked_loss.apply(model, TrainSpec()), batch)
    torch.testing.assert_close(loss, full_loss, rtol=1e-3, atol=1e-3)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, full_grads[name], rtol=2e-2, atol=2e-3, msg=name)


def test_chunk_rows_hold_about_as_many_logits_as_hidden_states_and_at_least_1024_tokens():
    # Llama-3 8B at 2 x 4096 tokens: 8 chunks of 1024 tokens (0.5 GiB of fp32 logits each, not 3.9 GiB).
    assert chunked_loss.chunk_rows(8192, 4096, 128256) == 1024
    assert chunked_loss.chunk_rows(65536, 4096, 128256) == 2048


def test_the_logits_never_exist_whole():
    """The chunked step's largest tensor is a chunk's logits, not the micro-batch's."""
    torch.manual_seed(4)
    hidden = torch.randn(4096, HIDDEN, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, 4096))
    largest = []

    class Largest(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    largest.append(t.numel())
            return out

    with Largest():
        chunked_loss.linear_cross_entropy(hidden.unsqueeze(0), weight, labels).backward()
    rows = chunked_loss.chunk_rows(4096, HIDDEN, VOCAB)
    assert rows < 4096 and max(largest) == max(rows * VOCAB, hidden.numel())


@pytest.mark.parametrize(("train", "tied", "reason"), [
    ({}, False, None),
    ({"strategy": "tp", "tp_size": 2}, True, None),  # a tied head stays whole under TP: chunked
    ({"strategy": "tp", "tp_size": 2}, False, "splits the head over the vocabulary"),
    ({"liger": True}, False, "liger"),
    ({"strategy": "deepspeed"}, False, "deepspeed"),
    ({"precision": "fp16"}, False, "fp16"),
    ({"loss": "full"}, False, "train.loss full"),
])
def test_where_the_loss_runs_over_the_whole_logits(train, tied, reason):
    found = TrainSpec(**train).full_loss_reason(tied)
    assert found == reason if reason is None else reason in found
    model = chunked_loss.apply(_model(tied), TrainSpec(**train))
    assert ("forward" in vars(model)) == (reason is None)


def test_ids_leave_the_default_out_rows_say_which_loss_ran_and_older_rows_read_as_full():
    import json

    from raybench.planning.plan import config_id
    from raybench.results.store import measured_trial_config
    from raybench.spec.sweep_spec import TrialConfig

    auto = TrialConfig.model_validate({"model": {"preset": "tiny"}})  # the default, resolved by the plan
    chunked = TrialConfig.model_validate({"model": {"preset": "tiny"}, "train": {"loss": "chunked"}})
    full = TrialConfig.model_validate({"model": {"preset": "tiny"}, "train": {"loss": "full"}})
    assert config_id(chunked) == config_id(auto) == "f93ad76455577afa"  # the id it had before train.loss existed
    assert config_id(full) != config_id(chunked)
    row_config = chunked.model_dump(mode="json")  # what a row's config_json holds
    assert row_config["train"]["loss"] == "chunked"
    assert measured_trial_config(json.dumps(row_config)).train.loss == "chunked"
    del row_config["train"]["loss"]  # a row from before the field: it ran the full loss
    assert measured_trial_config(json.dumps(row_config)).train.loss == "full"
