"""Token sampling and the KV-cached generation loop: prompt prefill, then one token
at a time. Used by `generate` and `chat`; `generate_group` decodes GRPO's completions of one
prompt together (train/grpo.py).

Sampling follows llama.cpp's common order: top-k, then top-p (nucleus), then
temperature; temperature 0 means greedy (argmax). Randomness comes from a seeded
`numpy.random.Generator`.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from ..errors import LlamatuneError
from ..options import SamplingOptions
from .infer import KVCache, Runner

D = SamplingOptions            # the defaults, declared once (llamatune/options/)


def sample(logits: np.ndarray, rng: np.random.Generator, temp: float, top_k: int, top_p: float) -> int:
    """Pick one token id from (V,) logits."""
    if temp <= 0:
        return int(np.argmax(logits))
    logits = logits.astype(np.float64)
    if not np.isfinite(logits).all():      # only with --allow-nonfinite weights
        raise LlamatuneError("cannot sample: the model's logits are not finite (its weights hold inf or nan)")
    ids = np.argsort(-logits, kind="stable")
    if 0 < top_k < len(ids):
        ids = ids[:top_k]
    z = logits[ids] / temp
    p = np.exp(z - z.max())
    p /= p.sum()
    if 0 < top_p < 1:
        keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)
        ids, p = ids[:keep], p[:keep] / p[:keep].sum()
    return int(ids[rng.choice(len(ids), p=p)])


def generate_ids(runner: Runner, ids: list[int], n_predict: int, temp: float = D.temp, top_k: int = D.top_k,
                 top_p: float = D.top_p, seed: int = D.seed, n_ctx: int | None = None,
                 stop: set[int] = frozenset()) -> Iterator[int]:
    """Yield ids generated after the prompt ids, ending before any id in `stop`."""
    model = runner.model
    n_ctx = n_ctx or model.config.n_ctx_train
    if len(ids) >= n_ctx:
        raise LlamatuneError(f"prompt has {len(ids)} tokens, more than the context size {n_ctx}")
    n_predict = n_ctx - len(ids) if n_predict == -1 else min(n_predict, n_ctx - len(ids))
    cache = KVCache.empty(model, 1, len(ids) + n_predict, runner.backend, context=n_ctx)   # rope as llama.cpp's -c
    rng = np.random.default_rng(seed)
    logits = runner.backend.to_host(runner.forward(np.asarray([ids]), cache)[0, -1])
    for _ in range(n_predict):
        nxt = sample(logits, rng, temp, top_k, top_p)
        if nxt in stop:
            return
        yield nxt
        if cache.n_past >= cache.n_ctx:
            return
        logits = runner.backend.to_host(runner.forward(np.asarray([[nxt]]), cache)[0, -1])


def sample_rows(logits: np.ndarray, rng: np.random.Generator, temp: float, top_p: float) -> np.ndarray:
    """One token id per row of (n, V) logits, drawn at temperature temp > 0 within the
    nucleus top_p (1: the whole vocabulary), rows in order from `rng`."""
    z = logits.astype(np.float64) / temp
    if not np.isfinite(z).all():
        raise LlamatuneError("cannot sample: the model's logits are not finite (its weights hold inf or nan)")
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    out = np.empty(len(p), np.int64)
    for r in range(len(p)):
        if 0 < top_p < 1:
            ids = np.argsort(-p[r], kind="stable")
            c = np.cumsum(p[r, ids])
            keep = int(np.searchsorted(c, top_p) + 1)
            c = c[:keep]
        else:
            ids, c = None, np.cumsum(p[r])
        k = min(int(np.searchsorted(c, rng.random() * c[-1], side="right")), len(c) - 1)
        out[r] = k if ids is None else ids[k]
    return out


def generate_group(runner: Runner, ids: list[int], n: int, n_predict: int, rng: np.random.Generator,
                   temp: float, top_p: float, stop: set[int] = frozenset()) -> list[list[int]]:
    """n completions of one prompt decoded together (GRPO's group): the prompt is run once,
    its KV cache copied to n rows, then one token for each unfinished row per batched
    decode step (a row that ends leaves the batch and its cache). Each completion ends
    with the first id of `stop` it draws (kept: it is trained on) or at n_predict ids."""
    model = runner.model
    L = len(ids)
    one = KVCache.empty(model, 1, L + n_predict, runner.backend, context=L + n_predict)
    last = runner.backend.to_host(runner.forward(np.asarray([ids]), one)[0, -1])
    cache = one.rows(runner.backend.to_device(np.zeros(n, np.int64)))     # the prompt's cache, n times
    logits = np.broadcast_to(last, (n, len(last)))
    out: list[list[int]] = [[] for _ in range(n)]
    live = np.arange(n)                               # the rows still decoding, in the cache's order
    for step in range(n_predict):
        drawn = sample_rows(logits, rng, temp, top_p)
        for r, t in zip(live, drawn.tolist()):
            out[r].append(t)
        keep = np.flatnonzero([t not in stop for t in drawn.tolist()])
        if not len(keep) or step + 1 == n_predict:
            break
        if len(keep) < len(live):                     # finished rows leave the batch
            idx = runner.backend.to_device(keep)
            cache = cache.rows(idx)
            live = live[keep]
        feed = np.asarray([out[r][-1] for r in live], np.int64)[:, None]
        logits = runner.backend.to_host(runner.forward(feed, cache)[:, -1])
    return out
