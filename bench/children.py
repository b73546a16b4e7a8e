"""Run a benchmark script once per thread count, each in a fresh process whose numba
and BLAS thread counts are set before they load; collect the JSON rows it prints."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


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


def per_type_parser(doc: str, types: str, threads: str, repeat: int) -> argparse.ArgumentParser:
    """The command line of a benchmark timed per GGML type in one child per thread count:
    --threads, --repeat, --types (comma-separated), --json and the children's
    --threads-child; a script adds its own options."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--threads", default=threads, help="comma-separated thread counts")
    ap.add_argument("--repeat", type=int, default=repeat)
    ap.add_argument("--types", default=types, help="comma-separated GGML type names")
    ap.add_argument("--json", action="store_true", help="print one JSON object per row")
    ap.add_argument("--threads-child", type=int, help=argparse.SUPPRESS)
    return ap


def per_type_main(script: str, args, child, title: str, columns: list[tuple[str, str, int]]) -> None:
    """A per_type_parser benchmark's run (args.types a list): child(args) in a child
    (--threads-child); else the children's rows (rows_per_thread_count), one JSON object
    each with --json, or under `title` a table of `columns` (key, header, width)."""
    if args.threads_child:
        child(args)
        return
    rows = rows_per_thread_count(script, args.threads, ["--types", ",".join(args.types), "--repeat", str(args.repeat)])
    if printed_as_json(rows, args.json):
        return
    print(title)
    print(" ".join(f"{header:>{width}}" for _, header, width in columns))
    for r in rows:
        print(" ".join(f"{r[key]:>{width}}" for key, _, width in columns))


def best_seconds(fn, repeat: int) -> float:
    """The least time of `repeat` calls of fn after one (compilation, warm-up): the least
    disturbed by other processes on a shared machine."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


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
