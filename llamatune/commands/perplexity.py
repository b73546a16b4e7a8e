"""Perplexity with llama-perplexity's protocol (tools/perplexity/perplexity.cpp):

- the whole text is tokenized once (BOS added when the vocab adds BOS);
- it is cut into floor(n_tokens / n_ctx) consecutive windows of n_ctx tokens;
- the first token of each window is replaced by BOS when the vocab adds BOS;
- only the second half is scored: logits at positions first..n_ctx-2 (first = n_ctx/2)
  predict the tokens after them, n_ctx - 1 - first tokens per window;
- nll and nll^2 are summed in float64; PPL = exp(mean nll), and the reported
  uncertainty is PPL * sqrt((mean(nll^2) - mean(nll)^2) / (count - 1)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import LlamatuneError
from ..models.infer import Runner


@dataclass
class PerplexityResult:
    ppl: float
    ppl_err: float
    n_tokens: int          # tokens in the text
    n_windows: int
    n_scored: int
    chunk_ppls: list[float]  # running PPL after each window, as llama-perplexity prints


def make_windows(tokens: list[int], n_ctx: int, bos_id: int | None, add_bos: bool, source: str) -> np.ndarray:
    """(n_windows, n_ctx) windows with the first token replaced by BOS where the vocab adds BOS."""
    if len(tokens) < 2 * n_ctx:
        raise LlamatuneError(f"{source}: {len(tokens)} tokens; perplexity with a context of {n_ctx} "
                             f"needs at least {2 * n_ctx} tokens (use a smaller -c or a longer text)")
    n_windows = len(tokens) // n_ctx
    windows = np.asarray(tokens[: n_windows * n_ctx], np.int64).reshape(n_windows, n_ctx).copy()
    if add_bos and bos_id is not None:
        windows[:, 0] = bos_id
    return windows


def perplexity(runner: Runner, text: str, n_ctx: int, n_batch: int, source: str = "text",
               on_window: Callable[[int, int, float], None] | None = None) -> PerplexityResult:
    """Score `text` as llama-perplexity does; `on_window(done, total, running_ppl)` reports progress."""
    model = runner.model
    if not text.strip():
        raise LlamatuneError(f"{source}: text is empty")
    if n_ctx < 4:
        raise LlamatuneError(f"context size {n_ctx} is too small (at least 4)")
    if n_ctx > model.config.n_ctx_train:
        raise LlamatuneError(f"context size {n_ctx} is larger than the model's context length "
                             f"{model.config.n_ctx_train} ({model.path.name})")
    tok = model.tokenizer
    tokens = tok.encode(text, add_special=True)
    windows = make_windows(tokens, n_ctx, tok.bos_id, tok.add_bos, source)
    n_windows = len(windows)
    first = n_ctx // 2
    per_batch = max(1, n_batch // n_ctx)

    nll = nll2 = 0.0
    count = 0
    chunk_ppls: list[float] = []
    for start in range(0, n_windows, per_batch):
        batch = windows[start:start + per_batch]
        with np.errstate(over="ignore", invalid="ignore"):       # non-finite results are reported below
            logits = runner.forward(batch)                               # (B, n_ctx, V) on the device
        xp = runner.xp
        scored = xp.ascontiguousarray(logits[:, first:n_ctx - 1]).reshape(-1, logits.shape[-1])
        # targets: the original tokens (not the BOS replacement; it is never a target here)
        targets = runner.backend.to_device(np.ascontiguousarray(batch[:, first + 1:]).reshape(-1))
        losses = xp.empty(len(targets), np.float32)
        runner.ops.cross_entropy.cross_entropy_forward(losses, scored, targets)
        per_window = runner.backend.to_host(losses).reshape(len(batch), -1).astype(np.float64)
        for row in per_window:
            nll += float(row.sum())
            nll2 += float((row * row).sum())
            count += len(row)
            chunk_ppls.append(_ppl(nll, count, len(chunk_ppls), runner))
            if on_window is not None:
                on_window(len(chunk_ppls), n_windows, chunk_ppls[-1])

    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = chunk_ppls[-1]
    err = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0
    if not math.isfinite(err):
        raise LlamatuneError(f"the perplexity's uncertainty is not finite ({err}): the losses overflow "
                             f"({runner.model.path.name})")
    return PerplexityResult(ppl, err, len(tokens), n_windows, count, chunk_ppls)


def _ppl(nll: float, count: int, window: int, runner: Runner) -> float:
    """exp(mean nll), or one error line when the losses are not finite or overflow exp."""
    mean = nll / count
    if not math.isfinite(mean) or mean > 709.0:       # exp(709.8) is the largest finite float64
        what = "nan" if math.isnan(mean) else "inf"
        raise LlamatuneError(f"perplexity is {what} from window {window + 1} on (mean loss {mean:.4g}): "
                             f"the outputs of {runner.model.path.name} are not finite numbers (non-finite or "
                             "huge weights, or adapter scales)")
    return math.exp(mean)
