"""train.loss chunked: the causal LM's cross-entropy without its whole logits (torch only, CPU and GPU alike).

The unchunked loss (transformers' ForCausalLMLoss) makes the logits of every token at once, upcasts them to fp32
and keeps what cross-entropy's backward needs: at Llama-3's 128,256-entry vocabulary, 2 x 4096 tokens hold
3.9 GiB of fp32 logits and as much again for their gradient. Here the head and the loss run a chunk of tokens at
a time inside one autograd Function, as Liger's fused linear cross-entropy does: each chunk's logits are made,
turned into their gradient, and used at once for the chunk's share of the gradients of the head's input and
weight; then they are freed. Plain chunking (torchtune's chunked output loss) would keep every chunk's logits for
backward; this keeps only the two gradients, which backward scales by the loss's own gradient.

The same numbers as the unchunked loss to fp32 rounding: the head's matmuls run in the dtype they run in there
(autocast's, or the weights' own), the softmax in fp32, and the loss is the mean over the micro-batch's label
tokens (-100 ignored), or their sum over `num_items_in_batch` where a caller passes it, as transformers does.
With 16-bit weights the head's gradient sums its chunks in the weight's dtype, as Liger's does.

Where it does not run, the trial uses the unchunked loss (`TrainSpec.full_loss_reason` says why): Liger (its own
fused loss), a head split over the vocabulary (tensor parallelism's loss_parallel already keeps 1/tp of the
logits), DeepSpeed (ZeRO-3 gathers a module's weights only when that module runs, and the head's weight is read
here without running it), fp16 (the gradients made in forward would underflow before loss scaling reached them).
"""

from __future__ import annotations

from types import MethodType

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from raybench.spec.sweep_spec import TrainSpec, loss_chunk_rows

IGNORE_INDEX = -100


chunk_rows = loss_chunk_rows  # tokens per chunk (the estimate counts one chunk's logits by the same rule)


def wanted(train: TrainSpec) -> bool:
    # auto reaches a rank unresolved only where no plan ran: chunked, as the plan resolves it without a memory limit
    return train.loss != "full"


def apply(model: nn.Module, train: TrainSpec) -> nn.Module:
    """Give this model instance the chunked loss (its forward, as Liger patches it), unless the trial cannot use
    it (see the module docstring): then the model is left as it is."""
    if train.full_loss_reason(model.config.tie_word_embeddings) is None:
        model.forward = MethodType(_chunked_forward, model)
    return model


def _chunk_loss_and_grad(logits: Tensor, targets: Tensor, items: Tensor) -> tuple[Tensor, Tensor]:
    """A chunk's summed loss over `items`, and the loss's gradient with respect to its logits (fp32, made in
    place of the fp32 logits: one chunk-sized buffer)."""
    lf = logits.float()
    keep = targets != IGNORE_INDEX
    safe = torch.where(keep, targets, 0).unsqueeze(-1)
    lse = torch.logsumexp(lf, -1)
    picked = lf.gather(-1, safe).squeeze(-1)
    loss = torch.where(keep, lse - picked, 0.0).sum() / items
    grad = lf.sub_(lse.unsqueeze(-1)).exp_()  # softmax, in the logits' place
    grad.scatter_add_(-1, safe, torch.full_like(picked, -1.0).unsqueeze(-1))
    grad.mul_((keep / items).unsqueeze(-1))  # ignored tokens give no gradient
    return loss, grad


class LinearCrossEntropy(torch.autograd.Function):
    """loss = cross_entropy(hidden @ weight.T, targets) summed over `items`, a chunk of rows at a time; the
    gradients are made in forward and kept for backward (never the logits)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, items: Tensor, rows_per_chunk: int) -> Tensor:
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], rows_per_chunk):
            rows = slice(start, start + rows_per_chunk)
            chunk = hidden[rows]
            logits = F.linear(chunk, weight)  # under autocast, in its dtype, as the unchunked head runs
            loss, grad_logits = _chunk_loss_and_grad(logits, targets[rows], items)
            total += loss
            # The logits' gradient in the dtype the logits were made in, as the unchunked head's backward gets it.
            grad_logits = grad_logits.to(logits.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight.to(logits.dtype)
            if grad_weight is not None:
                grad_weight += grad_logits.t() @ chunk.to(logits.dtype)
            del logits, grad_logits
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        # One pass over each gradient (the loss's gradient is 1/grad_accum, or a loss scale).
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss)
        if grad_weight is not None:
            grad_weight.mul_(grad_loss)
        return grad_hidden, grad_weight, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, num_items_in_batch: Tensor | int | None = None,
                         shift_labels: Tensor | None = None, rows_per_chunk: int | None = None) -> Tensor:
    """transformers' causal LM loss of `hidden` (batch, sequence, hidden) through a head `weight` (vocab,
    hidden): labels shifted left by one (or `shift_labels` as given), chunked over the tokens."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    items = (targets != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
    items = torch.as_tensor(items, device=hidden.device)
    rows = rows_per_chunk or chunk_rows(flat.shape[0], flat.shape[1], weight.shape[0])
    return LinearCrossEntropy.apply(flat, weight, targets, items, rows)


def _chunked_forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, use_cache=None,
                     num_items_in_batch=None, shift_labels=None, **kwargs):
    """The causal LM's forward with the chunked loss: in training with labels, no logits are returned (the
    loop reads the loss only); otherwise transformers' own forward."""
    if labels is None or not self.training:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, labels=labels, use_cache=use_cache, **kwargs)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=use_cache, **kwargs)
    loss = linear_cross_entropy(outputs.last_hidden_state, self.lm_head.weight, labels, num_items_in_batch,
                                shift_labels)
    return CausalLMOutputWithPast(loss=loss, past_key_values=outputs.past_key_values)
