"""The step time's hardware terms: the clocks a power-capped part sustains, and the flash-attention kernel's rate
by sequence length and head dim, forward and backward apart (raybench/spec/hardware.py, rehearse/roofline.py)."""

from __future__ import annotations

import pytest
import torch

from raybench.rehearse.roofline import Roofline, gpu_roofline
from raybench.spec import hardware

aten = torch.ops.aten


def test_a_power_capped_part_runs_at_the_cube_root_of_its_power_share():
    peaks = hardware.power_capped({"bf16": 989.0, "fp32": 67.0}, rated_w=700.0, limit_w=500.0)
    assert peaks["bf16"] == pytest.approx(989.0 * (500 / 700) ** (1 / 3))
    assert peaks["bf16"] / 989.0 == pytest.approx(0.894, abs=1e-3)
    assert peaks["fp32"] == pytest.approx(67.0 * (500 / 700) ** (1 / 3))
    # a limit above the rated power does not raise the clocks beyond the data sheet's
    assert hardware.power_capped({"bf16": 989.0}, 700.0, 800.0) == {"bf16": 989.0}


def test_the_hbm2e_h100_at_500_w_has_its_own_row():
    capped = hardware.find_gpu("H100 96GB HBM2e")
    assert capped.label == "H100 HBM2e"
    assert hardware.memory_bandwidth_tb_per_s("H100 HBM2e") == 2.4
    assert hardware.peak_tflops("H100 HBM2e", "bf16") == pytest.approx(989.0 * (5 / 7) ** (1 / 3))
    assert hardware.gpu_memory_gib("H100 HBM2e") is None  # not published
    # the SXM part keeps its row: nvidia-smi names it "H100 80GB HBM3"
    assert hardware.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert hardware.memory_bandwidth_tb_per_s("NVIDIA H100 80GB HBM3") == 3.35


def test_attention_share_is_the_published_kernel_rate_over_the_matmul_rate():
    kernel = hardware.FA2_HOPPER
    assert hardware.attention_share("H100 SXM", 8192, 128, backward=False) == pytest.approx(333.0 / 794.5)
    assert hardware.attention_share("H100 SXM", 8192, 128, backward=True) == pytest.approx(318.0 / 794.5)
    assert hardware.attention_share("H200", 1024, 64, backward=True) == pytest.approx(238.0 / 794.5)
    # between two published lengths: interpolated in log2 (3072 is 0.585 of the way from 2048 to 4096)
    between = hardware.attention_share("H100 SXM", 3072, 128, backward=False) * kernel.matmul_tflops
    assert between == pytest.approx(298.0 + 0.585 * (319.0 - 298.0), abs=0.1)
    # beyond the table's ends: held at the end's figure
    assert hardware.attention_share("H100 SXM", 131072, 128, False) == pytest.approx(335.0 / 794.5)
    assert hardware.attention_share("H100 SXM", 128, 128, False) == pytest.approx(191.0 / 794.5)
    # the nearest head dim the table has (96 is as near 64 as 128: the larger)
    assert hardware.attention_share("H100 SXM", 8192, 80, True) == pytest.approx(287.0 / 794.5)
    assert hardware.attention_share("H100 SXM", 8192, 96, True) == pytest.approx(318.0 / 794.5)
    # a GPU whose kernel the table lacks: attention priced as matmuls
    assert hardware.attention_share("A100 80GB", 8192, 128, False) == 1.0
    assert hardware.attention_share(None, 8192, 128, False) == 1.0


def _flash_cost(roofline: Roofline, seq_len: int, head_dim: int, backward: bool) -> tuple[float, float]:
    """(FLOPs, seconds at the FLOP rate) of one causal flash-attention call on meta tensors."""
    q = torch.empty(1, 4, seq_len, head_dim, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(1, 4, seq_len, dtype=torch.float32, device="meta")
    if backward:
        op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        flops, seconds, _ = roofline.cost(op, (q, q, q, q, q, lse, 0.0, True), {}, (q, q, q))
    else:
        op = aten._scaled_dot_product_flash_attention_for_cpu.default
        flops, seconds, _ = roofline.cost(op, (q, q, q), {"is_causal": True}, (q, lse))
    return flops, seconds


@pytest.mark.parametrize("backward", [False, True])
def test_the_roofline_runs_flash_attention_at_its_share_of_the_matmul_rate(backward):
    hopper = gpu_roofline("H100 SXM")
    as_matmuls = Roofline(hopper.peaks, hopper.bandwidth)  # no GPU row: attention at the matmul rate
    flops, seconds = _flash_cost(hopper, 8192, 128, backward)
    flops_matmul, seconds_matmul = _flash_cost(as_matmuls, 8192, 128, backward)
    assert flops == flops_matmul > 0
    share = hardware.attention_share("H100 SXM", 8192, 128, backward)
    assert seconds == pytest.approx(seconds_matmul / share)
    # a matmul is priced as before
    a = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    assert hopper.cost(aten.mm.default, (a, a), {}, a) == as_matmuls.cost(aten.mm.default, (a, a), {}, a)


def test_causal_attention_backward_is_priced_at_half_its_flops_like_the_forward():
    """The backward kernel's is_causal is its eighth argument, not the forward's fifth: read from the schema, the
    causal backward counts half the FLOPs of a full one (it was counted whole)."""
    roofline = Roofline({torch.bfloat16: 1e15}, None)
    q = torch.empty(1, 4, 1024, 64, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(1, 4, 1024, dtype=torch.float32, device="meta")
    op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    causal, _, _ = roofline.cost(op, (q, q, q, q, q, lse, 0.0, True), {}, (q, q, q))
    full, _, _ = roofline.cost(op, (q, q, q, q, q, lse, 0.0, False), {}, (q, q, q))
    assert causal == full / 2
    forward = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert roofline.cost(forward, (q, q, q, 0.0, True), {}, (q, lse))[0] * 2 == \
        roofline.cost(forward, (q, q, q, 0.0, False), {}, (q, lse))[0]
