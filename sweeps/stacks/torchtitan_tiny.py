"""torchtitan 0.3.0 job configs for raybench's torchtitan stack (docs/stacks/torchtitan.md): a config function per
job, as torchtitan's own `config_registry.py` files define them; `stack.config` names this file and `stack.recipe`
the function (torchtitan's `--config`).

llama3_tiny_cpu: torchtitan's llama3_debugmodel job with the model of raybench's `tiny` preset (hidden 128, 4 layers,
4 heads, 2 KV heads, MLP 256, vocab 2000, untied head), trainable on CPU ranks:
- attention: torch's scaled_dot_product_attention (causal). torchtitan's language-model backends are flex (no
  backward on the CPU: "FlexAttention does not support backward on CPU") and varlen (a CUDA flash kernel); SDPA is
  causal over the whole packed sequence instead of per document;
- spmd_backend partial_dtensor (FSDP2 over plain parameters): 0.3.0's default, spmd_types, stops on CPU ranks at the
  first fully_shard ("When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh");
- no checkpoint, no validation: the trial measures training steps only.

Runs in torchtitan's own environment (scripts/torchtitan-venv.sh), never imported by raybench.
"""

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import (
    _build_llama3_layers,
    _EMBEDDING_INIT,
    _NORM_INIT,
    _output_linear_init,
    Llama3Model,
    model_registry,
)
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

# raybench's `tiny` preset (raybench/spec/presets.py), so the row's parameter count and FLOPs are this model's.
DIM, LAYERS, HEADS, KV_HEADS, MLP, VOCAB = 128, 4, 4, 2, 256, 2000


def tiny_llama3() -> Llama3Model.Config:
    layers = _build_llama3_layers(
        fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=MLP,
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=2048, theta=500000, scaling="llama"),
        attn_backend="flex")
    model = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=layers)
    # flex attention has no backward on the CPU: every block attends with SDPA instead.
    for _, _, parent, attr in list(model.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return model


def llama3_tiny_cpu() -> Trainer.Config:
    config = llama3_debugmodel()
    spec = model_registry("debugmodel")
    spec.model, spec.flavor = tiny_llama3(), "tiny"
    config.model_spec = spec
    config.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)))
    config.parallelism.spmd_backend = "partial_dtensor"
    config.checkpoint.enable = False
    config.validator.enable = False
    return config
