"""Benchmark: where a decode step's CPU time goes, per quantized product type and outside
the products, for one sequence of a GGUF model (greedy, the runner's default decode on
the quantized blocks, kernels/qdot.py).

Each product (`qdot_into`) is timed in CPU seconds (process time) inside the process and
booked under its weight type, the head (the output matrix) apart; "outside" is the rest
of the steps' CPU time (quantizing nothing: norms, rope, attention over the cache, the
sampling, Python). Run it at one thread (NUMBA_NUM_THREADS=1, the default here) so that
CPU time is the work; --rounds repeats the timed generation and prints each round
(a loaded machine disturbs single rounds), and the minimum per row.

    python bench/decode_profile.py --model qwen2.5-coder-0.5b-instruct.gguf [--tokens 32] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "1")
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, os.environ["NUMBA_NUM_THREADS"])

PROMPT = "Once upon a time, in a small village by the sea,"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps a round")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()

    import llamatune  # noqa: F401  (threading policy first)
    from gguf import GGMLQuantizationType as T

    from llamatune.kernels import qdot
    from llamatune.models.runner import make_runner
    from llamatune.models.sampling import generate_ids

    booked: dict[str, float] = {}
    inner = qdot.qdot_into

    def timed_qdot(out, x, data, qtype):
        t = time.process_time()
        inner(out, x, data, qtype)
        key = "head " + T(int(qtype)).name if data.shape[0] == n_vocab else T(int(qtype)).name
        booked[key] = booked.get(key, 0.0) + time.process_time() - t

    qdot.qdot_into = timed_qdot
    r = make_runner(a.model)
    n_vocab = r.cfg.n_vocab
    ids = r.model.tokenizer.encode(PROMPT, add_special=True)
    list(generate_ids(r, ids, 2, 0.0, 40, 0.95, 1, None, set()))           # compile, warm up
    rounds = []
    for _ in range(a.rounds):
        booked.clear()
        t = time.process_time()
        list(generate_ids(r, ids, 1, 0.0, 40, 0.95, 1, None, set()))
        prompt = time.process_time() - t
        pre = dict(booked)
        booked.clear()
        t = time.process_time()
        out = list(generate_ids(r, ids, a.tokens, 0.0, 40, 0.95, 1, None, set()))
        total = time.process_time() - t - prompt
        assert len(out) == a.tokens
        steps = a.tokens - 1                      # the prompt's forward is left out with `pre`
        row = {k: (v - pre.get(k, 0.0)) * 1e3 / steps for k, v in booked.items()}
        row["outside"] = total * 1e3 / steps - sum(row.values())
        row["step"] = total * 1e3 / steps
        rounds.append(row)
        print("  ".join(f"{k} {v:.2f}" for k, v in sorted(row.items())), flush=True)
    print(f"\nCPU ms a decode step, {os.environ['NUMBA_NUM_THREADS']} thread(s), min of {a.rounds} rounds "
          f"of {a.tokens - 1} steps; load {os.getloadavg()[0]:.2f}")
    for k in sorted(rounds[0]):
        print(f"{k:12} {min(rw[k] for rw in rounds):8.2f}")


if __name__ == "__main__":
    main()
