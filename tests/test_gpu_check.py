"""``scripts/gpu_check.sh``, the CUDA path's check for a lent GPU, rehearsed on the CPU
(``EPD_CHECK_DEVICE=cpu``): every step it takes runs, so a renamed flag, test or file fails here and
not on the day a GPU is lent. Its ``--vllm`` part is rehearsed in ``tests/test_vllm_up.py``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(1200)


def test_the_gpu_check_runs_every_step_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, EPD_CHECK_DEVICE="cpu", OUT=str(out))
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1100
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "gpu_check: all steps passed" in run.stdout
    assert "cpu" in (out / "device.txt").read_text()
    # each pytest step selected tests and passed them all
    for name in ("oracle", "oracle-families", "server-float32", "server-bfloat16", "server-float16"):
        tail = (out / f"{name}.txt").read_text().strip().splitlines()[-1]
        assert " passed" in tail and "failed" not in tail and "error" not in tail, (name, tail)
    rows = json.loads((out / "engine_vs_hf_cpu.json").read_text())["rows"]
    # both systems at both concurrencies, every request answered
    assert {(r["system"], r["concurrency"]) for r in rows} == {
        (s, c) for s in ("epdserve:aggregated", "transformers") for c in (4, 16)
    }
    assert all(r["ok"] == 64 and r["errors"] == 0 for r in rows), rows
