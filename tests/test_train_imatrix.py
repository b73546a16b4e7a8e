"""The imatrix statistics finetune collects while training (train/statistics.py):
equal to a calibration pass over the same tokens, resumable to the same file, read
back by formats/imatrix.py, picked up by export-lora."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llamatune.commands.export import export_lora
from llamatune.commands.finetune import finetune
from llamatune.errors import LlamatuneError
from llamatune.formats.adapter import RuntimeAdapters
from llamatune.formats.gguf_io import GGUFFile
from llamatune.formats.imatrix import read_imatrix
from llamatune.models.calibration import InputStats
from llamatune.models.infer import Runner
from llamatune.models.model import Model
from llamatune.models.weights import FrozenBase
from llamatune.options import FinetuneOptions, MergeOptions
from llamatune.train.step import StepExecutor
from llamatune.train.lora import init_lora, lora_specs, lora_targets
from llamatune.train.params import ParamBuffer
from llamatune.train.statistics import TrainingStats

from conftest import TEXT, write_tiny_model

RANKS = {k: 2 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory, tiny_vocab):
    return Model(write_tiny_model(tmp_path_factory.mktemp("s") / "m.gguf", tiny_vocab, n_embd=32, n_ff=48,
                                  head_dim=8, n_rot=8))


def test_counted_tokens_run_to_each_rows_last_target():
    t = np.array([[5, 6, -1, 7, -1, -1],        # text row ending in padding
                  [-1, -1, 3, 4, 5, 6],          # a chat prompt (no targets) counts: it bears on the loss
                  [-1, -1, -1, -1, -1, -1]])     # an empty row counts nothing
    np.testing.assert_array_equal(TrainingStats.counted(t), [[1, 1, 1, 1, 0, 0], [1] * 6, [0] * 6])


@pytest.mark.parametrize("checkpointing", ["selective", "layer"])
def test_training_forward_collects_what_calibration_does(small_model, checkpointing):
    """Two micro-batches through StepExecutor.step (rows padded, so the graph is trimmed; with
    --checkpointing layer backward recomputes every layer) and an evaluation: the sums
    equal calibration.InputStats over a Runner with the same adapters, run on each row's
    counted tokens only."""
    cfg = small_model.config
    targets = lora_targets(cfg, RANKS, alpha=3.0, tied=False)
    params = ParamBuffer(lora_specs(targets))
    init_lora(params, targets, np.random.default_rng(0))
    params.data[...] += np.random.default_rng(1).normal(0, 0.05, params.size).astype(np.float32)
    B, T = 2, 64
    g = StepExecutor(cfg, FrozenBase(small_model), params, targets, B, T, checkpointing)
    rng = np.random.default_rng(2)
    stats, batches = TrainingStats(), []
    for last in ((20, 27), (40, 9)):
        inputs = rng.integers(0, cfg.n_vocab, (B, T))
        tg = rng.integers(0, cfg.n_vocab, (B, T))
        for k, n in enumerate(last):
            tg[k, n + 1:] = -1                          # padding after the row's last target
        tg[1, :3] = -1                                  # a prompt: counted
        w = (tg >= 0) / (tg >= 0).sum()
        stats.batch(tg)
        g.observer = stats
        g.step(inputs, tg, w)
        g.observer = None
        g.loss(inputs, tg, w)                           # an evaluation is not counted
        batches.append((inputs, last))
    stats.commit()

    runtime = RuntimeAdapters()
    for t in targets:
        runtime.add(t.weight, params[t.a], params[t.b], t.scale)
    runner, ref = Runner(small_model, runtime), InputStats()
    runner.observer = ref
    for inputs, last in batches:
        for k, n in enumerate(last):
            runner.forward(inputs[k:k + 1, :n + 1])
    got, want = stats.imatrix(), ref.imatrix()
    assert set(got.sums) == set(want.sums) - {"output.weight"}       # the head, as llama-imatrix, left out
    for name in got.sums:
        np.testing.assert_allclose(got.sums[name], want.sums[name], rtol=2e-5, err_msg=name)
        assert got.counts[name] == want.counts[name] == 21 + 28 + 41 + 10
    assert got.chunk_count == 4


def test_a_skipped_step_is_not_counted(small_model):
    cfg = small_model.config
    stats = TrainingStats()
    x = np.random.default_rng(0).normal(size=(4, cfg.n_embd)).astype(np.float32)
    stats.batch(np.zeros((1, 4), np.int64))
    stats("blk.0.attn_q.weight", x)
    stats.commit()
    stats.batch(np.zeros((1, 4), np.int64))
    stats("blk.0.attn_q.weight", np.full_like(x, np.nan))
    stats.discard()
    m = stats.imatrix()
    np.testing.assert_array_equal(m.sums["blk.0.attn_q.weight"], (x.astype(np.float64) ** 2).sum(0).astype(np.float32))
    assert m.counts["blk.0.attn_q.weight"] == 4
    with pytest.raises(ValueError, match="batch\\(targets\\) must be given"):
        stats("blk.0.attn_q.weight", x)


def options(tmp: Path, model: Path, **over) -> FinetuneOptions:
    (tmp / "train.txt").write_text(TEXT)
    base = dict(model_base=model, train_data=tmp / "train.txt", ctx=16, batch=2, lora_r=2, adam_iter=4,
                save_every=2, warmup=1, adam_alpha=1e-2, checkpointing="layer",
                checkpoint_out=tmp / "chk-ITERATION.gguf", lora_out=tmp / "adapter-ITERATION.gguf")
    base.update(over)
    return FinetuneOptions(**base)


def test_finetune_writes_the_imatrix_and_a_resume_writes_the_same(tmp_path, tiny_model):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    finetune(options(one, tiny_model), quiet=True)
    finetune(options(two, tiny_model, adam_iter=2), quiet=True)
    finetune(options(two, tiny_model, checkpoint_in=two / "chk-LATEST.gguf"), quiet=True)
    for name in ("adapter-2.imatrix.gguf", "adapter-4.imatrix.gguf", "adapter-LATEST.imatrix.gguf"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    m2, m4 = read_imatrix(one / "adapter-2.imatrix.gguf"), read_imatrix(one / "adapter-4.imatrix.gguf")
    model = GGUFFile(tiny_model)
    blk = {n for n, t in model.tensors.items() if n.startswith("blk.") and len(t.shape) == 2}
    assert set(m4.sums) == blk
    for name in blk:                       # text rows: every token counts; 2 rows of 16 per step
        assert (m2.counts[name], m4.counts[name]) == (2 * 32, 4 * 32)
        assert np.all(m4.sums[name] > m2.sums[name])
    assert (m4.chunk_count, m4.chunk_size, m4.datasets) == (8, 16, ["train.txt"])
    three = tmp_path / "three"
    three.mkdir()
    finetune(options(three, tiny_model, imatrix_out=three / "stats-ITERATION.gguf"), quiet=True)
    assert (three / "stats-4.gguf").read_bytes() == (one / "adapter-4.imatrix.gguf").read_bytes()
    assert not list(three.glob("*.imatrix.gguf"))


def test_export_lora_uses_the_training_imatrix(tmp_path, tiny_vocab, capsys):
    base = write_tiny_model(tmp_path / "q8.gguf", tiny_vocab, outtype=_q8())
    finetune(options(tmp_path, base, adam_iter=2), quiet=True)
    adapter, imatrix = tmp_path / "adapter-LATEST.gguf", tmp_path / "adapter-LATEST.imatrix.gguf"
    (tmp_path / "train.txt").unlink()        # the data the adapter records is gone: the imatrix it left
    found = export_lora(base, [(adapter, 1.0)], tmp_path / "found.gguf")
    assert (found.statistics, found.imatrix) == ("imatrix", imatrix)
    assert "statistics: the imatrix finetune wrote beside adapter-LATEST.gguf" in capsys.readouterr().err
    given = export_lora(base, [(adapter, 1.0)], tmp_path / "given.gguf", merge=MergeOptions(imatrix=imatrix))
    assert given.imatrix is None
    assert (tmp_path / "found.gguf").read_bytes() == (tmp_path / "given.gguf").read_bytes()
    imatrix.unlink()                                       # none: the merge without statistics
    none = export_lora(base, [(adapter, 1.0)], tmp_path / "none.gguf")
    assert none.statistics == "none" and none.imatrix is None
    assert (tmp_path / "none.gguf").read_bytes() != (tmp_path / "found.gguf").read_bytes()


def test_damaged_checkpoint_statistics_are_refused(tmp_path, tiny_model):
    from llamatune.formats.gguf_io import kv, tensor_out, write_gguf
    f = tmp_path / "bad.gguf"
    write_gguf(f, "llama", [kv("llamatune.imatrix", '{"rows": 1, "counts": {"blk.0.attn_q.weight": 3}}')],
               [tensor_out("x", np.zeros(2, np.float32))])
    with pytest.raises(LlamatuneError, match="bad.gguf: the checkpoint's imatrix statistics are damaged"):
        TrainingStats().restore(GGUFFile(f))


def _q8():
    from gguf import GGMLQuantizationType as QType
    return QType.Q8_0


def test_mpi_ranks_add_every_ranks_step_in_rank_order():
    """Under MPI each rank gathers every rank's step sums (allgather) and adds them in
    rank order: the totals are the same on every rank, those of one process that saw all."""
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(6, 8)).astype(np.float32) for _ in range(2)]
    ranks = []
    for x in xs:
        s = TrainingStats()
        s.batch(np.zeros((2, 3), np.int64))
        s("blk.0.ffn_down.weight", x)
        ranks.append(s)
    steps = [(dict((k, np.asarray(v)) for k, v in s._step.items()), dict(s._step_counts), s._step_rows)
             for s in ranks]

    class World:                          # distributed.World's allgather, for two ranks in one process
        size = 2

        def allgather(self, value, what):
            return steps
    for s in ranks:
        s.commit(World())
    one = TrainingStats()
    for x in xs:
        one.batch(np.zeros((2, 3), np.int64))
        one("blk.0.ffn_down.weight", x)
        one.commit()
    for s in ranks:
        m = s.imatrix()
        np.testing.assert_array_equal(m.sums["blk.0.ffn_down.weight"], one.imatrix().sums["blk.0.ffn_down.weight"])
        assert (m.counts["blk.0.ffn_down.weight"], m.chunk_count) == (12, 4)


def test_a_checkpoint_without_statistics_restores_none(tmp_path):
    from llamatune.formats.gguf_io import tensor_out, write_gguf
    f = tmp_path / "old.gguf"
    write_gguf(f, "llama", [], [tensor_out("x", np.zeros(2, np.float32))])
    s = TrainingStats()
    assert not s.restore(GGUFFile(f)) and s.imatrix().sums == {}
