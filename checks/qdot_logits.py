"""Check: the logits of one decode step with the products on the quantized blocks
(kernels/qdot.py, the runner's decode path) against today's path (weights dequantized
to float32), on the same prompt and KV cache (a script, not a test: it wants real models).

For each model: the prompt is prefilled once (float32 path, T > 1), then the next token
is decoded with `Runner.quantized_decode` off and on, from copies of the same cache.
Printed: the largest difference relative to the largest |logit|, the same for the
softmax probabilities, whether the greedy token agrees, and the overlap of the top 10.
Then 8 copies of the prompt are decoded together (G = 8) and each row must equal the
single decode's bits (the products are per row; batching changes nothing).

llama.cpp computes its decode products this way (activations quantized per block to
q8_0 / q8_K, integer dots), so the difference is the part of the gap to llama.cpp's
logits that the float32 path had. With --llama-bin, each model's greedy continuation
(--greedy tokens) by llama-completion is compared with ours, decode steps quantized and
float32: the length of the text the two share from the start.

    python -m checks.qdot_logits MODEL.gguf [MODEL.gguf ...] [--prompt TEXT]
        [--llama-bin DIR [--llama-arg=-nr] [--greedy 48]]
"""
from __future__ import annotations

import argparse
import copy
import subprocess
from pathlib import Path

import llamatune  # noqa: F401  (threading policy first)
import numpy as np

from llamatune.models.infer import KVCache, Runner
from llamatune.models.model import Model
from llamatune.models.sampling import generate_ids

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def decode(runner: Runner, cache: KVCache, token: int, rows: int, quantized: bool) -> np.ndarray:
    """logits (rows, V) of decoding `token` after `cache` (copied, left as it is)."""
    c = copy.deepcopy(cache)
    if rows > 1:
        c.k = [np.repeat(k, rows, axis=0) for k in c.k]
        c.v = [np.repeat(v, rows, axis=0) for v in c.v]
    runner.quantized_decode = quantized
    return runner.forward(np.full((rows, 1), token), c)[:, -1]


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z.astype(np.float64) - z.max())
    return e / e.sum()


def check(path: str, prompt: str) -> bool:
    model = Model(path)
    runner = Runner(model)
    ids = model.tokenizer.encode(prompt, add_special=True)
    cache = KVCache.empty(model, 1, len(ids) + 1, context=4096)
    runner.forward(np.asarray([ids[:-1]]), cache)
    f32 = decode(runner, cache, ids[-1], 1, False)[0]
    q = decode(runner, cache, ids[-1], 1, True)[0]
    q8 = decode(runner, cache, ids[-1], 8, True)
    rel = float(np.abs(q - f32).max() / np.abs(f32).max())
    prel = float(np.abs(softmax(q) - softmax(f32)).max() / softmax(f32).max())
    top = len(set(np.argsort(-q)[:10]) & set(np.argsort(-f32)[:10]))
    same = all(np.array_equal(row.view(np.uint32), q.view(np.uint32)) for row in q8)
    print(f"{path}: {len(ids)} prompt tokens; quantized vs f32 decode logits: max |diff| / max |logit| "
          f"{rel:.2e}, probabilities {prel:.2e}, greedy {'same' if q.argmax() == f32.argmax() else 'DIFFERENT'}, "
          f"top-10 overlap {top}/10; G=8 rows equal G=1 bit for bit: {same}")
    return same


def shared_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def greedy_against_llama(path: str, a) -> None:
    """Characters of llama-completion's greedy continuation that ours repeats from the start."""
    r = subprocess.run([str(Path(a.llama_bin) / "llama-completion"), "-m", path, "-p", a.prompt, "-n", str(a.greedy),
                        "--temp", "0", "-t", "2", "-no-cnv", "--ignore-eos", "-c", "4096", *a.llama_arg],
                       capture_output=True, text=True)
    if r.returncode or a.prompt not in r.stdout:
        raise SystemExit(f"llama-completion failed ({r.returncode}):\n{(r.stdout + r.stderr)[-1500:]}")
    theirs = r.stdout.split(a.prompt, 1)[1]
    model = Model(path)
    runner = Runner(model)
    ids = model.tokenizer.encode(a.prompt, add_special=True)
    for quantized in (True, False):
        runner.quantized_decode = quantized
        ours = model.tokenizer.decode(list(generate_ids(runner, ids, a.greedy, temp=0.0, n_ctx=4096)))
        n = shared_prefix(ours, theirs)
        print(f"{path}: greedy, decode steps {'quantized' if quantized else 'float32'}: the first {n} of "
              f"llama.cpp's {len(theirs)} characters; ours then: {ours[n:n + 40]!r}, llama.cpp's: {theirs[n:n + 40]!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--llama-bin", help="llama.cpp's bin folder: compare greedy continuations")
    ap.add_argument("--llama-arg", action="append", default=[], help="an argument added to llama-completion")
    ap.add_argument("--greedy", type=int, default=48, help="greedy tokens compared with llama.cpp's")
    a = ap.parse_args()
    ok = [check(m, a.prompt) for m in a.models]
    if a.llama_bin:
        for m in a.models:
            greedy_against_llama(m, a)
    raise SystemExit(0 if all(ok) else 1)


if __name__ == "__main__":
    main()
