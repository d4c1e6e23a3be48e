"""The constants of the rehearsal fitted on GPU measurements; every other figure of a prediction comes from the
trace and the hardware table."""

# Achieved fraction of the per-operator roofline (peak FLOP/s and memory bandwidth) on an H100 SXM, the median
# of roofline / measured step time over the 10 eager rows of the committed 1B sAC sweep
# (docs/results/gpu-2026-11-22/gpu-sac-1b.parquet): 0.7048, range 0.67-0.72 (docs/results/rehearse-2026-11-25.md).
# Other GPUs get the same fraction of their own roofline, with tensor-core peaks scaled by their measured matmul
# efficiency relative to this GPU's (`matmul_efficiency_ratio`; the hardware table's public MAMF figures).
ROOFLINE_EFFICIENCY = 0.70
ROOFLINE_REFERENCE_GPU = "H100 SXM"
# The caching allocator reserves more than the tensors it holds (block rounding, fragmentation), and GPU rows
# report the reserved peak. Fitted the same way: median peak_reserved_gib / peak_alloc_gib over the same 10
# rows, 1.159 (range 1.12-1.23). A GPU rehearsal's reserved_gib is its tensor peak times this.
ALLOCATOR_RESERVE = 1.16
# torch.compile (not traced: compiled trials trace eager) fuses the elementwise, reduction and copy operators
# of each compiled decoder block into generated kernels; how many bytes those move, against the eager
# operators', inductor itself counts on one block (compiled_block_traffic). A byte its kernels move costs this
# many times a byte of the eager operators' roofline. Fitted like the two above on the 10 compiled rows of the
# same sweep (docs/results/rehearse-2026-11-26.md, section 5).
COMPILED_BYTE_COST = 1.26
