"""``epdserve sweep``: grid parsing, gain math, the report files, and one tiny real sweep on loopback."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from epdserve.bench.report import SLO, Stats, Summary
from epdserve.bench.sweep import (
    Cell,
    CellResult,
    Environment,
    SweepConfig,
    SweepResult,
    TopologyRun,
    command_line,
    config_from_args,
    git_commit,
    parse_int_list,
    parse_topologies,
)
from epdserve.bench.sweep_report import gain_grids, gain_percent, write_report
from epdserve.cli import build_parser, main

# ---- factories -------------------------------------------------------------------------------------


def stats(v: float, n: int) -> Stats:
    return Stats(n, v, v, v, 2 * v, 2 * v)  # p99 = 2 × p50 so tables can tell them apart


def summary(ttft: float, e2e: float, n: int = 4, failed: int = 0, goodput: float | None = None) -> Summary:
    ok = n - failed
    return Summary(
        requests=n,
        completed=ok,
        errors={"503": failed} if failed else {},
        duration_s=1.0,
        request_throughput=float(ok),
        input_tokens=100 * ok,
        output_tokens=16 * ok,
        input_token_throughput=100.0 * ok,
        output_token_throughput=16.0 * ok,
        ttft=stats(ttft, ok),
        tpot=stats(0.01, ok),
        itl=stats(0.01, 15 * ok),
        e2e=stats(e2e, ok),
        slo_met=None if goodput is None else ok,
        goodput=goodput,
    )


ENV = Environment(
    nproc=2,
    cpu_model="Test CPU @ 1.00GHz",
    ram_gib=7.5,
    commit="abc1234-dirty",
    command="epdserve sweep --out x --images 1,4",
    date="2026-11-30T03:00:00+00:00",
    python="3.11.0",
    platform="Linux-test",
)


def synthetic() -> SweepResult:
    """aggregated's latency grows with images; 1e+1pd halves it at 4 images and is 25% slower at 1;
    2e+1pd has a failed request in one cell (no gain there)."""
    config = SweepConfig(
        topologies=("aggregated", "1e+1pd", "2e+1pd"), images=(1, 4), output_lens=(16, 64), mixed=True, requests=4
    )
    base = {1: 0.100, 4: 0.400}
    epd = {1: 0.125, 4: 0.200}
    cells = []
    for cell in config.cells:
        b = base[cell.images]
        e = epd[cell.images]
        out = cell.output_len / 1000
        per_kind_agg = {"text": summary(0.3, 0.5, 2), "image": summary(0.6, 0.9, 2)} if cell.mixed else {}
        per_kind_epd = {"text": summary(0.05, 0.2, 2), "image": summary(0.4, 0.7, 2)} if cell.mixed else {}
        cells.append(CellResult("aggregated", cell, summary(b, b + out, goodput=3.5), per_kind_agg, 0.2))
        cells.append(CellResult("1e+1pd", cell, summary(e, e + out, goodput=4.0), per_kind_epd, 0.2))
        failed = 1 if cell == Cell(4, 64) else 0
        why = '{"error": {"message": "encoder\nunavailable"}}' if failed else ""
        cells.append(CellResult("2e+1pd", cell, summary(e, e + out, failed=failed), per_kind_epd, 0.9, "", why))
    runs = (
        TopologyRun("aggregated", 6.0, {}),
        TopologyRun("1e+1pd", 7.0, {"encoder0": [0], "pd0": [1]}),
        TopologyRun("2e+1pd", 8.0, {"encoder0": [0], "encoder1": [0], "pd0": [1]}),
    )
    return SweepResult(config, ENV, runs, tuple(cells), 42.0)


# ---- gains and the report --------------------------------------------------------------------------


def test_gain_is_positive_when_epd_is_faster() -> None:
    assert gain_percent(100.0, 80.0) == pytest.approx(20.0)
    assert gain_percent(100.0, 125.0) == pytest.approx(-25.0)
    assert gain_percent(0.2, 0.2) == 0.0
    assert gain_percent(0.0, 0.1) is None  # no baseline, no ratio


def test_gain_grids_rows_are_images_columns_output_lengths() -> None:
    grids = {(g.topology, g.metric): g for g in gain_grids(synthetic())}
    assert set(grids) == {("1e+1pd", "ttft"), ("1e+1pd", "e2e"), ("2e+1pd", "ttft"), ("2e+1pd", "e2e")}
    ttft = grids["1e+1pd", "ttft"]
    assert (ttft.images, ttft.output_lens) == ((1, 4), (16, 64))
    assert [list(row) for row in ttft.values] == [pytest.approx([-25.0, -25.0]), pytest.approx([50.0, 50.0])]
    # E2E adds the same decode time to both sides, so its gain is smaller in size than TTFT's
    e2e = grids["1e+1pd", "e2e"].values
    assert e2e[0][0] == pytest.approx(100 * (0.116 - 0.141) / 0.116)
    assert e2e[1][1] == pytest.approx(100 * (0.464 - 0.264) / 0.464)
    # a cell with a failed request has no gain: the survivors' latencies would flatter it
    assert grids["2e+1pd", "ttft"].values[1][1] is None
    assert grids["2e+1pd", "ttft"].values[1][0] == pytest.approx(50.0)


def test_no_gains_without_aggregated() -> None:
    r = synthetic()
    config = SweepConfig(topologies=("1e+1pd", "2e+1pd"), images=(1, 4), output_lens=(16, 64))
    without = SweepResult(config, ENV, r.topologies[1:], tuple(c for c in r.cells if c.topology != "aggregated"), 1.0)
    assert gain_grids(without) == []


def test_report_files(tmp_path: Path) -> None:
    paths = write_report(synthetic(), tmp_path)
    names = {p.name for p in paths}
    assert paths[0].name == "report.md"
    for t in ("1e_1pd", "2e_1pd"):
        assert {f"ttft_gain_{t}.png", f"e2e_gain_{t}.png"} <= names
    assert "mixed_ttft.png" in names
    for p in paths:
        assert p.is_file() and p.stat().st_size > 0
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    md = (tmp_path / "report.md").read_text()
    for section in ("## Machine", "## Settings", "## Gain of EPD over aggregated", "## Results per cell"):
        assert section in md
    assert "## Mixed traffic" in md
    assert "Test CPU @ 1.00GHz" in md and "7.5 GiB" in md and "| 2 |" in md
    assert "`abc1234-dirty`" in md
    assert "`epdserve sweep --out x --images 1,4`" in md
    assert "2026-11-30T03:00:00+00:00" in md
    assert (
        "| images | output | topology | ok/sent | req/s | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | E2E p50 ms |" in md
    )
    # aggregated, 4 images, 64 tokens: TTFT p50 400 ms, p99 800 ms, E2E 464 ms, goodput 3.50
    assert "| 4 | 64 | aggregated | 4/4 | 4.00 | 400.0 | 800.0 | 20.0 | 464.0 | 3.50 |" in md
    assert "| 4 | 64 | 2e+1pd | 3/4 ⚠ 503: 1 (client busy) |" in md
    assert "| 4 | +50.0% | +50.0% |" in md and "| 1 | -25.0% | -25.0% |" in md
    assert "n/a" in md
    assert "![TTFT p50 gain of 1e+1pd over aggregated](ttft_gain_1e_1pd.png)" in md
    # mixed: text TTFT p50/p99 then image TTFT p50/p99 per topology
    assert "| 1 | 16 | 1e+1pd | 4/4 | 4.00 | 50.0 | 100.0 | 400.0 | 800.0 |" in md
    assert "](mixed_ttft.png)" in md
    assert '- 2e+1pd, 4 img × 64 tok: `{"error": {"message": "encoder unavailable"}}`' in md

    data = json.loads((tmp_path / "sweep.json").read_text())
    assert len(data["cells"]) == 3 * 6
    first = data["cells"][0]
    assert first["topology"] == "aggregated" and first["cell"] == {"images": 1, "output_len": 16, "mixed": False}
    assert first["summary"]["ttft"]["p50"] == 0.1 and first["summary"]["goodput"] == 3.5
    assert data["environment"]["commit"] == "abc1234-dirty"
    assert [c["first_failure"] for c in data["cells"] if c["first_failure"]] == [
        '{"error": {"message": "encoder\nunavailable"}}'
    ]
    assert data["config"]["topologies"] == ["aggregated", "1e+1pd", "2e+1pd"]
    assert {(g["topology"], g["metric"]) for g in data["gains"]} >= {("1e+1pd", "ttft")}


# ---- configuration ---------------------------------------------------------------------------------


def test_grid_parsing() -> None:
    assert parse_int_list("1,4,10", "--images") == (1, 4, 10)
    assert parse_int_list(" 16 , 64", "--output-lens") == (16, 64)
    for bad, match in (("1,x", "not an integer"), ("0", "out of range"), ("4,4", "twice"), ("", "not an integer")):
        with pytest.raises(ValueError, match=match):
            parse_int_list(bad, "--output-lens")
    assert parse_int_list("0,50", "--images", 0, 50) == (0, 50)
    with pytest.raises(ValueError, match="out of range"):
        parse_int_list("51", "--images", 0, 50)
    assert parse_topologies("aggregated, 1E+1PD,2e+1pd") == ("aggregated", "1e+1pd", "2e+1pd")
    assert parse_topologies("1e+1p+1d,1P+2D") == ("1e+1p+1d", "1p+2d")
    for bad in ("1e+1pd,1e+1pd", "", "3x"):
        with pytest.raises(ValueError):
            parse_topologies(bad)


def test_cells_grid_then_mixed_at_the_shortest_output() -> None:
    c = SweepConfig(images=(1, 4), output_lens=(64, 16), mixed=True)
    assert c.cells == (
        Cell(1, 64),
        Cell(1, 16),
        Cell(4, 64),
        Cell(4, 16),
        Cell(1, 16, mixed=True),
        Cell(4, 16, mixed=True),
    )
    assert c.cells[-1].workload(0).text_fraction == 0.5
    assert SweepConfig(topologies=("1E+1PD",)).topologies == ("1e+1pd",)
    with pytest.raises(ValueError, match="images_per_request"):
        SweepConfig(images=(51,))
    with pytest.raises(ValueError, match="appears twice"):
        SweepConfig(topologies=("aggregated", "AGGREGATED"))


def test_flags_make_the_config(tmp_path: Path) -> None:
    flags = "--topologies aggregated,2e+1pd --images 1,10 --output-lens 8 --request-rate 2.5 --slo ttft=500ms"
    flags += " --pin-cores --mixed '--pd-args=--threads 1' --dtype bfloat16"
    args = build_parser().parse_args(["sweep", "--out", str(tmp_path), *shlex.split(flags)])
    c = config_from_args(args)
    assert c.topologies == ("aggregated", "2e+1pd") and c.images == (1, 10) and c.output_lens == (8,)
    assert c.request_rate == 2.5 and c.arrival == "Poisson 2.5 req/s"
    assert c.slo == SLO(ttft=0.5) and c.pin_cores and c.mixed
    assert c.pd_args == ("--threads", "1") and c.dtype == "bfloat16"
    assert c.log_dir == tmp_path / "logs"
    assert c.lend_cores, "pinned roles lend idle cores unless told not to, as up's do"
    strict = build_parser().parse_args(["sweep", "--out", str(tmp_path), "--pin-cores", "--no-lend-cores"])
    assert not config_from_args(strict).lend_cores
    with pytest.raises(SystemExit):  # closed and open loop at once
        build_parser().parse_args(["sweep", "--out", "x", "--concurrency", "2", "--request-rate", "1"])


def test_bad_flags_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "--out", str(tmp_path), "--images", "1,x"]) == 2
    assert "not an integer" in capsys.readouterr().err
    assert not (tmp_path / "report.md").exists()


def test_a_report_without_matplotlib_has_its_tables_and_no_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the plot extra has
    paths = write_report(synthetic(), tmp_path, plots=False)
    assert [p.name for p in paths] == ["report.md", "sweep.json"]
    assert "|" in paths[0].read_text() and "![" not in paths[0].read_text()


def test_command_line_is_shell_quoted() -> None:
    assert command_line(["/venv/bin/epdserve", "sweep", "--slo", "ttft=1s,e2e=2s"]) == (
        "epdserve sweep --slo ttft=1s,e2e=2s"
    )
    assert command_line(["/x/epdserve/cli.py", "sweep", "--pd-args=--threads 1"]) == (
        "python -m epdserve.cli sweep '--pd-args=--threads 1'"
    )


def test_git_commit_marks_a_dirty_tree(tmp_path: Path) -> None:
    assert git_commit(tmp_path) == "unknown"
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f").write_text("1")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    (tmp_path / "untracked").write_text("ignored, as git describe --dirty does")
    assert git_commit(tmp_path) == head
    (tmp_path / "f").write_text("2")
    assert git_commit(tmp_path) == head + "-dirty"


def test_environment_reads_this_machine() -> None:
    env = Environment.capture("epdserve sweep")
    assert env.nproc >= 1 and env.cpu_model and env.ram_gib > 0
    assert env.commit != "" and env.date[:2] == "20"


# ---- one tiny real sweep ---------------------------------------------------------------------------


def test_tiny_sweep_end_to_end(tmp_path: Path) -> None:
    """aggregated and 1e+1pd started once each; one cell; every request served; the report written."""
    out = tmp_path / "sweep"
    flags = "--topologies aggregated,1e+1pd --images 1 --output-lens 4 --requests 4 --concurrency 2 --warmup 1"
    flags += " --dtype bfloat16"  # every model of every topology
    rc = main(["sweep", "--out", str(out), *shlex.split(flags), "--pin-cores", "--no-progress"])
    assert rc == 0
    data = json.loads((out / "sweep.json").read_text())
    assert [(c["topology"], c["clean"]) for c in data["cells"]] == [("aggregated", True), ("1e+1pd", True)]
    for c in data["cells"]:
        s = c["summary"]
        assert (s["completed"], s["errors"], s["output_tokens"]) == (4, {}, 16)
        assert 0 < s["ttft"]["p50"] <= s["e2e"]["p50"]
    assert [t["topology"] for t in data["topologies"]] == ["aggregated", "1e+1pd"]
    assert all(t["startup_s"] > 0 and t["error"] == "" for t in data["topologies"])
    (gain,) = [g for g in data["gains"] if g["metric"] == "ttft"]
    assert gain["values"][0][0] is not None
    md = (out / "report.md").read_text()
    assert "## Machine" in md and "## Results per cell" in md and "ttft_gain_1e_1pd.png" in md
    assert (out / "ttft_gain_1e_1pd.png").is_file() and (out / "e2e_gain_1e_1pd.png").is_file()
    assert (out / "logs" / "1e_1pd" / "router.log").is_file()
    started = [
        line
        for log in (out / "logs").glob("*/*.log")
        for line in log.read_text().splitlines()
        if " started: model=" in line
    ]
    assert len(started) == 3 and all(" dtype=bfloat16 " in line for line in started)  # pd, encoder, pd


def test_every_cell_has_its_own_payloads() -> None:
    """Cells sharing an images value must not share prompts: a later cell would find them in the
    prefix and encoder caches an earlier cell filled (its warm-up uses seed + 1 too)."""
    c = SweepConfig(images=(0, 1), output_lens=(16, 128), mixed=True)
    seeds = [c.bench(cell, "http://127.0.0.1:1").seed for cell in c.cells]
    assert len(set(seeds)) == len(seeds)
    assert not {s + 1 for s in seeds} & set(seeds)
    assert seeds == [c.bench(cell, "http://127.0.0.1:2").seed for cell in c.cells]  # not per deployment
