"""A device profile as `raybench calibrate` prints it: what it measured and the rehearsal constants derived from
it (raybench.rehearse.fitted), one figure a line."""

from __future__ import annotations


def profile_report(profile: dict, path) -> str:
    """What `raybench calibrate` measured and the rehearsal constants it derived, one figure a line, and where the
    profile is stored."""
    fp, d = profile["fingerprint"], profile["derived"]

    def fraction(value) -> str:
        return f" ({value:.3f} of the table's peak)" if value is not None else ""

    lines = [(f"device: {fp['device_name']} x{fp['device_count']} (key {fp['key']}; torch {fp['torch_version']}, "
              f"CUDA {fp['cuda_version'] or '-'})")]
    for g in profile["matmul"]:
        m, n, k = g["shape"]
        lines.append(f"  matmul {g['dtype']} {m}x{n}x{k}: {g['flop_per_s'] / 1e12:.3f} TFLOP/s"
                     f"{fraction(g['fraction_of_peak'])}")
    for b in profile["bandwidth"]:
        lines.append(f"  {b['kind']}: {b['bytes_per_s'] / 1e9:.1f} GB/s{fraction(b['fraction_of_peak'])}")
    lines.append(f"  launch cost: {profile['launch_s'] * 1e6:.2f} us per tiny operator")
    lines.append(f"  allocator reserve: {profile['allocator_reserve']:.3f} ({profile['allocator_note']})")
    lines.append(f"  collectives: {profile['collectives']['note']}")
    lines.append(f"derived: efficiency {d['efficiency']:.3f} of peak FLOP/s, bandwidth fraction "
                 f"{d['bandwidth_fraction']:.3f}, reserve {d['reserve']:.3f} (x step share {d['step_share']:.3f} "
                 f"fitted on H100 rows)" + (", absolute peaks (no table row)" if d["peaks_flop_per_s"] else ""))
    lines.append(f"profile {fp['key']} stored in {path} ({profile['duration_s']:.1f} s); "
                 "`raybench rehearse` and `best --predict` price this device with it")
    return "\n".join(lines)
