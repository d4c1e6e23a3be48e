"""Report figures and files rendered from a real store of planted rows (2 GPU systems × 1/2/4 GPUs × sAC 0, 1/2, 1
× phases, with failures; a CPU sweep): every figure is a valid, non-empty PNG; HTML embeds them; Markdown
references files that exist."""

from __future__ import annotations

import base64
import io
import re

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
from planted_rows import GPU_SYSTEMS, plant_cpu_store, plant_gpu_store

from raybench.cli.main import main
from raybench.drivers.trial import build_row
from raybench.planning.plan import plan
from raybench.reports import frames, plots, report_files
from raybench.results import store
from raybench.spec.load import parse_sweep
from raybench.spec.schema import RankResult

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    path = tmp_path_factory.mktemp("store")
    plant_gpu_store(path)
    plant_cpu_store(path)
    return path


def gpu_rows(path) -> pd.DataFrame:
    return store.read_results(path, "planted")


def assert_real_png(data: bytes, min_inked: float = 0.01) -> np.ndarray:
    """A decodable PNG of plausible size with something drawn on it (not a blank white canvas)."""
    assert data.startswith(PNG_SIGNATURE)
    pixels = matplotlib.image.imread(io.BytesIO(data), format="png")
    height, width = pixels.shape[:2]
    assert height >= 300 and width >= 500
    inked = (pixels[..., :3] < 0.9).any(axis=-1).mean()
    assert inked > min_inked
    return pixels


@pytest.mark.parametrize("sweep", ["planted", "cpu"])
def test_every_plot_renders_a_png(planted, sweep):
    pngs = plots.render_all(store.read_results(planted, sweep))
    assert list(pngs) == list(plots.PLOTS) == ["throughput", "phases", "sac", "scaling", "pareto"]
    for data in pngs.values():
        assert_real_png(data)


def test_failed_rows_are_counted_not_plotted(planted):
    df = gpu_rows(planted)
    fig = plots.throughput_by_system(df)
    assert "not plotted: 1 error, 2 oom" in fig.get_suptitle()
    # Snellius at 4 GPUs with sAC 0 only has oom rows: the 4-GPU panel holds 3 della bars and 2 snellius bars.
    four_gpus = fig.axes[2]
    assert "4 GPU(s)" in four_gpus.get_title()
    assert len([p for p in four_gpus.patches if p.get_height() > 0]) == 5


def test_throughput_bars_are_repeat_means(planted):
    df = gpu_rows(planted)
    fig = plots.throughput_by_system(df)
    one_gpu = fig.axes[0]
    ok = df[(df.status == "ok") & (df.world_size == 1) & (df.train_ac_ratio == "0")]
    expected = sorted(ok.groupby("system")["tok_per_s_per_device"].mean())
    heights = sorted(p.get_height() for p in one_gpu.patches)
    # della and snellius bars at sAC 0 are among the 1-GPU bars, at the mean of their two repeats.
    for value in expected:
        assert min(abs(h - value) for h in heights) < 1e-6
    ratio = expected[0] / expected[1]
    assert ratio == pytest.approx(1 / GPU_SYSTEMS["della"]["speed"], rel=0.02)


def test_phase_bars_stack_to_the_step(planted):
    df = gpu_rows(planted)
    fig = plots.phase_breakdown(df)
    ax = fig.axes[0]
    assert len(ax.get_yticks()) == 17  # 2 systems × 9 configurations, minus snellius's oom one
    ends = {}
    for patch in ax.patches:  # horizontal stacked bars: each configuration's stack ends at its step time
        y = round(patch.get_y() + patch.get_height() / 2)
        ends[y] = max(ends.get(y, 0.0), patch.get_x() + patch.get_width())
    ok = df[df.status == "ok"]
    means = ok.groupby(["system", "config_id"])["step_time_p50_s"].mean() * 1000
    # The planted phases sum to the step (1% + 30% + 60% + 9%).
    assert sorted(ends.values()) == pytest.approx(sorted(means), rel=1e-6)


def test_sac_lines_and_cpu_memory(planted):
    fig = plots.sac_tradeoff(gpu_rows(planted))
    speed, memory = fig.axes[:2]
    assert len(speed.get_lines()) >= 6  # one line per system × GPU count (errorbar adds cap lines)
    ys = sorted({round(y, 3) for line in memory.get_lines() for y in line.get_ydata()})
    assert ys == [30.0, 45.0, 60.0]  # peak_reserved_gib on cuda rows

    cpu = store.read_results(planted, "cpu")
    pareto = plots.throughput_memory_pareto(cpu).axes[0]
    points = pareto.collections[0].get_offsets()
    assert sorted(map(tuple, np.asarray(points).tolist())) == [(1.5, 500.0), (2.0, 1000.0)]  # host RSS on CPU
    assert "worker process" in pareto.get_ylabel()


def test_scaling_efficiency_relative_to_fewest_gpus(planted):
    ax = plots.scaling_efficiency(gpu_rows(planted)).axes[0]
    curves = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines() if line.get_label() != "ideal "
              "(linear)"}
    snellius = curves["snellius H100 80GB HBM3 ac_ratio=1"]
    assert snellius == pytest.approx(list(GPU_SYSTEMS["snellius"]["efficiency"].values()), rel=0.02)


def test_scaling_plot_says_why_when_no_configuration_has_two_device_counts(planted):
    one_count = gpu_rows(planted).query("world_size == 1")
    fig = plots.scaling_efficiency(one_count)
    assert [t.get_text() for t in fig.axes[0].texts] == [
        "no configuration was measured at two or more device counts (sweep resources.workers)"]
    assert plots.png_bytes(fig).startswith(b"\x89PNG")


def test_pareto_front():
    points = pd.DataFrame({"peak_gib": [1.0, 2.0, 2.0, 3.0, 4.0], "tok_per_s_per_device": [10.0, 8.0, 20.0, 15.0,
                                                                                           30.0]})
    front = plots.pareto_front(points)
    assert list(zip(front.peak_gib, front.tok_per_s_per_device)) == [(1.0, 10.0), (2.0, 20.0), (4.0, 30.0)]


def test_single_point_missing_metrics_and_all_failed(planted):
    df = gpu_rows(planted)
    one = df[df.status == "ok"].head(1)
    for data in plots.render_all(one).values():
        assert_real_png(data)
    no_phases = one.assign(**{f"phase_{p}_mean_s": np.nan for p in frames.PHASES})
    assert "no ok rows with phase times" in [t.get_text() for t in plots.phase_breakdown(no_phases).axes[0].texts]
    failed = df[df.status != "ok"]
    for name, (_, draw) in plots.PLOTS.items():
        fig = draw(failed)
        assert any("no ok rows" in t.get_text() for ax in fig.axes for t in ax.texts), name
        assert_real_png(plots.png_bytes(fig), min_inked=0.0005)  # a title and a note only


def test_html_is_one_file_embedding_every_figure(planted, tmp_path):
    out = tmp_path / "report.html"
    assert report_files.write(gpu_rows(planted), "html", out, "t") == [out]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]
    page = out.read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == len(plots.PLOTS)
    for data in images:
        assert_real_png(base64.b64decode(data))
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing loaded from elsewhere
    assert "della vs snellius" in page and "gpu_mem_clock_max_mhz" in page  # the comparison section


def test_markdown_references_files_that_exist(planted, tmp_path):
    out = tmp_path / "sub" / "report.md"
    paths = report_files.write(gpu_rows(planted), "md", out, "t")
    text = out.read_text()
    referenced = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(referenced) == len(plots.PLOTS) and set(paths[1:]) == {out.parent / r for r in referenced}
    for name in referenced:
        assert_real_png((out.parent / name).read_bytes())
    assert "| della |" in text and "| oom |" in text


def test_cli_report_formats(planted, tmp_path, capsys):
    assert main(["report", str(planted), "--sweep", "planted", "--format", "png", "--out", str(tmp_path / "figs")]) == 0
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == sorted(f"{n}.png" for n in plots.PLOTS)
    assert main(["report", str(planted), "--format", "html", "--out", str(tmp_path / "r.html")]) == 0
    assert "r.html" in capsys.readouterr().out
    assert main(["report", str(planted)]) == 0  # text stays the default
    assert "della" in capsys.readouterr().out


def test_cli_report_bad_input_writes_nothing(tmp_path, planted, capsys):
    empty = tmp_path / "empty"
    assert main(["report", str(empty), "--format", "md", "--out", str(tmp_path / "r.md")]) == 2
    assert "STORE" in capsys.readouterr().err and not (tmp_path / "r.md").exists()
    assert main(["report", str(planted), "--format", "html", "--out", str(tmp_path)]) == 2
    assert "--out" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(planted), "--format", "pdf"])
    assert exit_.value.code == 2 and "invalid choice: 'pdf'" in capsys.readouterr().err


def test_large_grids_keep_the_fastest_configurations(tmp_path):
    spec = parse_sweep({"name": "big", "model": {"preset": "tiny"}, "axes": {"train.micro_batch": list(range(1, 51))}})
    rows = []
    for t in plan(spec):
        mb = t.axis_values["train.micro_batch"]
        metrics = {"device_type": "cpu", "tok_per_s_per_device": 100.0 * mb, "peak_rss_gib": 1.0 + mb,
                   **{f"phase_{p}_mean_s": 0.01 for p in frames.PHASES}}
        rows.append(build_row(t.payload, "big", "ok", "", RankResult.from_columns(metrics)))
    store.write_rows(tmp_path, rows)
    df = store.read_results(tmp_path)
    fig = plots.phase_breakdown(df)
    assert "40 configuration(s) plotted (the 40 fastest of 50)" in fig.get_suptitle()
    assert {t.get_text() for t in fig.axes[0].get_yticklabels()} == {f"micro_batch={m}" for m in range(11, 51)}
    throughput = plots.throughput_by_system(df)
    assert len(throughput.axes[0].get_xticks()) == plots.MAX_CATEGORIES


def test_two_sweeps_differing_in_their_base_draw_one_sac_line_each(tmp_path):
    """Two sweeps over the same sAC ratios whose base configs differ (micro-batch 1 and 2): the configuration's
    label names the field that differs, so each micro-batch is its own line, not one line zig-zagging between
    them; a field alike in every row stays out of the label."""
    for sweep, micro_batch in (("mb1", 1), ("mb2", 2)):
        spec = parse_sweep({"name": sweep, "model": {"preset": "tiny"}, "train": {"micro_batch": micro_batch},
                            "axes": {"train.ac_ratio": ["0", "1"]}})
        for t in plan(spec):
            speed = 100.0 * micro_batch * (1.2 if t.config.train.ac_ratio == "0" else 1.0)
            metrics = {"tok_per_s_per_device": speed, "peak_rss_gib": 1.0 * micro_batch, "device_type": "cpu"}
            store.write_row(tmp_path, build_row(t.payload, sweep, "ok", "", RankResult.from_columns(metrics)))
    rows = store.read_results(tmp_path)
    assert set(frames.config_label(rows)) == {f"ac_ratio={r} micro_batch={m}" for r in ("0", "1") for m in (1, 2)}
    speed = plots.sac_tradeoff(rows).axes[0]
    drawn = sorted(list(map(float, bars.lines[0].get_ydata())) for bars in speed.containers)  # errorbar's lines
    assert drawn == [[120.0, 100.0], [240.0, 200.0]]  # each line falls from ratio 0 to ratio 1
