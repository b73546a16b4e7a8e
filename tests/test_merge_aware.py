"""Merge-aware training (--merge-aware, train/linear.py): the forward of an adapted
quantized matrix is the plain merge's deq(Q(W + s B A)), the gradients are the
straight-through ones."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from fdcheck import fd_check
from llamatune.commands.export import export_lora
from llamatune.commands.finetune import finetune
from llamatune.errors import LlamatuneError
from llamatune.formats.adapter import write_adapter
from llamatune.formats.gguf_io import GGUFFile
from llamatune.kernels.dequant import dequantize
from llamatune.models.infer import Runner
from llamatune.models.model import Model
from llamatune.models.weights import FrozenBase
from llamatune.options import FinetuneOptions, MergeOptions
from llamatune.precision import policy
from llamatune.train.step import StepExecutor
from llamatune.train.lora import init_lora, lora_specs, lora_targets, to_adapter
from llamatune.train.params import ParamBuffer

from conftest import TEXT, write_tiny_model

RANKS = {k: 2 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory, tiny_vocab):
    """Matrices in Q4_0 (C 32, F 64: whole blocks of 32)."""
    return Model(write_tiny_model(tmp_path_factory.mktemp("q") / "q4.gguf", tiny_vocab, outtype=QType.Q4_0,
                                  n_embd=32, n_ff=64, head_dim=8, n_rot=8))


def lora(model, dtype, seed=0, std=0.05):
    targets = lora_targets(model.config, RANKS, alpha=3.0, tied=False)
    params = ParamBuffer(lora_specs(targets), dtype)
    init_lora(params, targets, np.random.default_rng(seed))
    params.data[...] += np.random.default_rng(seed + 1).normal(0, std, params.size).astype(dtype)   # B nonzero
    return targets, params


def batch(cfg, B, T, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.n_vocab, (B, T)), rng.integers(0, cfg.n_vocab, (B, T))


def test_forward_is_the_plain_merge(tmp_path, q4_model):
    """Every adapted matrix the graph uses is, bit for bit, the plain merge export-lora
    writes, and the per-token losses are those of the merged model."""
    cfg = q4_model.config
    targets, params = lora(q4_model, np.float32, std=0.2)
    B, T = 2, 48
    g = StepExecutor(cfg, FrozenBase(q4_model), params, targets, B, T, "selective", policy=policy("f32", merge_aware=True))
    adapter = tmp_path / "a.gguf"
    write_adapter(adapter, to_adapter(params, targets, cfg.arch, 3.0))
    merged = tmp_path / "merged.gguf"
    export_lora(q4_model.path, [(adapter, 1.0)], merged, merge=MergeOptions(merge_method="plain"))
    f = GGUFFile(merged)
    for t in targets:
        W, folded = g.linears.matrix(t.weight, B * T)
        W = W.copy()                                            # (the dequantization scratch, reused below)
        m = f.tensor(t.weight)
        assert folded and m.qtype == QType.Q4_0
        np.testing.assert_array_equal(W, dequantize(m.raw_rows(), m.qtype, m.n_cols), err_msg=t.weight)
        base = FrozenBase(q4_model).matrix(t.weight)
        assert not np.array_equal(W, base)                      # the adapter moved the rounded weights
    inputs, tg = batch(cfg, B, T)
    w = np.full((B, T), 1 / (B * T), np.float32)
    g.loss(inputs, tg, w)
    logits = Runner(Model(merged)).forward(inputs).astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = lse - np.take_along_axis(logits, tg[..., None], -1)[..., 0]
    np.testing.assert_allclose(g.losses.reshape(B, T), want, rtol=2e-5, atol=2e-5)


class Shifted(FrozenBase):
    """The straight-through surrogate: each adapted matrix W + C, C = deq(Q(W + s B0 A0)) -
    (W + s B0 A0) a constant, so that at (A0, B0) the forward is merge-aware's and the
    gradient of this smooth function is the straight-through gradient."""

    def __init__(self, model, shift):
        super().__init__(model)
        self.shift = shift

    def matrix(self, name):
        W = super().matrix(name)
        return W + self.shift[name] if name in self.shift else W


@pytest.mark.parametrize("checkpointing", ["selective", pytest.param("layer", marks=pytest.mark.slow)])
def test_gradients_are_straight_through(q4_model, checkpointing):
    cfg = q4_model.config
    targets, params = lora(q4_model, np.float64)
    g = StepExecutor(cfg, FrozenBase(q4_model), params, targets, 2, 5, checkpointing, dtype=np.float64,
              policy=policy("f32", merge_aware=True))
    inputs, tg = batch(cfg, 2, 5, seed=3)
    w = np.full((2, 5), 0.1)
    params.zero_grad()
    g.step(inputs, tg, w)
    analytic = params.grad.copy()
    shift = {}
    for t in targets:
        W = FrozenBase(q4_model).matrix(t.weight).astype(np.float64)
        shift[t.weight] = g.linears.matrix(t.weight, 10)[0] - (W + t.scale * params[t.b] @ params[t.a])
        assert np.abs(shift[t.weight]).max() > 0
    s = StepExecutor(cfg, Shifted(q4_model, shift), params, targets, 2, 5, checkpointing, dtype=np.float64)

    def loss(p):
        params.zero_grad()
        return s.step(inputs, tg, w)
    np.testing.assert_allclose(loss(params.data), g.loss(inputs, tg, w), rtol=1e-12)
    np.testing.assert_allclose(params.grad, analytic, rtol=1e-9, atol=1e-12)
    err = fd_check(loss, {"p": params.data}, {"p": analytic}, eps=1e-5, rtol=1e-5, atol=1e-9, n_probe=40)
    assert err < 1e-5


def test_merge_aware_finetune_and_its_errors(tmp_path, q4_model, tiny_model, capsys):
    (tmp_path / "train.txt").write_text(TEXT)

    def opts(model, **over):
        base = dict(model_base=model, train_data=tmp_path / "train.txt", ctx=16, batch=2, lora_r=2, adam_iter=2,
                    save_every=0, warmup=1, merge_aware=True, overwrite=True,   # the refusals run in one folder
                    checkpoint_out=tmp_path / "chk-ITERATION.gguf",
                    lora_out=tmp_path / "adapter-ITERATION.gguf")
        return FinetuneOptions(**(base | over))
    res = finetune(opts(q4_model.path, rank_out=2), quiet=True)
    assert len(res.losses) == 2 and np.all(np.isfinite(res.losses))
    assert "--merge-aware: the output adapters train as usual" in capsys.readouterr().err
    with pytest.raises(LlamatuneError, match="--merge-aware trains what the merged model computes.*"
                                             "--lora-dropout 0 \\(not 0.1\\)"):
        finetune(opts(q4_model.path, lora_dropout=0.1), quiet=True)
    with pytest.raises(LlamatuneError, match="--merge-aware: no adapted matrix of tiny-f32.gguf is stored in a "
                                             "quantized type"):
        finetune(opts(tiny_model), quiet=True)
    with pytest.raises(LlamatuneError, match="--merge-aware trains LoRA adapters .*not with --fine-tune-type full"):
        finetune(opts(q4_model.path, fine_tune_type="full"), quiet=True)
