"""Liger's kernels as plain-torch reference operators, so that `raybench rehearse` can trace Liger trials on CPU.

Liger (techniques/liger.py) launches Triton kernels, which need CUDA. Here each kernel is one custom operator
with the inputs, outputs and saved tensors of the kernel it stands for (liger-kernel 0.8: ops/rms_norm.py,
swiglu.py, rope.py, fused_linear_cross_entropy.py), so a trace sees what a GPU run does: one operator per
kernel (one read of its inputs, one write of its outputs) and what autograd keeps between forward and backward.
The fused linear cross-entropy runs Liger's own chunked algorithm, whose matmuls are plain torch: only its
per-chunk cross-entropy kernel is an operator here. Values are exact up to rounding (tests compare with the
unpatched model); speed on CPU is not the point. Real Liger trials never use this module.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from types import MethodType

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.modeling_outputs import CausalLMOutputWithPast

NAMESPACE = "raybench_liger"
IGNORE_INDEX = -100
MODEL_TYPES = ("llama", "qwen2")  # the ones techniques/liger.py patches


# ---------------------------------------------------------------------------------------------------------
# RMSNorm, Llama casting: statistics in fp32, the normalized input cast back before the weight multiplies it.
# Saves its input, its weight and the fp32 inverse RMS per row, as Liger's kernel does.


@torch.library.custom_op(f"{NAMESPACE}::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return (xf * rstd.unsqueeze(-1)).to(x.dtype) * weight, rstd


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    rstd = rstd.unsqueeze(-1)
    normed = x.float() * rstd
    m = grad.float() * weight.float()
    dx = rstd * (m - normed * (m * normed).mean(-1, keepdim=True))
    dw = (grad.float() * normed.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@rms_norm_backward.register_fake
def _(grad, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_grad(ctx, grad, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(grad, x, weight, rstd)
    return dx, dw, None


rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


# ---------------------------------------------------------------------------------------------------------
# SwiGLU's gate: silu(a) * b. Saves a and b; backward writes da and db into their storage (Liger's kernel is in
# place), so it allocates nothing.


@torch.library.custom_op(f"{NAMESPACE}::silu_mul", mutates_args=())
def silu_mul(a: Tensor, b: Tensor) -> Tensor:
    return F.silu(a) * b


@silu_mul.register_fake
def _(a, b):
    return torch.empty_like(a)


@torch.library.custom_op(f"{NAMESPACE}::silu_mul_backward_", mutates_args=("a", "b"))
def silu_mul_backward_(grad: Tensor, a: Tensor, b: Tensor) -> None:
    af, g = a.float(), grad.float()
    sig = torch.sigmoid(af)
    silu = af * sig
    db = g * silu
    a.copy_(g * (silu * (1 - sig) + sig) * b.float())
    b.copy_(db)


@silu_mul_backward_.register_fake
def _(grad, a, b):
    return None


def _silu_mul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _silu_mul_grad(ctx, grad):
    a, b = ctx.saved_tensors
    silu_mul_backward_(grad, a, b)
    return a, b


silu_mul.register_autograd(_silu_mul_grad, setup_context=_silu_mul_setup)


# ---------------------------------------------------------------------------------------------------------
# Rotary embedding of q and k in one kernel. Saves only cos and sin (the rotation is undone in backward).


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_half_transposed(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], -x[..., :half]), dim=-1)


@torch.library.custom_op(f"{NAMESPACE}::rope", mutates_args=())
def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@rope.register_fake
def _(q, k, cos, sin):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op(f"{NAMESPACE}::rope_backward", mutates_args=())
def rope_backward(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return dq * cos + _rotate_half_transposed(dq * sin), dk * cos + _rotate_half_transposed(dk * sin)


@rope_backward.register_fake
def _(dq, dk, cos, sin):
    return torch.empty_like(dq), torch.empty_like(dk)


def _rope_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3])


def _rope_grad(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq, dk = rope_backward(dq, dk, cos, sin)
    return dq, dk, None, None


rope.register_autograd(_rope_grad, setup_context=_rope_setup)


def _apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb signature (Liger replaces that module function with its kernel)."""
    return rope(q, k, cos, sin)


# ---------------------------------------------------------------------------------------------------------
# Fused linear + cross-entropy: logits are made a chunk of rows at a time and turned in place into their
# gradient, from which the input's and the weight's gradients are accumulated in forward; backward only scales.


@torch.library.custom_op(f"{NAMESPACE}::cross_entropy_chunk_", mutates_args=("logits",))
def cross_entropy_chunk_(logits: Tensor, target: Tensor, n_non_ignore: Tensor) -> Tensor:
    """Per-row loss (mean reduction over the batch's n_non_ignore targets); logits become d(loss)/d(logits)."""
    lf = logits.float()
    keep = target != IGNORE_INDEX
    safe = torch.where(keep, target, 0)
    lse = torch.logsumexp(lf, -1)
    loss = torch.where(keep, lse - lf.gather(-1, safe.unsqueeze(-1)).squeeze(-1), 0.0) / n_non_ignore
    grad = torch.softmax(lf, -1)
    grad.scatter_add_(-1, safe.unsqueeze(-1), -torch.ones_like(grad[:, :1]))
    logits.copy_(grad * (keep.unsqueeze(-1) / n_non_ignore))
    return loss


@cross_entropy_chunk_.register_fake
def _(logits, target, n_non_ignore):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, target: Tensor) -> Tensor:
        rows, hidden = x.shape
        # Liger's chunking: about as many logits per chunk as the hidden states they come from.
        chunk = _next_power_of_2(-(-rows // -(-weight.shape[0] // hidden)))
        grad_x = torch.zeros_like(x)
        grad_w = torch.zeros_like(weight) if weight.requires_grad else None
        loss = torch.zeros(rows, dtype=torch.float32, device=x.device)
        n_non_ignore = (target != IGNORE_INDEX).sum()
        for start in range(0, rows, chunk):
            x_chunk = x[start:start + chunk]
            logits = x_chunk @ weight.t()
            loss[start:start + chunk] = cross_entropy_chunk_(logits, target[start:start + chunk], n_non_ignore)
            grad_x[start:start + chunk] = logits @ weight
            if grad_w is not None:
                grad_w += torch.mm(logits.t(), x_chunk).float()
        ctx.save_for_backward(grad_x, grad_w)
        return loss.sum()

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_x, grad_w = ctx.saved_tensors
        # Liger skips this scaling when the loss's gradient is exactly 1 (a data-dependent check a trace
        # cannot make); it is one pass over the two gradients.
        grad_x.mul_(grad_loss)
        if grad_w is not None:
            grad_w.mul_(grad_loss)
        return grad_x, grad_w, None


def _lce_forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, use_cache=None,
                 **kwargs):
    """The causal LM's forward with Liger's fused loss: in training with labels no logits are materialized."""
    hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=use_cache, **kwargs).last_hidden_state
    if labels is None or not self.training:
        return CausalLMOutputWithPast(logits=self.lm_head(hidden))
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    loss = FusedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
                                         shifted.reshape(-1))
    return CausalLMOutputWithPast(loss=loss)


# ---------------------------------------------------------------------------------------------------------
# Patching, as Liger's apply_liger_kernel_to_<model>(model=...) does


def _rms_norm_forward(self, hidden_states):
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)[0]


def _swiglu_forward(self, x):
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def apply(model: nn.Module) -> nn.Module:
    """Patch this model instance's norms, MLPs and loss as Liger does (rope: see `rope_patched`)."""
    model_type = model.config.model_type
    if model_type not in MODEL_TYPES:
        raise ValueError(f"Liger's reference operators cover {', '.join(MODEL_TYPES)} models, not {model_type!r}")
    base = model.model
    norms = [base.norm] + [n for layer in base.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    for norm in norms:
        norm.forward = MethodType(_rms_norm_forward, norm)
    for layer in base.layers:
        layer.mlp.forward = MethodType(_swiglu_forward, layer.mlp)
    model.forward = MethodType(_lce_forward, model)
    return model


@contextlib.contextmanager
def rope_patched(model_type: str) -> Iterator[None]:
    """transformers' attention calls its module's apply_rotary_pos_emb: Liger replaces that function for the
    process; here it is replaced only while the context is open."""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    saved = module.apply_rotary_pos_emb
    module.apply_rotary_pos_emb = _apply_rotary_pos_emb
    try:
        yield
    finally:
        module.apply_rotary_pos_emb = saved
