"""Packed rows (issue 9's --pack) in the training graph: several samples in one row,
rope positions restarting at 0 for each, attention confined to each sample by
segment ids, padding at the end. In float64 a packed batch must give the same
per-token losses and the same parameter gradients as the same samples unpacked,
one per row: for LoRA on every target (llama and qwen2, i.e. NORM and NEOX rope)
and for dense training of every weight."""
from __future__ import annotations

import numpy as np
import pytest

from llamatune.models.weights import FrozenBase
from llamatune.train.step import StepExecutor
from llamatune.train.params import DenseWeights
from llamatune.train.lora import init_lora, lora_specs, lora_targets
from llamatune.models.model import Model
from llamatune.models.writer import random_weights, tensor_names
from llamatune.train.params import ParamBuffer, ParamSpec

from conftest import tiny_config, write_tiny_model

ALL_RANKS = {k: 2 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                            "token_embd", "output", "attn_norm", "ffn_norm", "output_norm")}
LENGTHS = [[4, 1, 5], [6, 3]]     # samples of each packed row (one of a single token)
T_PACKED, T_ALONE = 12, 6         # packed rows end with padding (2 and 3 tokens)
PAD_ID = -1                       # the padding's own segment id


def samples(n_vocab: int, seed: int = 0):
    """Token ids, targets (some -1: context only) and loss weights of each sample."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (n for row in LENGTHS for n in row):
        tokens = rng.integers(0, n_vocab, n)
        targets = rng.integers(0, n_vocab, n)
        targets[rng.random(n) < 0.3] = -1
        out.append((tokens, targets))
    n_targets = sum(int((t >= 0).sum()) for _, t in out)
    return [(tok, tg, (tg >= 0) / n_targets) for tok, tg in out]


def packed_batch(smp):
    """(inputs, targets, weights, positions, segments) of the packed rows, and where
    each sample sits: (row, start)."""
    B = len(LENGTHS)
    inputs, targets = np.zeros((B, T_PACKED), np.int64), np.full((B, T_PACKED), -1)
    weights = np.zeros((B, T_PACKED))
    positions = np.zeros((B, T_PACKED), np.int64)
    segments = np.full((B, T_PACKED), PAD_ID, np.int32)
    where, k = [], 0
    for b, row in enumerate(LENGTHS):
        t = 0
        for sid, n in enumerate(row):
            tok, tg, w = smp[k]
            inputs[b, t:t + n], targets[b, t:t + n], weights[b, t:t + n] = tok, tg, w
            positions[b, t:t + n], segments[b, t:t + n] = np.arange(n), 10 + sid
            where.append((b, t))
            t, k = t + n, k + 1
        positions[b, t:] = np.arange(T_PACKED - t)   # padding: positions of its own, no targets
    return (inputs, targets, weights, positions, segments), where


def alone_batch(smp):
    """The same samples one per row, padded to T_ALONE."""
    B = len(smp)
    inputs, targets = np.zeros((B, T_ALONE), np.int64), np.full((B, T_ALONE), -1)
    weights = np.zeros((B, T_ALONE))
    for b, (tok, tg, w) in enumerate(smp):
        n = len(tok)
        inputs[b, :n], targets[b, :n], weights[b, :n] = tok, tg, w
    return inputs, targets, weights


def run(make_graph, params, B, T, inputs, targets, weights, **packing):
    params.zero_grad()
    g = make_graph(B, T)
    loss = g.step(inputs, targets, weights, **packing)
    return loss, g.losses.reshape(B, T).copy(), params.grad.copy()


def check_equivalence(make_graph, params, n_vocab):
    smp = samples(n_vocab)
    (inputs, targets, weights, positions, segments), where = packed_batch(smp)
    loss_p, losses_p, grad_p = run(make_graph, params, len(LENGTHS), T_PACKED, inputs, targets, weights,
                                   positions=positions, segments=segments)
    loss_a, losses_a, grad_a = run(make_graph, params, len(smp), T_ALONE, *alone_batch(smp))
    for k, (b, t) in enumerate(where):                 # every token's loss, sample by sample
        n = len(smp[k][0])
        np.testing.assert_allclose(losses_p[b, t:t + n], losses_a[k, :n], rtol=1e-12, atol=1e-12)
    assert loss_p == pytest.approx(loss_a, rel=1e-12)
    assert np.abs(grad_a).max() > 0
    np.testing.assert_allclose(grad_p, grad_a, rtol=1e-9, atol=1e-13)
    # the test can fail: without segments the packed samples see each other and the
    # gradients differ. (Without the restarting positions they differ only by the
    # float32 rounding of the rope angles: rope scores depend on p_i - p_j alone.)
    _, _, grad = run(make_graph, params, len(LENGTHS), T_PACKED, inputs, targets, weights, positions=positions)
    assert not np.allclose(grad, grad_a, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_rows_equal_samples_alone_lora(tmp_path, tiny_vocab, arch):
    model = Model(write_tiny_model(tmp_path / "m.gguf", tiny_vocab, arch=arch, n_embd=32, n_ff=48,
                                   head_dim=8, n_rot=8))
    cfg = model.config
    targets = lora_targets(cfg, ALL_RANKS, alpha=3.0, tied=False)
    params = ParamBuffer(lora_specs(targets), np.float64)
    init_lora(params, targets, np.random.default_rng(0))
    params.data[...] += np.random.default_rng(1).normal(0, 0.05, params.size)  # B != 0: every path carries gradient
    base = FrozenBase(model)
    check_equivalence(lambda B, T: StepExecutor(cfg, base, params, targets, B, T, dtype=np.float64), params,
                      cfg.n_vocab)


def test_packed_rows_equal_samples_alone_dense():
    cfg = tiny_config(n_embd=16, n_ff=24, head_dim=4, n_rot=4, n_vocab=400)
    shapes = tensor_names(cfg)
    params = ParamBuffer([ParamSpec(n, s) for n, s in shapes.items()], np.float64)
    for n, a in random_weights(cfg, seed=3, std=0.2).items():
        params[n][...] = a
    weights = DenseWeights(params)
    check_equivalence(lambda B, T: StepExecutor(cfg, weights, params, [], B, T, dtype=np.float64), params,
                      cfg.n_vocab)


def test_positions_beyond_the_row_and_bad_packing(tiny_vocab, tmp_path):
    """Positions past T grow the rope cache (a sample continued from an earlier
    window gets the same angles as in a longer row); malformed arrays are refused."""
    model = Model(write_tiny_model(tmp_path / "m.gguf", tiny_vocab, n_embd=32, n_ff=48, head_dim=8, n_rot=8))
    cfg = model.config
    params = ParamBuffer([], np.float64)
    long = StepExecutor(cfg, FrozenBase(model), params, [], 1, 10, dtype=np.float64)
    short = StepExecutor(cfg, FrozenBase(model), params, [], 1, 4, dtype=np.float64)
    rng = np.random.default_rng(2)
    inputs, targets = rng.integers(0, cfg.n_vocab, (1, 10)), rng.integers(0, cfg.n_vocab, (1, 10))
    w = np.full((1, 10), 0.1)
    long.step(inputs, targets, w)
    short.step(inputs[:, 6:], targets[:, 6:], w[:, 6:], positions=np.arange(6, 10)[None])
    np.testing.assert_array_equal(short.ropes[0][0], long.ropes[0][0][None, 6:10])
    with pytest.raises(ValueError, match=r"positions must be an integer array of shape \(1, 4\)"):
        short.step(inputs[:, :4], targets[:, :4], w[:, :4], positions=np.zeros((1, 5), np.int64))
    with pytest.raises(ValueError, match="sample id 1 appears in two separate runs"):
        short.step(inputs[:, :4], targets[:, :4], w[:, :4], segments=np.array([[1, 2, 1, 1]]))

