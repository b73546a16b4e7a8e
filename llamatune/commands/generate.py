"""Text generation with a KV cache: prompt prefill, then one token at a time.

Sampling follows llama.cpp's common order: top-k, then top-p (nucleus), then
temperature; temperature 0 means greedy (argmax). Randomness comes from a seeded
`numpy.random.Generator`.
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from ..errors import LlamatuneError
from ..models.infer import KVCache, Runner
from ..options import check_number


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


def check_sampling(n_predict: int, temp: float, top_k: int, top_p: float, seed: int, n_ctx: int | None) -> None:
    """Range checks of generate's arguments, with the command-line flag names."""
    check_number("-n/--n-predict", n_predict, 0, also=(-1,))
    check_number("--temp", temp, 0)
    check_number("--top-k", top_k, 0)
    check_number("--top-p", top_p, 0, 1, lo_open=True)
    check_number("--seed", seed, 0)
    if n_ctx is not None:
        check_number("-c/--ctx", n_ctx, 1)


def generate(runner: Runner, prompt: str, n_predict: int, temp: float = 0.8, top_k: int = 40,
             top_p: float = 0.95, seed: int = 0, n_ctx: int | None = None,
             stop_at_eos: bool = True) -> Iterator[int]:
    """Yield generated token ids (the prompt is not echoed). `n_predict` -1 generates
    until EOS or until the context is full."""
    check_sampling(n_predict, temp, top_k, top_p, seed, n_ctx)
    ids = runner.model.tokenizer.encode(prompt, add_special=True)
    if not ids:
        raise LlamatuneError("prompt is empty (and the vocabulary adds no BOS token)")
    stop = {runner.model.tokenizer.eos_id} if stop_at_eos else set()
    return generate_ids(runner, ids, n_predict, temp, top_k, top_p, seed, n_ctx, stop)


def generate_ids(runner: Runner, ids: list[int], n_predict: int, temp: float = 0.8, top_k: int = 40,
                 top_p: float = 0.95, seed: int = 0, n_ctx: int | None = None,
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


def stream_text(runner: Runner, prompt: str, token_ids: Iterator[int], write: Callable[[str], None]) -> list[int]:
    """Write the text of a token stream as it arrives. Each step decodes prompt +
    tokens so far and writes only what is new: this keeps word-initial spaces
    (which a decoder drops at the start of a text) and waits out multi-token UTF-8."""
    tok = runner.model.tokenizer
    prefix = tok.encode(prompt, add_special=False)
    base = tok.decode(prefix)
    out: list[int] = []
    shown = 0
    for t in token_ids:
        out.append(t)
        text = tok.decode(prefix + out)[len(base):]
        if text.endswith("\ufffd"):     # incomplete UTF-8 sequence: wait for more bytes
            continue
        write(text[shown:])
        shown = len(text)
    text = tok.decode(prefix + out)[len(base):]
    if len(text) > shown:
        write(text[shown:])
    return out
