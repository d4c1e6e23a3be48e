"""Liger's reference operators (the rehearsal traces Liger trials with them): same values as the unpatched
model, Liger's saved tensors, and the process's transformers functions left as they were."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

from raybench.runtime.techniques import liger_reference


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True)
    return LlamaForCausalLM(config).double()


def test_reference_operators_give_the_unpatched_models_loss_and_gradients():
    plain = tiny_llama()
    patched = liger_reference.apply(copy.deepcopy(plain))
    ids = torch.randint(0, 300, (3, 17))
    labels = ids.clone()
    labels[0, :5] = -100  # ignored targets count in neither the loss nor its mean
    plain(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    with liger_reference.rope_patched("llama"):
        loss = patched(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
    expected = plain(input_ids=ids, labels=labels, use_cache=False).loss
    # Norms and the loss compute in fp32, as Liger's kernels do, so fp32 rounding is the bound.
    assert torch.allclose(loss, expected, rtol=1e-6)
    for (name, p), (_, q) in zip(plain.named_parameters(), patched.named_parameters(), strict=True):
        assert torch.allclose(q.grad, p.grad, rtol=1e-5, atol=1e-6 * p.grad.abs().max()), name


def test_rope_patch_is_undone_and_the_patched_model_needs_it():
    saved = modeling_llama.apply_rotary_pos_emb
    with liger_reference.rope_patched("llama"):
        assert modeling_llama.apply_rotary_pos_emb is not saved
    assert modeling_llama.apply_rotary_pos_emb is saved


def test_operators_keep_what_liger_keeps_for_backward():
    """RMSNorm keeps its input and a per-row fp32 rstd (not the normalized tensor); SwiGLU's gate keeps a and b;
    rotary keeps only cos and sin; the fused loss keeps the two gradients it made in forward, no logits."""
    x = torch.randn(4, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(16, dtype=torch.bfloat16, requires_grad=True)

    def saved_shapes(run) -> list[tuple]:
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append((tuple(t.shape), t.dtype)) or t,
                                                      lambda t: t):
            run()
        return shapes

    assert saved_shapes(lambda: liger_reference.rms_norm(x, w, 1e-6)) == [
        ((4, 8, 16), torch.bfloat16), ((16,), torch.bfloat16), ((4, 8), torch.float32)]
    a, b = torch.randn(2, 4, 32, requires_grad=True), torch.randn(2, 4, 32, requires_grad=True)
    assert saved_shapes(lambda: liger_reference.silu_mul(a, b)) == [((2, 4, 32), torch.float32)] * 2
    q, k = torch.randn(2, 4, 8, 16, requires_grad=True), torch.randn(2, 2, 8, 16, requires_grad=True)
    cos, sin = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    assert saved_shapes(lambda: liger_reference.rope(q, k, cos, sin)) == [((2, 8, 16), torch.float32)] * 2
    hidden, head = torch.randn(32, 16, requires_grad=True), torch.randn(300, 16, requires_grad=True)
    target = torch.randint(0, 300, (32,))
    assert saved_shapes(lambda: liger_reference.FusedLinearCrossEntropy.apply(hidden, head, target)) == [
        ((32, 16), torch.float32), ((300, 16), torch.float32)]
