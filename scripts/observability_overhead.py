"""Observability overhead: epdserve at a commit before the observability work vs at
HEAD, each from a git worktree (``git worktree add /tmp/ab_before 8448d2b``, ``git worktree add
/tmp/ab_after HEAD``), 1e+1pd, the same bench, interleaved runs. Prints req/s, TTFT and E2E p50.

    python scripts/observability_overhead.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

revs = {"before": "/tmp/ab_before", "after": "/tmp/ab_after"}
results = {k: [] for k in revs}
for rnd in range(2):
    for name, tree in revs.items():
        env = dict(os.environ, PYTHONPATH=tree)
        code = f"""
import json, subprocess, sys
from epdserve.up import Deployment, Topology
from epdserve.launcher import free_port
d = Deployment(Topology.parse('1e+1pd'), None, port=free_port())
d.start()
try:
    out = subprocess.run([sys.executable, '-m', 'epdserve.cli', 'bench', '--url', d.url, '-n', '96', '--concurrency', '16',
                          '--output-len', '32', '--image-size', '224', '--out', '/tmp/ab_{name}_{rnd}.json'], capture_output=True, text=True)
finally:
    d.stop()
"""
        subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, timeout=900)
        data = json.loads(Path(f"/tmp/ab_{name}_{rnd}.json").read_text())["summary"]
        results[name].append((data["request_throughput"], data["ttft"]["p50"], data["e2e"]["p50"]))
        print(name, rnd, results[name][-1], flush=True)
for name, rows in results.items():
    print(
        name,
        "req/s",
        [round(r[0], 2) for r in rows],
        "TTFT p50 ms",
        [round(1e3 * r[1], 1) for r in rows],
        "E2E p50 ms",
        [round(1e3 * r[2], 1) for r in rows],
    )
