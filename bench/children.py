"""Run a benchmark script once per thread count, each in a fresh process whose numba
and BLAS thread counts are set before they load; collect the JSON rows it prints."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def rows_per_thread_count(script: str, threads: str, args: list[str]) -> list[dict]:
    """`script --threads-child N *args` for each N of the comma-separated `threads`;
    the rows of the JSON list each child prints last. Exits with a child's stderr if it fails."""
    rows = []
    for n in (int(t) for t in threads.split(",")):
        env = dict(os.environ, NUMBA_NUM_THREADS=str(n), OPENBLAS_NUM_THREADS=str(n),
                   OMP_NUM_THREADS=str(n), MKL_NUM_THREADS=str(n))
        res = subprocess.run([sys.executable, script, "--threads-child", str(n), *args],
                             env=env, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(res.stderr)
        rows += json.loads(res.stdout.strip().splitlines()[-1])
    return rows


def printed_as_json(rows: list[dict], as_json: bool) -> bool:
    """Print one JSON object per row where --json asks for it; True when they were printed."""
    if as_json:
        for r in rows:
            print(json.dumps(r))
    return as_json


def median_fwd_bwd_ms(ops: dict, repeat: int) -> dict[str, dict[str, float]]:
    """{name: {"fwd_ms": ..., "bwd_ms": ...}} for ops {name: (forward, backward)}: each
    callable run once to compile and warm up, then `repeat` rounds of every op in turn
    (so that the ops share the machine's state alike); the median of each, in ms."""
    import time
    times = {(name, p): [] for name in ops for p in ("fwd", "bwd")}
    for fwd, bwd in ops.values():
        fwd()
        bwd()
    for _ in range(repeat):
        for name, (fwd, bwd) in ops.items():
            for p, fn in (("fwd", fwd), ("bwd", bwd)):
                t0 = time.perf_counter()
                fn()
                times[(name, p)].append(time.perf_counter() - t0)
    medians = {name: {} for name in ops}
    for (name, p), ts in times.items():
        medians[name][p + "_ms"] = round(sorted(ts)[len(ts) // 2] * 1e3, 1)
    return medians
