"""What of an adapter survives a merge into a quantized model (export-lora's summary).

For a merged matrix with base weight W0 = deq(base), the adapter's update Δ = sum_i s_i B_i A_i
and the written codes Q, with D = deq(Q) - W0 the change the merge made:

  changed    Q's bytes differ from the base tensor's
  update     RMS(Δ) / RMS(D - Δ): the update against the error requantizing put on the
             merged weight (about 0.3 x the type's rounding step per weight); below 1 the
             rounding is as large as what it rounds
  carried    c = <D, Δ>_H / <Δ, Δ>_H, summed over the quantized matrices: the share of the
             update (in the metric of the inputs' second moment H) the change carries.
             H is the calibration's E[x x^T] (its diagonal blocks) where the merge
             measured one, the imatrix's mean x^2 per column where it had one, else 1.
  kept       1 - (1 - c)^2: the estimated share of the adapter's effect on the outputs
             (llama-perplexity's KL shift against the run-time adapter) that the merged
             file keeps. The KL divergence grows with the square of the outputs' error,
             and along Δ the merge leaves (1 - c) Δ of it. On Qwen2.5-Coder-0.5B (40 steps
             of Shakespeare, docs/performance.md) c = 10 %, 55 %, 75 % read 18 %, 80 %,
             94 % against 21 %, 77 %, 85 % of the KL shift measured, and with the update
             2.5x as large 96 %, 99 % (calibrated Q4_0, Q4_K_M) against 94 %, 96 %: the
             error across Δ, which this leaves out, costs a few points more where c is
             large. Weighted by the weights alone (plain merges) it read 9 % and 39 %
             against 19 % and 53 %: low, not high.

Both are measured on up to ROWS evenly spaced rows of each matrix (the rows' errors
are independent of each other; the whole matrix is compared for `changed` only), each a
rank-r product, so the summary costs little beside the merge.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..kernels import dequant

ROWS = 64
TOKEN_EMBD = "token_embd.weight"


@dataclass
class Survival:
    """Accumulated over the merged tensors; see the module docstring."""
    n_merged: int = 0
    n_changed: int = 0
    n_quantized: int = 0                               # merged into a block type: measured
    ratios: list[float] = field(default_factory=list)  # update per measured matrix
    dot: float = 0.0                                   # sum of <D, Δ>_H
    norm: float = 0.0                                  # sum of <Δ, Δ>_H
    metric: str = "weights"                            # what H was: calibration, imatrix, weights

    @property
    def carried(self) -> float | None:
        """c: the share of the update the merge's change carries (module docstring)."""
        return self.dot / self.norm if self.norm > 0 else None

    @property
    def kept(self) -> float | None:
        """The estimated share of the adapter's KL shift the merged file keeps, 1 - (1 - c)^2."""
        c = self.carried
        return None if c is None else max(0.0, 1.0 - (1.0 - c) ** 2)

    def add(self, t, deltas, codes: np.ndarray, qtype, block: bool, h=None, qw=None) -> None:
        """One merged tensor `t` (formats.gguf_io.Tensor) written as `codes` of `qtype`;
        `block`: a quantized block type (measured); h: the second moment of its input
        (a matrix or its diagonal blocks) or qw its diagonal, when the merge had them."""
        self.n_merged += 1
        base = t.raw_rows()
        same = qtype == t.qtype and codes.shape == base.shape and np.array_equal(codes, base)
        self.n_changed += not same
        if not block or len(t.shape) != 2:
            return
        self.n_quantized += 1
        rows = np.unique(np.linspace(0, t.shape[0] - 1, min(ROWS, t.shape[0])).astype(np.int64))
        w0 = dequant.dequantize(np.ascontiguousarray(base[rows]), t.qtype, t.n_cols)
        d = dequant.dequantize(np.ascontiguousarray(codes[rows]), qtype, t.n_cols) - w0
        delta = np.zeros_like(d)
        weighted = np.zeros_like(d)                    # Δ H, row by row
        for a, b, s in deltas:
            left, right = (a[rows], b.T) if t.name == TOKEN_EMBD else (b[rows], a)
            delta += np.float32(s) * (left @ right)
            weighted += np.float32(s) * (left @ _times_h(right, None if t.name == TOKEN_EMBD else h, qw))
        dot, norm = float(np.sum(d * weighted, dtype=np.float64)), float(np.sum(delta * weighted, dtype=np.float64))
        self.dot += dot
        self.norm += norm
        err = float(np.sqrt(np.mean(np.square(d - delta, dtype=np.float64))))
        upd = float(np.sqrt(np.mean(np.square(delta, dtype=np.float64))))
        self.ratios.append(upd / err if err > 0 else float("inf"))

    def summary(self, type_names: str) -> str:
        """One line: how many tensors changed, the update against the rounding, what was kept."""
        line = f"changed {self.n_changed} of {self.n_merged} merged tensors"
        if not self.ratios:
            return line
        r = np.array(self.ratios)
        kept = self.kept
        return (line + f"; in the {self.n_quantized} requantized to {type_names}: the adapter's update is "
                f"{np.median(r):.2g}x the requantization error (RMS; median, {r.min():.2g}-{r.max():.2g}x)"
                + ("" if kept is None else f"; the merge kept about {kept:.0%} of the adapter's effect on the "
                   f"outputs (it carries {self.carried:.0%} of the update, weighted by {self.metric})"))

    def warning(self, low: float, type_names: str) -> str | None:
        """A line when the merge changed nothing, or kept less than `low` (of the KL shift, estimated)."""
        remedy = ("use the adapter at run time (llama.cpp --lora ADAPTER) or merge into a higher-precision "
                  "--outtype (q8_0, f16)")
        if self.n_merged and self.n_changed == 0:
            return (f"the merge changed nothing: the adapter's update is smaller than {type_names}'s rounding, "
                    f"so the merged file equals the base; {remedy}")
        kept = self.kept
        if kept is not None and kept < low:
            return (f"the merge kept only about {kept:.0%} of the adapter's effect on the outputs (it carries "
                    f"{self.carried:.0%} of the update, weighted by {self.metric}; {type_names}'s rounding took "
                    f"the rest); {remedy}")
        return None


def _times_h(a: np.ndarray, h, qw) -> np.ndarray:
    """a (r, n_in) times H: the whole second moment, its diagonal blocks, the diagonal qw,
    or the identity."""
    if h is None:
        return a * qw if qw is not None else a
    if not isinstance(h, list):
        return (a.astype(np.float64) @ h).astype(np.float32)
    out, c = np.empty_like(a), 0
    for block in h:
        n = block.shape[0]
        out[:, c:c + n] = a[:, c:c + n].astype(np.float64) @ block
        c += n
    return out
