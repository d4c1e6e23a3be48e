"""model.attn_implementation flex_attention: packed rows reach torch's FlexAttention as they reach sdpa (position ids,
no attention mask), and transformers masks them with a BlockMask built from the position ids instead of sdpa's dense
[batch, 1, seq, seq] mask. torch has no CPU backward for FlexAttention, so here the forward is compared (the loss)
and the plan refuses flex on CPU; the gradients are compared on CUDA (tests/gpu/test_gpu_flex_attention.py). The
rehearsal traces a flex trial as sdpa and says so."""

from __future__ import annotations

import pytest
import torch

from raybench.planning.plan import plan
from raybench.rehearse import rehearsal, traced_model
from raybench.spec.load import parse_sweep
from tests import flex_models

SEQ_LEN = 64
# Three samples of 20, 30 and 11 tokens packed in one row (3 tokens of padding after them), two in the other.
SAMPLES = [[20, 30, 11], [40, 17]]


def packed_batch(attn: str) -> dict:
    """One packed micro-batch as the loader builds it for `attn` (runtime.data.collate_rows)."""
    return flex_models.packed_batch(SAMPLES, SEQ_LEN, varlen=attn == "flash_attention_2")


def tiny_llama(attn: str):
    return flex_models.tiny_llama(attn, hidden=64, max_positions=256).eval()


def test_packed_rows_reach_flex_with_position_ids_and_no_mask():
    batch = packed_batch("flex_attention")
    assert "attention_mask" not in batch and "cu_seq_lens_q" not in batch
    assert batch["position_ids"][0, 20].item() == 0 and batch["position_ids"][0, 50].item() == 0


def test_packed_flex_gets_a_block_mask_not_a_dense_one_and_the_loss_of_packed_sdpa():
    # One test: compiling the block mask's creation on this CPU is most of its seconds, and the loss's forward
    # reuses it.
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.masking_utils import create_causal_mask

    batch = packed_batch("flex_attention")
    models = {attn: tiny_llama(attn) for attn in ("sdpa", "flex_attention")}
    masks = {}
    for attn, model in models.items():
        embeds = model.get_input_embeddings()(batch["input_ids"])
        masks[attn] = create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None,
                                         past_key_values=None, position_ids=batch["position_ids"])
    dense = masks["sdpa"]
    assert isinstance(dense, torch.Tensor) and dense.shape == (2, 1, SEQ_LEN, SEQ_LEN)
    assert not dense[0, 0, 25, 10]  # the second sample does not see the first
    block = masks["flex_attention"]
    assert isinstance(block, BlockMask) and not isinstance(block, torch.Tensor)
    # The block mask says what the dense one says at every position: each sample's own causal block.
    q, kv = torch.meshgrid(torch.arange(SEQ_LEN), torch.arange(SEQ_LEN), indexing="ij")
    for b in range(2):
        assert torch.equal(block.mask_mod(torch.tensor(b), torch.tensor(0), q, kv), dense[b, 0])
    # fp32 on both sides; the kernels sum the same products in another order (flex's tiles, sdpa's math kernel),
    # so the losses agree to fp32 rounding (1e-6 relative: a few ulps of 2-layer sums), not bit for bit.
    with torch.no_grad():  # torch has no CPU backward for FlexAttention
        losses = {attn: model(**batch).loss for attn, model in models.items()}
    assert torch.isfinite(losses["sdpa"])
    torch.testing.assert_close(losses["flex_attention"], losses["sdpa"], rtol=1e-6, atol=0)


def test_the_plan_refuses_flex_on_cpu_and_plans_it_on_a_gpu():
    raw = {"name": "flex", "model": {"preset": "tiny", "attn_implementation": "flex_attention"},
           "train": {"steps": 4, "warmup_steps": 1, "seq_len": 64, "micro_batch": 2}}
    from raybench.spec.errors import ConfigError

    with pytest.raises(ConfigError, match="no backward on CPU"):
        plan(parse_sweep(raw))
    (trial,) = plan(parse_sweep({**raw, "resources": {"gpus_per_worker": 1}}))
    assert trial.status == "planned"


def test_the_rehearsal_traces_flex_as_sdpa_and_says_so():
    def planned(attn: str):
        spec = parse_sweep({"name": "flex", "model": {"preset": "tiny", "attn_implementation": attn},
                            "train": {"steps": 4, "warmup_steps": 1, "seq_len": 64, "micro_batch": 2,
                                      "strategy": "fsdp2"},
                            "resources": {"gpus_per_worker": 1}, "estimate": {"gpu": "H100 SXM"}})
        (trial,) = plan(spec)
        return trial

    flex = planned("flex_attention")
    # The same traced step as the sdpa trial's (one trace serves both in a sweep)...
    assert rehearsal.step_config(flex.config) == rehearsal.step_config(planned("sdpa").config)
    # ...and the trace runs (it failed on FlexAttention's CPU backward, falling back to the analytic estimate).
    result = rehearsal.rehearse(flex.config, flex.shape, "H100 SXM", analytic=flex.assessment.analytic)
    assert result.method == "traced" and traced_model.FLEX_NOTE in result.notes
