"""Statistics of each linear weight's input, for importance-weighted and
error-compensating quantization (llamatune export-lora; llama-quantize --imatrix).

`InputStats` is called as `stats(name, x)` with the input x (N, n_in) of weight
`name` at every matmul (infer.Runner calls its `observer` so; a training forward can
do the same). Per weight it keeps

  * sum over tokens of x^2 per column and the token count: llama.cpp's imatrix
    (formats/imatrix.py writes it for llama-quantize);
  * for the weights `hessian_for(name)` selects, the sum of x x^T (n_in, n_in), the
    second moment GPTQ needs; with `block`, only its diagonal blocks of `block`
    columns (an input at most that wide keeps the whole matrix). Weights fed the same
    array in consecutive calls (q, k, v of a layer; gate and up) share one input, so
    one matrix and one count.

Memory: n_in x min(n_in, block) float32 per distinct input. Llama-2-7B has per layer
three 4096-wide inputs (attention in, attention out, ffn in) and one 11008-wide
(ffn_down in): whole, 3 * 64 MiB + 462 MiB = 654 MiB, 20.4 GiB for 32 layers; in
blocks of 1024 (export-lora's default), 3 * 16 + 42 = 90 MiB, 2.8 GiB -- and
`Calibration` runs the text again for the next layers once `budget` bytes are used
(Qwen2.5-0.5B: 2.4 GiB whole, 0.64 GiB in blocks).
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from ..errors import LlamatuneError
from ..formats.imatrix import IMatrix


def block_width(n_in: int, block: int) -> int:
    """Columns per diagonal block of an n_in-wide input's second moment (block 0: whole)."""
    return block if 0 < block < n_in else n_in


class InputStats:
    """Accumulates input statistics from (name, x) calls; see the module docstring."""

    def __init__(self, hessian_for: Callable[[str], bool] = lambda name: False, diagonal: bool = True,
                 bf16: bool = False, block: int = 0):
        self.hessian_for = hessian_for
        self.diagonal = diagonal           # collect sum x^2 (off for later calibration passes)
        self.bf16 = bf16                   # sum x x^T as a bf16 product with f32 accumulation (oneDNN)
        self.block = block                 # > 0: keep only the diagonal blocks of this width
        self.key: dict[str, str] = {}      # weight name -> the first weight name reading the same input
        self.sum_sq: dict[str, np.ndarray] = {}   # key -> (n_in,) float64
        self.count: dict[str, int] = {}           # key -> tokens seen
        self.xxt: dict[str, list[np.ndarray]] = {}   # key -> sum x x^T float32: [(n_in, n_in)] or its blocks
        self._prev: tuple[object, str] | None = None
        self._upper: set[tuple[str, int]] = set()   # (key, block) holding only its upper 2x2 blocks

    def __call__(self, name: str, x) -> None:
        prev_x, prev_key, prev_h = self._prev if self._prev is not None else (None, None, False)
        same = x is prev_x
        key = self.key.setdefault(name, prev_key if same else name)
        if same and key == prev_key:                        # the same input, already counted:
            if prev_h or not self.hessian_for(name):        # its second moment too, unless only a
                return                                      # later sharer (k after q) wants it
            self._prev = (x, key, True)
            self._add_xxt(key, self._host(x))
            return
        want = self.hessian_for(name)
        self._prev = (x, key, want)
        x = self._host(x)
        self.count[key] = self.count.get(key, 0) + x.shape[0]
        if self.diagonal:
            sq = np.einsum("ij,ij->j", x, x, dtype=np.float64)
            if key in self.sum_sq:
                self.sum_sq[key] += sq
            else:
                self.sum_sq[key] = sq
        if want:
            self._add_xxt(key, x)

    @staticmethod
    def _host(x) -> np.ndarray:
        x = x.get() if hasattr(x, "get") else x             # a device array comes to the host
        return np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])

    def _add_xxt(self, key: str, x: np.ndarray) -> None:
        n = x.shape[1]
        width = block_width(n, self.block)
        cuts = [(a, min(n, a + width)) for a in range(0, n, width)]
        first = key not in self.xxt
        if first:
            self.xxt[key] = [np.empty((b - a, b - a), np.float32) for a, b in cuts]
        if not self.bf16:
            for h, (a, b) in zip(self.xxt[key], cuts):
                xs = x[:, a:b]
                if first:
                    h[...] = xs.T @ xs
                else:
                    h += xs.T @ xs
            return
        from ..kernels import bf16
        xt = np.empty(x.shape[::-1], np.uint16)               # x^T in bf16 (2048 x 4864: 14 ms, 48 by a copy)
        bf16.to_bf16_transposed(xt, x)
        for i, (h, (a, b)) in enumerate(zip(self.xxt[key], cuts)):
            self._xxt_bf16(h, xt[a:b], first, (key, i))

    def _xxt_bf16(self, h: np.ndarray, xt: np.ndarray, first: bool, part: tuple[str, int]) -> None:
        """h += x^T x (xt: x^T as bf16) accumulated in f32: 3-4x numpy's f32 rate for
        the 4864-wide inputs of Qwen2.5-0.5B's ffn_down (AMX), which took most of a
        calibration pass; the rounding (relative 2^-9 per factor) is far below the
        damping the factorization adds. Wide blocks get only the three upper blocks of
        a 2x2 split (3/4 of the flops); hessian() mirrors them."""
        from ..kernels import bf16
        n = h.shape[0]
        if n < 1024:
            bf16.gemm(h, xt, xt, trans_b=True, accumulate=not first)
            return
        self._upper.add(part)
        k = n // 2
        for rows, cols in ((slice(0, k), slice(0, k)), (slice(0, k), slice(k, n)), (slice(k, n), slice(k, n))):
            bf16.gemm(h[rows, cols], xt[rows], xt[cols], trans_b=True, accumulate=not first)

    def hessian(self, name: str) -> tuple[str, np.ndarray | list[np.ndarray]] | None:
        """(key, E[x x^T] float64) of the input of weight `name` (with `block`: the list
        of its diagonal blocks where the input is wider), None if not collected."""
        key = self.key.get(name)
        if key not in self.xxt or not self.count.get(key):
            return None
        blocks = []
        for i, h in enumerate(self.xxt[key]):
            if (key, i) in self._upper:                       # mirror the upper blocks, once
                k = h.shape[0] // 2
                h[k:, :k] = h[:k, k:].T
                self._upper.discard((key, i))
            blocks.append(h.astype(np.float64) / self.count[key])
        return key, blocks if len(blocks) > 1 else blocks[0]

    @property
    def hessian_bytes(self) -> int:
        return sum(h.nbytes for blocks in self.xxt.values() for h in blocks)

    def imatrix(self, datasets: Iterable[str] = (), chunk_count: int = 0, chunk_size: int = 0) -> IMatrix:
        """The diagonal statistics per weight name, as llama.cpp's imatrix holds them."""
        m = IMatrix(datasets=list(datasets), chunk_count=chunk_count, chunk_size=chunk_size)
        for name, key in self.key.items():
            if key in self.sum_sq:
                m.sums[name], m.counts[name] = self.sum_sq[key], self.count[key]
        return m


def _layer(name: str, n_layer: int) -> int:
    """The layer a weight belongs to (blk.N.*), n_layer for the head."""
    return int(name.split(".")[1]) if name.startswith("blk.") else n_layer


class _Enough(Exception):
    """Raised by the observer to end a calibration forward once its last weight is seen."""


def calibration_windows(tokenizer, text: str, n_ctx: int, n_chunks: int, source: str) -> np.ndarray:
    """Up to n_chunks consecutive windows (n, n_ctx) of the tokenized text, each
    starting with BOS where the vocabulary adds one (as llama-imatrix)."""
    if not text.strip():
        raise LlamatuneError(f"{source}: calibration text is empty")
    need = n_chunks * n_ctx
    length = 8 * need + 4096              # a prefix of the text, 8 characters a token, grown while short
    while True:                           # (a 5 MB text took 5 s to tokenize whole for 8192 tokens)
        tokens = tokenizer.encode(text[:length], add_special=True)
        if length >= len(text) or len(tokens) >= need + 256:       # the cut lies well past what is used
            break
        length *= 2
    n = min(n_chunks, len(tokens) // n_ctx)
    if n < 1:
        raise LlamatuneError(f"{source}: {len(tokens)} tokens, fewer than one calibration window of {n_ctx}")
    windows = np.asarray(tokens[: n * n_ctx], np.int64).reshape(n, n_ctx).copy()
    if tokenizer.add_bos and tokenizer.bos_id is not None:
        windows[:, 0] = tokenizer.bos_id
    return windows


class Calibration:
    """Input statistics of a model (with its adapters) over calibration windows.

    The first pass collects the diagonal statistics of every weight; the second
    moments of the weights in `ordered` (the order they will be asked for) are
    collected in passes that each hold at most `budget` bytes of them, a pass
    stopping its forward after its last weight."""

    def __init__(self, runner, windows: np.ndarray, ordered: list[str], budget: int, batch: int = 1,
                 progress: Callable[[str], None] | None = None, bf16: bool = False, block: int = 0):
        self.runner, self.windows, self.ordered, self.budget = runner, windows, ordered, budget
        self.bf16, self.block = bf16, block                        # InputStats.bf16, .block
        self.batch, self.progress = batch, progress or (lambda s: None)
        self.n_passes = 0
        self._stream: dict[int, dict] = {}    # window index -> {layer: the residual stream it received}
        n_in = {n: self.runner.model.file.tensor(n).n_cols for n in ordered}
        # bytes per weight's moments (at most: a last block is narrower)
        self._bytes = {n: 4 * n_in[n] * block_width(n_in[n], block) for n in ordered}
        self.diag = self._pass(self._chunk(0), diagonal=True)     # every weight's sum x^2
        self.current = self.diag                                    # holds the second moments

    def _chunk(self, start: int) -> set[str]:
        """ordered[start:...] while their (unshared, so pessimistic) sizes fit the budget."""
        names, used = set(), 0
        for n in self.ordered[start:]:
            if names and used + self._bytes[n] > self.budget:
                break
            names.add(n)
            used += self._bytes[n]
        return names

    def _pass(self, names: set[str], diagonal: bool) -> InputStats:
        """One forward over the windows, collecting the statistics of `names` (the
        diagonal ones of every weight when `diagonal`). A pass keeps, per batch of
        windows, the residual stream at the start of its last layer and of the layer
        after it (where it stops); the next pass starts at the latest of those at or
        before its first weight's layer instead of at the embeddings (a Llama-2-7B in
        2 GiB passes: about 11 passes, each running its own ~3 layers rather than all
        the layers before them too)."""
        n_layer = self.runner.cfg.n_layer
        stats = InputStats(names.__contains__, diagonal, self.bf16, self.block)
        first = 0 if diagonal else min(_layer(n, n_layer) for n in names)
        stop = max(_layer(n, n_layer) for n in names) if names else n_layer

        def observe(name, x):
            stats(name, x)
            if name == "output.weight":                             # the head's product is not needed
                raise _Enough
        self.runner.observer = observe
        self.n_passes += 1
        try:
            for i in range(0, len(self.windows), self.batch):
                self.progress(f"calibration pass {self.n_passes}: window {i + 1}/{len(self.windows)}")
                kept = self._stream.setdefault(i, {})
                ready = [k for k in kept if k <= first]
                start = (max(ready), kept[max(ready)]) if ready else None
                for layer in [k for k in kept if start is not None and k < start[0]]:
                    del kept[layer]                                 # (a later pass never goes back)

                def at_layer(layer, x, kept=kept):
                    if layer in (stop, stop + 1):
                        if layer not in kept:
                            kept[layer] = np.empty(x.shape, x.dtype)
                        kept[layer][...] = x
                    if layer == stop + 1 and not diagonal:
                        raise _Enough
                try:
                    self.runner.forward(self.windows[i:i + self.batch], start=start, at_layer=at_layer)
                except _Enough:
                    pass
        finally:
            self.runner.observer = None
        return stats

    def hessian(self, name: str) -> tuple[str, np.ndarray] | None:
        """(key, E[x x^T]) for weight `name` (one of `ordered`), running a pass if needed."""
        if name not in self.ordered:
            return None
        found = self.current.hessian(name)
        if found is None:
            self.diag.xxt.clear()
            self.current = None                                     # free before the next pass
            self.current = self._pass(self._chunk(self.ordered.index(name)), diagonal=False)
            found = self.current.hessian(name)
        return found

    def imatrix(self, source: str) -> IMatrix:
        return self.diag.imatrix([source], len(self.windows), self.windows.shape[1])
