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
