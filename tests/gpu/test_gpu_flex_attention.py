"""model.attn_implementation flex_attention on CUDA: packed rows (position ids, no attention mask) give the loss and
the gradients of packed sdpa, whose mask is a dense [batch, 1, seq, seq] tensor; and a raybench trial trains with it.
Skipped without CUDA (on a CPU torch has no FlexAttention backward: tests/unit/test_flex_attention.py compares the
forward there and checks the plan refuses it)."""

from __future__ import annotations

import pytest
import torch

from tests import flex_models

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEQ_LEN = 256
SAMPLES = [[60, 100, 90], [200, 40], [17, 33, 120, 80]]


def packed_batch() -> dict:
    return {k: v.cuda() for k, v in flex_models.packed_batch(SAMPLES, SEQ_LEN).items()}


def tiny_llama(attn: str):
    return flex_models.tiny_llama(attn, hidden=128, max_positions=512).cuda()


def test_packed_flex_gives_the_loss_and_gradients_of_packed_sdpa():
    # fp32 with TF32 off (torch's default for matmuls; FlexAttention's kernel follows the same setting), so both
    # kernels compute in fp32 and differ only in the order they sum (flex's tiles, sdpa's masked kernel): the loss
    # to 1e-5 relative, every gradient to 1e-4 relative (a gradient sums more terms, through both layers) with
    # 1e-6 absolute for entries near zero, where relative error means nothing.
    assert not torch.backends.cuda.matmul.allow_tf32
    batch = packed_batch()
    results = {}
    for attn in ("sdpa", "flex_attention"):
        model = tiny_llama(attn)
        loss = model(**batch).loss
        loss.backward()
        results[attn] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    (sdpa_loss, sdpa_grads), (flex_loss, flex_grads) = results["sdpa"], results["flex_attention"]
    torch.testing.assert_close(flex_loss, sdpa_loss, rtol=1e-5, atol=0)
    for name, grad in sdpa_grads.items():
        torch.testing.assert_close(flex_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_trial_trains_with_flex_attention(model_dir, alpaca_file):
    from raybench.drivers.executors import torchrun
    from raybench.planning.plan import plan
    from raybench.spec.load import parse_sweep

    spec = parse_sweep({"name": "gpu", "model": {"preset": "tiny", "attn_implementation": "flex_attention"},
                        "data": {"source": "json", "path": str(alpaca_file), "tokenizer": str(model_dir)},
                        "train": {"steps": 10, "warmup_steps": 2, "seq_len": 64, "micro_batch": 2,
                                  "precision": "bf16", "lr": 1e-3},
                        "resources": {"workers": 1, "gpus_per_worker": 1, "timeout_s": 600}})
    (trial,) = plan(spec)
    result = torchrun.execute(trial.payload).metrics
    assert result.loss_final < result.loss_first, result
