"""Analytic memory and step-time estimate of one trial, per rank (per GPU, or per worker process on CPU).

Pure arithmetic on the model shape and the trial config: no torch, no I/O, so `plan` can prune a large grid in
well under a second. The model follows what raybench's own code does (fp32 weights everywhere; bf16 by autocast
under ddp/tp, by FSDP2's MixedPrecisionPolicy, by DeepSpeed's 16-bit module cast) and is written out with its
sources and constants in docs/estimate.md. Measured peaks then calibrate it per model x strategy x device
(raybench/planning/calibration.py), and raybench/planning/assessment.py judges it against the device memory;
every result row stores the estimate and its error.
"""

from __future__ import annotations

from dataclasses import dataclass

from raybench.planning import zero3_gathered as zero3
from raybench.spec import metrics
from raybench.spec.finetunes import LORA
from raybench.spec.hardware import peak_tflops
from raybench.spec.presets import ModelShape
from raybench.spec.schema import GIB
from raybench.spec.sweep_spec import LORA_TARGET_MODULES, TrainSpec, TrialConfig, loss_chunk_rows

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Assumed, not measured (no GPU here): CUDA context and kernel images, cuBLAS workspaces and NCCL buffers. They
# use device memory that torch's caching allocator never sees, so peak_reserved_gib leaves them out too.
CUDA_OVERHEAD_GIB = 1.0
# Measured (docs/results/estimate-accuracy-2026-11-22.md): peak RSS of a torchrun CPU worker beyond its model
# (python, torch, transformers, peft, gloo): 0.40-0.45 GiB; the highest is used. CPU rows report peak RSS,
# which includes it.
HOST_BASELINE_GIB = 0.45
# Assumed model FLOPs utilization for the step-time guess: well-tuned dense LLM training reaches 30-50% of
# the dense bf16 peak. A guess for ranking configurations, never a measurement. Checked on one H100
# (docs/results/gpu-2026-11-22.md): measured / guessed step time had a median of 1.03 (0.78-1.23) over a 1B
# full fine-tune sAC sweep and 1.19 (1.04-1.46) over 1B LoRA runs.
ASSUMED_MFU = 0.4
# DeepSpeed's default reduce_bucket_size (elements); raybench's ds_config leaves it alone.
ZERO_BUCKET_ELEMENTS = 500_000_000
# bitsandbytes NF4 with double quantization (its default): 4 bits per weight, an 8-bit absmax per 64 weights
# and an fp32 absmax per 256 of those blocks.
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# Peak bytes the logits and the cross-entropy loss hold per token and vocabulary entry (see
# activation_bytes_per_token).
LOSS_BYTES_PER_VOCAB_ENTRY = 12

# ---------------------------------------------------------------------------------------------------------
# Parameters


def projection_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection in one decoder block (Llama/Qwen2 layout, GQA)."""
    h, inter = shape.hidden_size, shape.intermediate_size
    head_dim = h // shape.num_attention_heads
    q_dim, kv_dim = shape.num_attention_heads * head_dim, shape.num_key_value_heads * head_dim
    return {"q_proj": (h, q_dim), "k_proj": (h, kv_dim), "v_proj": (h, kv_dim), "o_proj": (q_dim, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def _has_bias(shape: ModelShape, name: str) -> bool:
    return shape.model_type == "qwen2" and name in ("q_proj", "k_proj", "v_proj")  # Qwen2's q/k/v carry biases


def lora_targets(train: TrainSpec) -> tuple[str, ...]:
    """Projections that get adapters (PEFT's all-linear: every projection of a block, not the output head)."""
    if train.tuning.trains_base:
        return ()
    targets = LORA_TARGET_MODULES[train.lora.targets]
    return PROJECTIONS if targets == "all-linear" else tuple(targets)


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by where they live; `total` matches model.count_params (adapters included)."""

    projections: int  # every decoder block's q/k/v/o/gate/up/down weights and biases: what TP splits
    block_norms: int  # two RMSNorm weights per block
    embedding: int
    head: int  # 0 when the head is tied to the embedding
    final_norm: int
    adapters: int  # LoRA A and B matrices (0 for full fine-tuning)

    @property
    def total(self) -> int:
        return self.projections + self.block_norms + self.embedding + self.head + self.final_norm + self.adapters


def param_counts(shape: ModelShape, train: TrainSpec) -> ParamCounts:
    layers, h = shape.num_hidden_layers, shape.hidden_size
    proj = projection_shapes(shape)
    per_block = sum(i * o + (o if _has_bias(shape, n) else 0) for n, (i, o) in proj.items())
    adapters = sum(train.lora.rank * (proj[n][0] + proj[n][1]) for n in lora_targets(train))
    return ParamCounts(
        projections=layers * per_block, block_norms=layers * 2 * h, embedding=shape.vocab_size * h,
        head=0 if shape.tie_word_embeddings else shape.vocab_size * h, final_norm=h, adapters=layers * adapters)


# Projections TP splits by input features (RowwiseParallel); the others are split by output features.
ROW_PARALLEL = ("o_proj", "down_proj")


def tp_local_adapters(shape: ModelShape, train: TrainSpec) -> float:
    """LoRA adapter elements one rank of a TP group holds: each projection's A (r x in) and B (out x r) with the
    projection's split dimension divided by tp_size: B's output features on a column-parallel projection, A's
    input features on a row-parallel one; the other matrix whole (strategies/tp.py)."""
    proj, r, tp = projection_shapes(shape), train.lora.rank, train.tp_size
    per_block = sum(r * (i / tp + o) if name in ROW_PARALLEL else r * (i + o / tp)
                    for name, (i, o) in proj.items() if name in lora_targets(train))
    return shape.num_hidden_layers * per_block


def _optimizer_elements(name: str, counts: ParamCounts, shape: ModelShape, train: TrainSpec, flat: bool) -> float:
    """Optimizer state elements for the trainable parameters (before sharding).

    AdamW: two moments. SGD: one momentum buffer. Adafactor (torch, no first moment): a row and a column
    vector per matrix, a full vector per 1-D parameter; DeepSpeed hands the optimizer flat 1-D partitions, so
    there it keeps a full vector (flat=True).
    """
    trainable = counts.total if train.tuning.trains_base else counts.adapters
    if name.startswith("adamw"):
        return 2 * trainable
    if name == "sgd":
        return trainable
    if flat:
        return trainable
    proj, layers, r = projection_shapes(shape), shape.num_hidden_layers, train.lora.rank
    if not train.tuning.trains_base:  # A is (r, in), B is (out, r)
        return layers * sum(r + i + o + r for n, (i, o) in proj.items() if n in lora_targets(train))
    matrices = layers * sum(i + o + (o if _has_bias(shape, n) else 0) for n, (i, o) in proj.items())
    embeddings = (shape.vocab_size + shape.hidden_size) * (1 if shape.tie_word_embeddings else 2)
    return matrices + embeddings + counts.block_norms + counts.final_norm


# ---------------------------------------------------------------------------------------------------------
# Activations


@dataclass(frozen=True)
class _Dtypes:
    """Bytes per element of what a forward pass keeps, as the strategy sets dtypes."""

    residual: int  # the residual stream between blocks: fp32 weights keep it fp32, 16-bit weights make it 16-bit
    compute: int  # matmul outputs
    autocast: bool  # fp32 weights cast to 16-bit per op: each linear makes (and keeps) its own input cast


def _dtypes(train: TrainSpec) -> _Dtypes:
    if train.precision == "fp32":
        return _Dtypes(4, 4, False)
    if train.parallelism.sixteen_bit_weights:  # weights themselves are 16-bit during compute
        return _Dtypes(2, 2, False)
    # ddp, tp: torch.autocast over fp32 weights. A LoRA base stored in 16 bits makes the residual stream 16-bit
    # (the embedding's output); PEFT still upcasts each adapter's input to fp32, which autocast casts down again.
    return _Dtypes(base_bytes(train), 2, True)


def base_bytes(train: TrainSpec) -> int:
    """Bytes per element of the weights as stored (train.lora.base_dtype for a LoRA base; bf16 under
    master_weights none; else fp32; QLoRA's 4-bit projections are counted apart)."""
    return 2 if train.lora_base_dtype in ("bf16", "fp16") or train.master_weights == "none" else 4


def block_activation_bytes(shape: ModelShape, train: TrainSpec) -> tuple[float, float, float]:
    """Bytes one decoder block keeps for backward, per token: (its norms', its projections' inputs, the rest).

    Under TP the rest is split over the TP group; with sequence parallelism (`TrainSpec.tp_sequence_parallel`)
    the norms' part is too, as each rank normalizes its part of the sequence, while the projections' inputs are
    all-gathered whole.

    Counts the tensors autograd saves in a Hugging Face Llama/Qwen2 block with sdpa attention (flash-style
    kernels keep no s x s scores); it matches torch's saved-tensor hooks on CPU up to RMSNorm's 4-byte rsqrt
    per token (tests/unit/test_estimate.py). A linear keeps its input only when its weight or its adapter gets
    a gradient.
    """
    d = _dtypes(train)
    full, targets = train.tuning.trains_base, lora_targets(train)
    proj = projection_shapes(shape)
    h, inter, heads = shape.hidden_size, shape.intermediate_size, shape.num_attention_heads
    q_dim, kv_dim = proj["q_proj"][1], proj["k_proj"][1]

    def keeps_input(name: str) -> bool:
        return full or name in targets

    # Under autocast each linear that keeps its input keeps its own 16-bit cast of it, and PEFT's adapters cast
    # theirs to fp32 first. With dropout, raybench's adapters cast inside what backward recomputes
    # (techniques/lora.py) and keep their input as it comes: one tensor, shared (QLoRA's keep PEFT's path).
    copies = d.autocast and not (train.tuning is LORA and train.lora.dropout > 0)

    norms = inputs = 0.0
    for consumers in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        if train.liger:  # Liger's RMSNorm keeps its input as it comes and a 4-byte rstd; backward recomputes
            norms += d.residual * h + 4
        else:  # RMSNorm runs in fp32: it keeps its fp32 input, and for a trainable weight the normalized input
            norms += 4 * h + (d.residual * h if full else 0)
        keeping = sum(keeps_input(n) for n in consumers)
        if copies:  # each linear casts the norm's output itself and keeps its own 16-bit copy
            inputs += keeping * 2 * h
        elif keeping:  # the linears share the norm's output tensor
            inputs += d.residual * h
    c = d.compute
    split = (q_dim + kv_dim) * c + kv_dim * c + q_dim * c + heads * 4  # sdpa keeps q, k, v, output, logsumexp
    if copies and "o_proj" in targets:
        split += q_dim * 2  # PEFT upcasts the adapter's input, autocast casts it down again: a new copy
    # silu keeps gate's output, the product keeps silu's output and up's output; Liger's fused SwiGLU keeps
    # gate's and up's outputs and recomputes silu in backward.
    split += (2 if train.liger else 3) * inter * c
    if keeps_input("down_proj"):
        split += inter * c
    split += len(targets) * train.lora.rank * c  # each adapter's B keeps A's output
    return norms, inputs, split


def _op_mode_kept_bytes(shape: ModelShape, train: TrainSpec) -> float:
    """Per token, what an op-level checkpointed block keeps (approximate; before the TP split).

    The policy (techniques/activation_checkpointing.py) saves attention's outputs and every second matmul
    output: q, v, gate and down of a block's seven projections.
    """
    proj, c = projection_shapes(shape), _dtypes(train).compute
    q_dim, kv_dim = proj["q_proj"][1], proj["k_proj"][1]
    saved_matmuls = q_dim + kv_dim + shape.intermediate_size + shape.hidden_size
    return (saved_matmuls + q_dim) * c + shape.num_attention_heads * 4


def activation_bytes_per_token(shape: ModelShape, train: TrainSpec, ac_blocks: list[int] | tuple[int, ...]) -> float:
    """Bytes a rank keeps per token of its micro-batch at the start of backward (the activation peak).

    Non-checkpointed blocks keep everything; a checkpointed block keeps its input (op mode: also the tensors
    its policy saves) and, during backward, one block at a time is recomputed in full. The loss adds 12 bytes
    per vocabulary entry: its fp32 log-softmax output, then in backward that output's gradient and the fp32
    logits' gradient (the 16-bit logits are freed after forward; 12.0-12.2 measured on CPU for fp32, autocast
    and 16-bit weights, docs/estimate.md); the chunked loss (train.loss), that for one chunk of tokens only.
    """
    d, tp, seq = _dtypes(train), train.tp_size, _tp_layout_split(shape, train)
    norms, inputs, split = block_activation_bytes(shape, train)
    block = norms / seq + inputs + split / tp
    checkpointed = len(ac_blocks)
    kept = d.residual * shape.hidden_size / seq  # the block's input: a part of the sequence under SP
    if train.ac_mode == "op":
        kept += _op_mode_kept_bytes(shape, train) / tp
    blocks = (shape.num_hidden_layers - checkpointed) * block + checkpointed * kept + (block if checkpointed else 0)
    full, h = train.tuning.trains_base, shape.hidden_size
    if train.liger:
        # Fused linear cross-entropy computes the head's gradients chunk by chunk during forward: no logits and
        # no head input are kept, only the gradient of the head's input (compute dtype).
        return blocks + d.residual * h + 4 + d.compute * h
    final_norm = (4 * h + (d.residual * h if full else 0)) / seq
    if train.full_loss_reason(shape.tie_word_embeddings) is None:
        # Chunked (techniques/chunked_loss.py): the head's input gradient, made in forward, is kept instead of
        # the logits and the head's input; one chunk's logits are live at a time, at the loss's bytes per entry.
        rows = train.micro_batch * train.seq_len
        chunk_share = min(rows, loss_chunk_rows(rows, h, shape.vocab_size)) / rows
        return blocks + final_norm + d.residual * h + LOSS_BYTES_PER_VOCAB_ENTRY * shape.vocab_size * chunk_share
    head_input = (2 if d.autocast else d.residual) * h if full else 0  # all-gathered whole under SP
    logits = shape.vocab_size * LOSS_BYTES_PER_VOCAB_ENTRY / seq
    return blocks + final_norm + head_input + logits


def _tp_layout_split(shape: ModelShape, train: TrainSpec) -> int:
    """Ranks the sequence between blocks, the embedding, the head and the logits are split over
    (TrainSpec.tp_sequence_parallel: tp_size), else 1."""
    return train.tp_size if train.tp_sequence_parallel(shape.tie_word_embeddings) else 1


# ---------------------------------------------------------------------------------------------------------
# The estimate


@dataclass(frozen=True)
class Estimate:
    """Memory one rank needs at its peak, by component, in GiB, and a step-time guess."""

    device: str  # "cuda" or "cpu": what each rank runs on
    params_total: int  # as model.count_params reports it (adapters included)
    params_trainable: int
    params_gib: float  # this rank's weights (replica or shard) plus working copies (autocast casts, gathers)
    grads_gib: float  # gradients plus the strategy's gradient buffers (DDP buckets, ZeRO reduce buckets)
    optimizer_gib: float  # optimizer states on the device (DeepSpeed: with its fp32 master partition)
    activations_gib: float  # what one micro-batch keeps for backward, logits and loss included
    other_gib: float  # CUDA context etc. on a GPU; the worker process's baseline RSS on CPU
    offloaded_gib: float  # ZeRO-Offload: optimizer state (and parameters) held in host memory instead
    flops_per_step: float  # per rank, recomputation of checkpointed blocks included
    step_time_s: float | None  # flops_per_step / (peak FLOP/s x ASSUMED_MFU); None when the peak is unknown

    @property
    def peak_gib(self) -> float:
        """Sum of the components: an upper bound, as gradients and activations do not peak at the same moment."""
        return self.params_gib + self.grads_gib + self.optimizer_gib + self.activations_gib + self.other_gib

    @property
    def measured_part_gib(self) -> float:
        """The part of peak_gib that a trial's measured peak covers: on a GPU torch's allocator does not see
        the CUDA context (peak_reserved_gib leaves it out); on CPU peak RSS includes the process baseline."""
        return self.peak_gib - self.other_gib if self.device == "cuda" else self.peak_gib

    def as_dict(self) -> dict:
        return {**vars(self), "peak_gib": self.peak_gib, "measured_part_gib": self.measured_part_gib}


def _state_bytes(config: TrialConfig, shape: ModelShape, counts: ParamCounts) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, offloaded) bytes per rank for the trial's strategy."""
    train, world = config.train, config.resources.workers
    tp = train.tp_size
    dp = world // tp
    full = train.tuning.trains_base
    low = 4 if train.precision == "fp32" else 2  # 16-bit compute bytes
    # TP splits the block projections (and their LoRA adapters half-way, tp_local_adapters) and, in torchtitan's
    # layout, the embedding and head; norms are replicated over the TP group.
    vocab = _tp_layout_split(shape, train)
    root = (counts.embedding + counts.head) / vocab + counts.final_norm  # TP-local
    adapters = tp_local_adapters(shape, train)
    local = counts.projections / tp + counts.block_norms + root + adapters
    trainable = local if full else adapters
    # Optimizer states of the whole model in the trained weights' dtype (fp32, or bf16 under master_weights none),
    # scaled to this rank's TP-local share of the trainables
    trained = 2 if train.master_weights == "none" else 4
    states = trained * _optimizer_elements(train.optimizer, counts, shape, train, flat=train.parallelism.zero)
    states *= trainable / (counts.total if full else counts.adapters or 1)
    block = (local - root - adapters) / shape.num_hidden_layers  # one block's share (TP-local)
    block_adapters = adapters / shape.num_hidden_layers
    offloaded = 0.0

    base = base_bytes(train)
    stored = base * (local - adapters) + 4 * adapters  # fp32 adapters on a LoRA base
    if not train.parallelism.sixteen_bit_weights:  # ddp, tp: whole fp32 weights
        weights = stored
        if train.tuning.quantized_base:  # 4-bit projections; embeddings, norms and head stay fp32
            weights = NF4_BYTES_PER_PARAM * counts.projections + 4 * (local - counts.projections)
        if _dtypes(train).autocast:  # autocast's 16-bit weight casts live until backward has used them
            head = shape.vocab_size * shape.hidden_size / vocab
            cast = (0 if train.tuning.quantized_base else counts.projections / tp) + head
            weights += 2 * ((cast if base == 4 else 0) + adapters)  # a 16-bit base needs no cast
        # DDP's reducer keeps its own bucket copy of every gradient (gradient_as_bucket_view is off); one rank
        # runs without DDP (strategies/ddp.py)
        grads = trained * trainable * (2 if train.parallelism.reducer and world > 1 else 1)
        return weights, grads, states, offloaded

    if train.fsdp2_sharded:
        gathered = local if not train.reshard_after_forward else root + 2 * (block + block_adapters)
        weights = stored / dp + low * gathered  # the shard as stored + unsharded 16-bit copies being computed with
        block_trainable = (block + block_adapters) if full else block_adapters
        grads = trained * trainable / dp + block_trainable * (low + (4 if low == 2 else 0))  # + a block unreduced
        return weights, grads, states / dp, offloaded

    # deepspeed: 16-bit module weights, a flat fp32 master partition, gradients and states partitioned by stage.
    stage = train.zero_stage
    weights = low * local if stage < 3 else low * local / world + low * zero3_gathered_elements(shape, train)
    if train.offload == "optimizer_params":
        offloaded += low * local / world
        weights -= low * local / world
    optimizer = 4 * trainable / world + states / world
    grads = low * trainable / (world if stage >= 2 else 1)
    on_gpu = config.resources.gpus_per_worker > 0
    buffers = 2 if on_gpu and stage < 3 else 1  # overlap_comm (on GPUs) double-buffers stage 1/2 reductions
    # On CPU the buckets' untouched pages never become resident: only the gradients written into them count.
    bucket = ZERO_BUCKET_ELEMENTS if on_gpu else min(ZERO_BUCKET_ELEMENTS, trainable)
    grads += low * bucket * buffers
    if train.offload != "none":
        offloaded += optimizer
        optimizer = 0.0
    return weights, grads, optimizer, offloaded


def zero3_gathered_elements(shape: ModelShape, train: TrainSpec) -> int:
    """Parameter elements ZeRO-3 holds whole as backward begins (zero3_gathered.gathered_at_backward)."""
    biased = tuple(n for n in PROJECTIONS if _has_bias(shape, n))
    modules = zero3.forward_modules(shape, projection_shapes(shape), biased, train.lora.rank, lora_targets(train))
    return zero3.gathered_at_backward(modules)


def _flops_per_step(config: TrialConfig, shape: ModelShape, counts: ParamCounts, ac_blocks) -> float:
    """Per rank: model FLOPs (metrics.flops_per_token) plus the forward passes that checkpointing repeats."""
    train, world = config.train, config.resources.workers
    layers, s, h = shape.num_hidden_layers, train.seq_len, shape.hidden_size
    full = train.tuning.trains_base
    matmul = metrics.matmul_params(counts.total, shape.vocab_size, h, shape.tie_word_embeddings)
    per_token = metrics.flops_per_token(matmul, counts.total if full else counts.adapters, full, layers, s, h)
    if train.ac_mode == "op":  # the policy recomputes k, o and up (every second matmul), never attention
        proj = projection_shapes(shape)
        per_token += len(ac_blocks) * 2 * sum(i * o for n, (i, o) in proj.items() if n in ("k_proj", "o_proj",
                                                                                             "up_proj"))
    else:
        block_matmul = (counts.projections + counts.adapters) / layers
        per_token += len(ac_blocks) * (2 * block_matmul + 4 * s * h)
    tokens_per_step = train.micro_batch * s * train.grad_accum * (world // train.tp_size)
    return per_token * tokens_per_step / world


def estimate(config: TrialConfig, shape: ModelShape, ac_blocks: list[int] | tuple[int, ...],
             gpu: str | None = None) -> Estimate:
    """The memory each rank of this trial needs, by component, and a step-time guess for `gpu`."""
    train = config.train
    device = "cuda" if config.resources.gpus_per_worker > 0 else "cpu"
    counts = param_counts(shape, train)
    weights, grads, optimizer, offloaded = _state_bytes(config, shape, counts)
    activations = train.micro_batch * train.seq_len * activation_bytes_per_token(shape, train, ac_blocks)
    flops = _flops_per_step(config, shape, counts, ac_blocks)
    peak = peak_tflops(gpu, train.precision) if device == "cuda" else None
    return Estimate(
        device=device, params_total=counts.total,
        params_trainable=counts.total if train.tuning.trains_base else counts.adapters,
        params_gib=weights / GIB, grads_gib=grads / GIB, optimizer_gib=optimizer / GIB,
        activations_gib=activations / GIB,
        other_gib=CUDA_OVERHEAD_GIB if device == "cuda" else HOST_BASELINE_GIB,
        offloaded_gib=offloaded / GIB, flops_per_step=flops,
        step_time_s=None if peak is None else flops / (peak * 1e12 * ASSUMED_MFU),
    )
