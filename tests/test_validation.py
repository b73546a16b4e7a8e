"""Validation, metrics and the loss plot: the forward-only loss, the seeded split, the
validation loss against an independent forward, evaluation steps, --save-best files,
--early-stop, bit-exact resume of the validation state, metrics appended on resume
without duplicates, and every new error."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from llamatune.commands.finetune import finetune
from llamatune.data.samples import Samples, load_samples
from llamatune.errors import LlamatuneError
from llamatune.formats.adapter import load_runtime_adapters
from llamatune.formats.gguf_io import GGUFFile
from llamatune.kernels import cross_entropy
from llamatune.models.infer import Runner
from llamatune.models.model import Model
from llamatune.models.weights import FrozenBase
from llamatune.options import FinetuneOptions, ScratchOptions, build_options
from llamatune.plot import read_metrics, smoothed
from llamatune.train import checkpoint as ckpt
from llamatune.train.step import StepExecutor
from llamatune.train.lora import init_lora, lora_specs, lora_targets
from llamatune.train.metrics import MetricsLog
from llamatune.train.params import ParamBuffer, ParamSpec
from llamatune.train.validation import ValidationState, Validator, eval_pieces, split_samples

from conftest import TEXT

VAL_TEXT = ("First Citizen:\nWe are accounted poor citizens, the patricians good.\n\n"
            "First Citizen:\nWhat authority surfeits on would relieve us.\n\n"
            "All:\nNo more talking on't; let it be done: away, away!\n")
TIMINGS = ("tokens_per_s",)


def options(tmp: Path, model: Path, **over) -> FinetuneOptions:
    (tmp / "train.txt").write_text(TEXT)
    base = dict(model_base=model, train_data=tmp / "train.txt", ctx=16, batch=2, lora_r=2, adam_iter=6,
                save_every=0, warmup=1, adam_alpha=1e-2, lora_dropout=0.1, rank_out=2,
                sample_start="First Citizen:", val_split=0.25, eval_every=3, plot=False,
                checkpoint_out=tmp / "chk-ITERATION.gguf", lora_out=tmp / "adapter-ITERATION.gguf")
    base.update(over)
    return FinetuneOptions(**base)


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]


def file_contents(path: Path) -> tuple[dict, dict]:
    """(tensors, metadata) of a GGUF file."""
    f = GGUFFile(path)
    return ({n: np.array(t.data) for n, t in f.tensors.items()},
            {k: f.get(k) for k in ("training.iteration_count", "llamatune.data_state", "llamatune.validation")})


def assert_same_file(a: Path, b: Path) -> None:
    (ta, ma), (tb, mb) = file_contents(a), file_contents(b)
    assert ta.keys() == tb.keys() and ma == mb
    for name in ta:
        np.testing.assert_array_equal(ta[name], tb[name], err_msg=f"{a.name}: {name}")


# ---------------------------------------------------------------- forward-only loss
def test_graph_loss_is_the_steps_forward_without_dropout_or_gradient(tmp_path, tiny_model):
    model = Model(tiny_model)
    cfg = model.config
    ranks = {k: 2 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                            "token_embd", "output", "attn_norm", "ffn_norm", "output_norm")}
    targets = lora_targets(cfg, ranks, alpha=4.0, tied=False)
    params = ParamBuffer(lora_specs(targets))
    init_lora(params, targets, np.random.default_rng(0))
    params.data[...] += np.random.default_rng(1).normal(0, 0.05, params.size).astype(np.float32)
    rng = np.random.default_rng(2)
    inputs, tg = rng.integers(0, cfg.n_vocab, (2, 8)), rng.integers(0, cfg.n_vocab, (2, 8))
    tg[1, -3:] = -1
    w = (tg >= 0).astype(np.float32)
    dropped = StepExecutor(cfg, FrozenBase(model), params, targets, 2, 8, lora_dropout=0.3)
    plain = StepExecutor(cfg, FrozenBase(model), params, targets, 2, 8, lora_dropout=0.0)

    loss = dropped.loss(inputs, tg, w)
    np.testing.assert_array_equal(params.grad, np.zeros_like(params.grad))     # no gradient at all
    evaluated = dropped.losses.copy()
    assert loss == plain.step(inputs, tg, w)                                   # the step's forward, no dropout
    np.testing.assert_array_equal(evaluated, plain.losses)
    params.zero_grad()
    with_dropout = dropped.step(inputs, tg, w, key=(3,))                       # dropout is back for training
    grads = params.grad.copy()
    params.zero_grad()
    fresh = StepExecutor(cfg, FrozenBase(model), params, targets, 2, 8, lora_dropout=0.3)
    assert with_dropout == fresh.step(inputs, tg, w, key=(3,)) != loss
    np.testing.assert_array_equal(params.grad, grads)
    packing = dict(positions=np.tile([0, 1, 2, 0, 1, 2, 3, 0], (2, 1)), segments=np.tile([0, 0, 0, 1, 1, 1, 1, 2], (2, 1)))
    packed = plain.step(inputs, tg, w, **packing)                              # packed rows: the same forward
    assert plain.loss(inputs, tg, w, **packing) == packed != loss
    assert plain.loss(inputs, tg, w) == loss                                   # and back to one sample per row


# ---------------------------------------------------------------- the validation set
def disjoint_samples(n: int) -> Samples:
    sizes = np.arange(n) % 5 + 3
    begins = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return Samples(np.arange(sizes.sum()) % 97, begins, sizes)


def test_val_split_is_seeded_disjoint_and_complete():
    s = disjoint_samples(20)
    train, val = split_samples(s, 0.25, seed=1)
    again_train, again_val = split_samples(s, 0.25, seed=1)
    _, other = split_samples(s, 0.25, seed=2)
    assert len(val) == 5 and len(train) == 15
    np.testing.assert_array_equal(val.begins, again_val.begins)
    np.testing.assert_array_equal(train.begins, again_train.begins)
    assert not np.array_equal(val.begins, other.begins)
    assert sorted(np.concatenate([train.begins, val.begins])) == list(s.begins)   # disjoint and complete
    assert list(val.begins) == sorted(val.begins)                                  # index order kept
    lookup = dict(zip(s.begins, s.sizes))
    assert all(lookup[b] == n for b, n in zip(val.begins, val.sizes))
    assert split_samples(s, 0.01, seed=1)[1].begins.size == 1                      # at least one held out


def test_val_split_warns_about_overlapping_windows(capsys):
    windows = Samples(np.arange(40), np.arange(30), np.full(30, 10))               # raw text: a window per token
    split_samples(windows, 0.2, seed=1)
    assert "validation windows share text with training windows" in capsys.readouterr().err


def test_eval_pieces_score_each_token_once():
    windows = Samples(np.arange(40), np.arange(30), np.full(30, 10))
    p = eval_pieces(windows, 10)
    assert list(p.begins) == [0, 10, 20] and list(p.sizes) == [10, 10, 10]
    long = Samples(np.arange(30), [0, 25], [25, 5])                                 # one sample longer than ctx
    p = eval_pieces(long, 10)
    assert list(p.begins) == [0, 10, 20, 25] and list(p.sizes) == [10, 10, 5, 5]
    masked = Samples(np.arange(30), [0, 25], [25, 5], mask=np.ones(30, np.int8))   # whole sequences stay whole
    p = eval_pieces(masked, 10)
    assert list(p.begins) == [0, 25] and list(p.sizes) == [25, 5] and np.array_equal(p.mask, masked.mask)


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_packed_validation_scores_every_target_once_and_alone(tiny_model, batch):
    """With --pack, validation rows hold several conversations, each attending only to
    itself, and the set is scored once: the same targets and loss as one per row."""
    model = Model(tiny_model)
    cfg, tok = model.config, model.tokenizer
    rng = np.random.default_rng(0)
    sizes = rng.integers(3, 9, 11)
    tokens = rng.integers(3, cfg.n_vocab, sizes.sum())
    mask = (rng.random(sizes.sum()) < 0.6).astype(np.int8)
    samples = Samples(tokens, np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes, mask)
    targets = lora_targets(cfg, {"attn_q": 2, "ffn_down": 2}, alpha=4.0, tied=False)
    params = ParamBuffer(lora_specs(targets))
    init_lora(params, targets, np.random.default_rng(1))
    params.data[...] += np.random.default_rng(2).normal(0, 0.05, params.size).astype(np.float32)
    executor = StepExecutor(cfg, FrozenBase(model), params, targets, batch, 16)
    o = FinetuneOptions(ctx=16, batch=batch)
    alone = Validator(samples, o, cfg.n_vocab, tok.bos_id, tok.eos_id)
    packed = Validator(samples, dataclasses.replace(o, pack=True), cfg.n_vocab, tok.bos_id, tok.eos_id)
    want = sum(int(mask[b + 1:b + n].sum()) for b, n in zip(samples.begins, samples.sizes))
    assert alone.n_targets == packed.n_targets == want
    assert alone.n_rows == 11 and packed.n_rows < 11


    def per_target(v: Validator) -> tuple[np.ndarray, np.ndarray]:
        """(targets, their losses) in row-major order: samples in order either way."""
        ids, losses = [], []
        for b in v.batches():
            executor.loss(b.inputs, b.targets, (b.targets >= 0).astype(np.float32), b.positions, b.segments)
            scored = b.targets >= 0
            ids.append(b.targets[scored])
            losses.append(executor.losses.reshape(batch, 16)[scored].copy())
        return np.concatenate(ids), np.concatenate(losses)

    (ids_a, loss_a), (ids_p, loss_p) = per_target(alone), per_target(packed)
    np.testing.assert_array_equal(ids_p, ids_a)                                  # every target once, in order
    np.testing.assert_allclose(loss_p, loss_a, rtol=1e-5, atol=1e-6)             # each scored as if alone
    assert packed.loss(executor) == pytest.approx(float(loss_a.astype(np.float64).sum()) / want, rel=1e-6)
    assert alone.describe() == f"11 samples of up to 16 tokens, {want} targets"
    assert packed.describe() == f"11 samples of up to 16 tokens in {packed.n_rows} rows, {want} targets"


def reference_val_loss(model_path: Path, samples: Samples, bos: int, ctx: int, adapter: Path | None = None) -> float:
    """Mean cross-entropy over every token of every sample, each predicted from BOS and
    the earlier tokens of its piece of ctx tokens, by the inference forward (one piece at a time)."""
    model = Model(model_path)
    runner = Runner(model, load_runtime_adapters(model, [(str(adapter), 1.0)]) if adapter else None)
    total, count = 0.0, 0
    pieces = [(b + off, min(ctx, n - off)) for b, n in zip(samples.begins, samples.sizes) for off in range(0, n, ctx)]
    for b, n in pieces:
        toks = samples.tokens[b:b + n].astype(np.int64)
        inputs = np.concatenate([[bos], toks[:-1]])[None]
        logits = np.ascontiguousarray(runner.forward(inputs)[0])
        losses = np.empty(n, np.float32)
        cross_entropy.cross_entropy_forward(losses, logits, toks)
        total += float(losses.astype(np.float64).sum())
        count += int(n)
    return total / count


def test_val_loss_is_the_mean_over_all_targets_at_0_every_n_and_end(tmp_path, tiny_model):
    (tmp_path / "val.txt").write_text(VAL_TEXT)
    o = options(tmp_path, tiny_model, ctx=48, batch=2, val_split=0.0, val_data=tmp_path / "val.txt",
                adam_iter=7, eval_every=3, save_every=1, rank_att_norm=0, compute_dtype="f32")
    res = finetune(o, quiet=True)                                                 # f32: the reference's products
    rows = metrics(tmp_path / "metrics.jsonl")
    evals = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert list(evals) == [0, 3, 6, 7]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 8))
    model = Model(tiny_model)
    val = load_samples(VAL_TEXT, model.tokenizer, o, "val")
    assert list(val.sizes) == [38, 85]                                            # the second one takes 2 rows
    bos = model.tokenizer.bos_id
    assert evals[0] == pytest.approx(reference_val_loss(tiny_model, val, bos, 48), rel=1e-5)
    assert evals[7] == pytest.approx(reference_val_loss(tiny_model, val, bos, 48, tmp_path / "adapter-7.gguf"),
                                     rel=1e-5)
    v = res.state.validation
    k = min(evals, key=evals.get)
    assert (v.best_loss, v.best_step, v.last_loss, v.last_step) == (evals[k], k, evals[7], 7)


def test_save_best_keeps_the_lowest_validation_loss(tmp_path, tiny_model):
    res = finetune(options(tmp_path, tiny_model, adam_iter=7, eval_every=2, save_every=1, save_best=True,
                           adam_alpha=0.1), quiet=True)
    evals = {r["step"]: r["val_loss"] for r in metrics(tmp_path / "metrics.jsonl") if "val_loss" in r}
    best = min(evals, key=evals.get)
    assert res.state.validation.best_step == best and list(evals) == [0, 2, 4, 6, 7]
    c = ckpt.load(tmp_path / "chk-BEST.gguf")
    assert c.state.iteration == best and c.state.validation.best_loss == evals[best]
    assert best > 0
    for name in ("adapter", "chk"):                # the same outputs as that step's
        assert_same_file(tmp_path / f"{name}-{best}.gguf", tmp_path / f"{name}-BEST.gguf")


def test_early_stop_after_patience_and_resume_of_a_stopped_run(tmp_path, tiny_model):
    o = options(tmp_path, tiny_model, adam_iter=40, eval_every=1, early_stop=2, adam_alpha=0.3, warmup=0)
    res = finetune(o, quiet=True)
    losses = [r["val_loss"] for r in metrics(tmp_path / "metrics.jsonl") if "val_loss" in r]
    best, since, expected = float("inf"), 0, None
    for step, loss in enumerate(losses):           # evaluations at steps 0, 1, 2, ...
        best, since = (loss, 0) if loss < best else (best, since + 1)
        if since == 2:
            expected = step
            break
    assert expected is not None and res.state.iteration == expected < 40
    assert len(losses) == expected + 1
    assert ckpt.load(tmp_path / "chk-LATEST.gguf").state.iteration == expected
    again = finetune(options(tmp_path, tiny_model, adam_iter=40, eval_every=1, early_stop=2, adam_alpha=0.3,
                             warmup=0, checkpoint_in=tmp_path / "chk-LATEST.gguf"), quiet=True)
    assert again.state.iteration == expected and again.losses == []


@pytest.mark.parametrize("alpha,stop", [(1e-2, None), (0.3, 6)])
def test_resume_takes_the_same_validation_decisions_bit_exactly(tmp_path, tiny_model, alpha, stop):
    """A run killed after its last checkpoint at or before step 5 (left: chk-LATEST of
    then, the BEST files of then, metrics up to a half-written line past it) and resumed
    gives the files of one uninterrupted run: with a small learning rate the best step
    comes after the resume, with a large one the best stays at step 0 and the restored
    patience stops the run. (With the large rate a step can be skipped by the divergence
    guard, and its save with it, depending on the CPU's compute dtype: hence the last
    checkpoint that exists.)"""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    kw = dict(adam_iter=8, eval_every=2, save_every=1, save_best=True, early_stop=3, adam_alpha=alpha, warmup=0)
    first = finetune(options(one, tiny_model, **kw), quiet=True)
    best = first.state.validation.best_step
    assert first.state.iteration == (stop or 8) and (best > 5 if stop is None else best == 0)
    kill = max(n for n in range(1, 6) if (one / f"chk-{n}.gguf").exists())
    assert kill >= 4
    shutil.copy(one / f"chk-{kill}.gguf", two / "chk-LATEST.gguf")
    if best <= kill:
        for name in ("chk-BEST.gguf", "adapter-BEST.gguf"):
            shutil.copy(one / name, two / name)
    (two / "metrics.jsonl").write_text((one / "metrics.jsonl").read_text() + '{"step": 9, "loss": 1.')
    res = finetune(options(two, tiny_model, checkpoint_in=two / "chk-LATEST.gguf", **kw), quiet=True)
    end = first.state.iteration
    assert res.state.iteration == end and 1 <= len(res.losses) <= end - kill    # skipped steps log no loss
    assert res.losses == first.losses[-len(res.losses):]
    assert res.state.validation == first.state.validation
    # the last step's save may be withheld by the divergence guard (trainer.final_save: with the
    # large rate the loss after the last update can be out of bounds); then in both runs alike
    for name in (f"chk-{end}.gguf", f"adapter-{end}.gguf", "chk-BEST.gguf", "adapter-BEST.gguf", "chk-LATEST.gguf"):
        assert (one / name).exists() == (two / name).exists(), name
        if (one / name).exists():
            assert_same_file(one / name, two / name)
    assert (one / "chk-BEST.gguf").exists()
    assert without_timings(metrics(two / "metrics.jsonl")) == without_timings(metrics(one / "metrics.jsonl"))


def test_checkpoints_without_validation_state_still_load(tmp_path, tiny_model):
    finetune(options(tmp_path, tiny_model, adam_iter=1, val_split=0.0), quiet=True)
    c = ckpt.load(tmp_path / "chk-LATEST.gguf")
    assert c.state.validation is None and c.file.get("llamatune.validation") is None
    res = finetune(options(tmp_path, tiny_model, adam_iter=2, val_split=0.0, val_data=tmp_path / "train.txt",
                           checkpoint_in=tmp_path / "chk-LATEST.gguf"), quiet=True)
    assert res.state.validation.last_step == 2 and res.state.validation.best_step == 2


# ---------------------------------------------------------------- metrics log
def test_metrics_log_keeps_lines_up_to_the_resumed_step(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(6)) + '{"step": 6, "lo')
    with MetricsLog(path, resume_step=3) as log:
        log.eval(3, float("nan"))
    assert metrics(path) == [{"step": s, "loss": 1.0} for s in range(4)] + [{"step": 3, "val_loss": None}]
    MetricsLog(path, resume_step=0).close()                                          # a fresh run starts anew
    assert path.read_text() == ""


def test_metrics_default_beside_the_checkpoints_with_every_field(tmp_path, tiny_model):
    (tmp_path / "out").mkdir()
    finetune(options(tmp_path, tiny_model, adam_iter=2, val_split=0.0, grad_acc=2,
                     checkpoint_out=tmp_path / "out" / "chk-ITERATION.gguf"), quiet=True)
    rows = metrics(tmp_path / "out" / "metrics.jsonl")
    assert [set(r) for r in rows] == [{"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens"}] * 2
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["tokens"] for r in rows] == [64, 128]         # 2 micro-batches of 2 full rows of 16 targets a step
    assert all(np.isfinite(r[k]) and r[k] > 0 for r in rows for k in ("loss", "lr", "grad_norm", "tokens_per_s"))


# ---------------------------------------------------------------- plot
def test_read_metrics_and_smoothing(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0, "val_loss": 3.0}\n{"step": 1, "loss": 2.0}\n\n{"step": 2, "loss": 1.0}\n'
                    '{"step": 2, "val_loss": 2.5}\n{"step": 3, "lo')
    c = read_metrics(path)
    assert (c.steps, c.loss, c.val_steps, c.val_loss) == ([1, 2], [2.0, 1.0], [0, 2], [3.0, 2.5])
    np.testing.assert_allclose(smoothed([2.0, 1.0], 0.5), [2.0, (0.25 * 2 + 0.5 * 1) / 0.75])
    np.testing.assert_array_equal(smoothed([2.0, 1.0, 4.0], 0.0), [2.0, 1.0, 4.0])


def test_plot_writes_a_png(tmp_path, tiny_model):
    pytest.importorskip("matplotlib", reason="matplotlib (the 'plot' extra) is not installed")
    from llamatune.cli.main import app
    from typer.testing import CliRunner
    finetune(options(tmp_path, tiny_model, adam_iter=3, eval_every=1, plot=True), quiet=True)
    png = tmp_path / "metrics.png"                                                   # drawn at the end of training
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = CliRunner().invoke(app, ["plot", str(tmp_path / "metrics.jsonl"), "-o", str(tmp_path / "loss.png"), "--log-y"])
    assert r.exit_code == 0, r.output
    import matplotlib.image
    assert matplotlib.image.imread(tmp_path / "loss.png").shape[:2] == (600, 1080)


@pytest.mark.parametrize("content,match", [
    ('{"step": 1, "loss": 2.0}\nnot json\n{"step": 2, "loss": 1.0}\n', r"m.jsonl:2: not a metrics line"),
    ('{"loss": 2.0}\n{"step": 2, "loss": 1.0}\n', r"m.jsonl:1: not a metrics line \(not an object with an integer 'step'\)"),
    ('{"step": 1, "lr": 0.1}\n', r"no training or validation loss"),
])
def test_bad_metrics_files(tmp_path, content, match):
    (tmp_path / "m.jsonl").write_text(content)
    with pytest.raises(LlamatuneError, match=match):
        read_metrics(tmp_path / "m.jsonl")


def test_plot_errors(tmp_path, monkeypatch):
    from llamatune.plot import plot_metrics
    with pytest.raises(LlamatuneError, match=r"nope.jsonl: metrics file not found"):
        plot_metrics(tmp_path / "nope.jsonl", tmp_path / "x.png")
    (tmp_path / "m.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(LlamatuneError, match=r"--smooth 1.0: must be in \[0, 1\)"):
        plot_metrics(tmp_path / "m.jsonl", tmp_path / "x.png", smooth=1.0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)                             # as if not installed
    with pytest.raises(LlamatuneError, match=r"needs matplotlib, which is not installed: pip install 'llamatune\[plot\]'"):
        plot_metrics(tmp_path / "m.jsonl", tmp_path / "x.png")


def test_training_without_matplotlib_gives_one_notice(tmp_path, tiny_model, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    finetune(options(tmp_path, tiny_model, adam_iter=1, val_split=0.0, plot=True), quiet=True)
    err = capsys.readouterr().err
    assert err.count("no loss plot: plotting needs matplotlib") == 1 and not (tmp_path / "metrics.png").exists()


def test_the_graph_is_released_before_the_plot(tmp_path, tiny_model, monkeypatch):
    """The plot's matplotlib (30-40 MB) comes in after the step buffers are gone, so the
    end of a run does not raise its peak memory above the estimate's."""
    import gc
    import weakref
    import llamatune.train.trainer as trainer
    graphs, alive = [], []
    init = StepExecutor.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        graphs.append(weakref.ref(self))
    monkeypatch.setattr(StepExecutor, "__init__", keep)
    monkeypatch.setattr(trainer, "write_plot", lambda path, quiet: alive.extend(g() is not None for g in graphs))
    finetune(options(tmp_path, tiny_model, adam_iter=2, eval_every=1, plot=True), quiet=True)   # with validation
    gc.collect()
    assert graphs and alive == [False] * len(graphs)


def test_end_of_training_line_shows_the_validation_loss(capsys):
    from llamatune.cli.main import _report
    from llamatune.train.trainer import TrainResult
    state = ckpt.TrainState(iteration=6, validation=ValidationState(2.5, 3, 1, 2.75, 6, 0))
    _report("finetune", TrainResult(state, [3.0, 2.0], [], 1.0, 10.0))
    assert "validation loss 2.7500 at step 6, best 2.5000 at step 3" in capsys.readouterr().out


def test_progress_line_shows_the_validation_loss():
    from io import StringIO
    from rich.console import Console
    from rich.progress import Progress, TextColumn
    from llamatune.progress import _TrainDisplay
    console = Console(file=StringIO(), width=200)
    with Progress(TextColumn("{task.fields[status]}"), console=console) as progress:
        show = _TrainDisplay(progress, progress.add_task("train", total=10, status=""))
        state = ckpt.TrainState(iteration=6, loss_ema=2.0, validation=ValidationState(2.5, 3, 1, 2.75, 6, 0))
        show(state, 2.0, 1e-3, 0.5, 100.0)
        state.validation.record(6, 2.25)                      # an evaluation after the step's update
        show.refresh(state)
    assert "loss 2.0000 (avg 2.0000)" in console.file.getvalue() and "val 2.2500" in console.file.getvalue()


@pytest.mark.parametrize("width", [80, 200])
def test_training_line_fits_the_console(monkeypatch, width):
    """An 80-column terminal gets the compact line, uncut; a wide one the full line with
    the bar, epoch, lr and gradient norm. (Output that is not a terminal gets timed lines:
    tests/test_newcomer.py.)"""
    from io import StringIO
    from rich.console import Console
    from llamatune import progress
    console = Console(file=StringIO(), width=width, force_terminal=True, color_system=None)
    monkeypatch.setattr(progress, "err", console)
    with progress.train_progress(1000, 0) as show:
        state = ckpt.TrainState(iteration=1000, epoch=12, loss_ema=2.3456,
                                validation=ValidationState(2.5, 3, 1, 2.75, 999, 0))
        show(state, 2.0123, 1.5e-4, 12.345, 123456.0)
    shown = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line.split("\r")[-1])       # the live bar's final state
             for line in console.file.getvalue().splitlines()]
    last = [line for line in shown if line.startswith("train")][-1]
    assert "…" not in last and len(last) <= width
    for part in ("1000/1000", "loss 2.0123 (avg 2.3456)", "123,456 tok/s", "val 2.7500", "eta"):
        assert part in last
    assert ("epoch 12" in last and "lr 1.50e-04  |g| 12.345" in last and "━" in last) == (width == 200)
    assert "0:00:00 eta" in last or width == 80            # elapsed, then the ETA


def test_train_from_scratch_keeps_the_best_model(tmp_path, tiny_model):
    from llamatune.commands.scratch import train_from_scratch
    (tmp_path / "t.txt").write_text(TEXT)
    res = train_from_scratch(ScratchOptions(train_data=tmp_path / "t.txt", vocab_model=tiny_model, embd=16, head=2,
                                            layer=1, ctx=16, batch=2, adam_iter=3, save_every=1, plot=False,
                                            sample_start="First Citizen:", val_split=0.25, eval_every=1,
                                            save_best=True, checkpoint_out=tmp_path / "chk-ITERATION.gguf",
                                            model_out=tmp_path / "model-ITERATION.gguf"), quiet=True)
    best = res.state.validation.best_step
    assert best > 0 and ckpt.load(tmp_path / "chk-BEST.gguf").state.iteration == best
    assert_same_file(tmp_path / f"model-{best}.gguf", tmp_path / "model-BEST.gguf")


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("over,match", [
    (dict(val_split=1.0), r"--val-split 1.0: must be in \[0, 1\)"),
    (dict(val_split=-0.1), r"--val-split -0.1: must be in \[0, 1\)"),
    (dict(val_split=0.1, val_data="v.txt"), r"--val-data and --val-split: give only one"),
    (dict(val_split=float("nan")), r"--val-split nan: must be a finite number"),
    (dict(eval_every=-1), r"--eval-every -1: must be at least 0"),
    (dict(early_stop=-2), r"--early-stop -2: must be at least 0"),
    (dict(save_best=True), r"--save-best needs validation samples: give --val-data or --val-split"),
    (dict(early_stop=3), r"--early-stop needs validation samples"),
    (dict(save_best=True, val_split=0.1, checkpoint_out="chk.gguf"),
     r"--save-best: --checkpoint-out chk.gguf has no ITERATION to replace by BEST"),
    (dict(save_best=True, val_split=0.1, lora_out="a.gguf"), r"--save-best: --lora-out a.gguf has no ITERATION"),
])
def test_option_errors(over, match):
    with pytest.raises(LlamatuneError, match=match):
        build_options(FinetuneOptions, over)


def test_scratch_save_best_needs_iteration_in_model_out():
    with pytest.raises(LlamatuneError, match=r"--save-best: --model-out m.gguf has no ITERATION"):
        build_options(ScratchOptions, dict(save_best=True, val_split=0.1, model_out="m.gguf"))


def test_data_errors(tmp_path, tiny_model):
    with pytest.raises(LlamatuneError, match=r"missing.txt: validation data file not found"):
        finetune(options(tmp_path, tiny_model, val_split=0.0, val_data=tmp_path / "missing.txt"), quiet=True)
    with pytest.raises(LlamatuneError, match=r"--val-split 0.25: 1 sample\(s\) leave none for training"):
        finetune(options(tmp_path, tiny_model, sample_start="no such start"), quiet=True)   # the whole text: 1 sample


@pytest.mark.parametrize("over,match", [
    (dict(metrics_out="{tmp}/train.txt"), r"--metrics-out .*train.txt would overwrite the input --train-data"),
    (dict(val_split=0.0, val_data="{tmp}/adapter-LATEST.gguf"),
     r"--lora-out .*adapter-ITERATION.gguf would overwrite the input --val-data"),
    (dict(save_best=True, fn_latest="BEST"), r"--checkpoint-out .*chk-ITERATION.gguf and --checkpoint-out "
                                               r".*chk-BEST.gguf would overwrite each other"),
    (dict(metrics_out="{tmp}/adapter-LATEST.gguf"), r"--metrics-out .* and --lora-out .* would overwrite each other"),
])
def test_validation_and_metrics_files_are_checked_before_training(tmp_path, tiny_model, over, match):
    over = {k: Path(v.replace("{tmp}", str(tmp_path))) if isinstance(v, str) and "{tmp}" in v else v
            for k, v in over.items()}
    with pytest.raises(LlamatuneError, match=match):
        finetune(options(tmp_path, tiny_model, **over), quiet=True)
    assert not list(tmp_path.glob("*.gguf")) and not (tmp_path / "metrics.jsonl").exists()


def test_corrupt_validation_state_in_a_checkpoint(tmp_path, tiny_model):
    from llamatune.formats.gguf_io import kv
    finetune(options(tmp_path, tiny_model, adam_iter=1), quiet=True)
    c = ckpt.load(tmp_path / "chk-LATEST.gguf")
    c.state.validation = None
    kvs = [kv("llamatune.validation", '{"best_loss": 1.0}')]
    params = ParamBuffer([ParamSpec("x", (2,))])
    ckpt.save(tmp_path / "bad.gguf", c.kind, "llama", options(tmp_path, tiny_model), params, c.state, kvs)
    with pytest.raises(LlamatuneError, match=r"bad.gguf: metadata key 'llamatune.validation' is invalid "
                                             r"\(validation state needs the fields"):
        ckpt.load(tmp_path / "bad.gguf")


def test_plot_command_error_is_one_line(tmp_path):
    from llamatune.cli.main import app
    from typer.testing import CliRunner
    r = CliRunner().invoke(app, ["plot", str(tmp_path / "nope.jsonl")])
    assert r.exit_code == 1
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert lines == [f"error: {tmp_path / 'nope.jsonl'}: metrics file not found"], r.output
