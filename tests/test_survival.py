"""models/survival.py: the share of the update a merge carries, c = <D, Δ>_H / <Δ, Δ>_H, and
the KL shift it is read as, 1 - (1 - c)^2, on hand-made merges whose codes are known."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from llamatune.kernels import dequant
from llamatune.kernels.quantize import quantize
from llamatune.models.survival import Survival


class _Tensor:
    """The two things Survival.add reads of a formats.gguf_io.Tensor."""

    def __init__(self, name, codes, qtype, shape):
        self.name, self.qtype, self.shape, self._codes = name, qtype, shape, codes
        self.n_cols = shape[1]

    def raw_rows(self):
        return self._codes


def _merge(seed=0, rows=64, cols=256, rank=4):
    """A Q8_0 base (every value on the grid of step 1/4) and a rank-`rank` update Δ of RMS about
    2, eight steps: merged as w0 + c x Δ, Q8_0's rounding changes the carried share little."""
    rng = np.random.default_rng(seed)
    w0 = np.round(rng.standard_normal((rows, cols)) * 4) / 4          # on Q8_0's grid: scale 1/4 per block
    w0[:, ::32] = 127 / 4                                               # every block's max sets that scale
    a = rng.standard_normal((rank, cols)).astype(np.float32)
    a[:, ::32] = 0                                                      # the blocks' scales stay 1/4
    b = rng.standard_normal((rows, rank)).astype(np.float32)
    delta = b @ a
    base = quantize(w0.astype(np.float32), QType.Q8_0)
    return _Tensor("blk.0.attn_q.weight", base, QType.Q8_0, (rows, cols)), w0, delta, a, b


@pytest.mark.parametrize("c", [0.0, 0.1, 0.55, 0.75, 1.0])
def test_kept_is_one_minus_the_square_of_what_was_left_along_the_update(c):
    t, w0, delta, a, b = _merge()
    survival = Survival(metric="the weights alone")
    merged = (w0 + c * delta).astype(np.float32)
    codes = quantize(merged, QType.Q8_0)
    survival.add(t, [(a, b, 1.0)], codes, QType.Q8_0, True)
    # what the codes hold of c·Δ after Q8_0's rounding, in the same metric
    from llamatune.kernels import dequant
    d = dequant.dequantize(codes, QType.Q8_0, t.n_cols).astype(np.float64) - w0
    expect_c = float(np.sum(d * delta) / np.sum(delta.astype(np.float64) ** 2))
    assert survival.carried == pytest.approx(expect_c, rel=1e-4, abs=1e-6)
    assert abs(survival.carried - c) < 0.05
    assert survival.kept == pytest.approx(max(0.0, 1 - (1 - expect_c) ** 2), rel=1e-4, abs=1e-6)
    line = survival.summary("Q8_0")
    assert f"kept about {survival.kept:.0%} of the adapter's effect" in line
    assert f"it carries {survival.carried:.0%} of the update, weighted by the weights alone" in line


def test_the_warning_fires_below_the_threshold_of_kept_not_of_carried():
    """c = 0.4 carries less than half of the update but keeps 64 % of the effect: no warning at
    0.5; c = 0.2 keeps 36 %: the warning, naming both figures and the remedies."""
    lines = {}
    for c in (0.4, 0.2):
        t, w0, delta, a, b = _merge(seed=1)
        survival = Survival(metric="the calibration's inputs")
        survival.add(t, [(a, b, 1.0)], quantize((w0 + c * delta).astype(np.float32), QType.Q8_0), QType.Q8_0, True)
        lines[c] = survival.warning(0.5, "Q8_0")
    assert lines[0.4] is None
    assert lines[0.2] is not None and "kept only about 36% of the adapter's effect" in lines[0.2]
    assert "it carries 20% of the update" in lines[0.2] and "--lora" in lines[0.2] and "--outtype" in lines[0.2]


def test_an_overshoot_and_a_change_against_the_update():
    """c > 1 (the change overshoots) keeps less than all; c < 0 reads 0 %, never negative."""
    for c, kept in ((1.5, 0.75), (-0.5, 0.0)):
        t, w0, delta, a, b = _merge(seed=2)
        survival = Survival()
        survival.add(t, [(a, b, 1.0)], quantize((w0 + c * delta).astype(np.float32), QType.Q8_0), QType.Q8_0, True)
        assert survival.kept == pytest.approx(kept, abs=0.05)
        assert survival.kept >= 0.0
