"""finetune end to end: exact resume, atomic checkpoints under a real kill, presets,
options reachable from the CLI, adapters applied at run time."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llamatune.train import checkpoint as ckpt
from llamatune.errors import LlamatuneError
from llamatune.commands.finetune import finetune
from llamatune.formats.gguf_io import GGUFFile
from llamatune.options import FinetuneOptions, ScratchOptions, build_options

from conftest import REPO, TEXT


def options(tmp: Path, model: Path, **over) -> FinetuneOptions:
    (tmp / "train.txt").write_text(TEXT)
    base = dict(model_base=model, train_data=tmp / "train.txt", ctx=16, batch=2, lora_r=2, adam_iter=4,
                save_every=0, warmup=1, adam_alpha=1e-2, lora_dropout=0.1, rank_out=2, rank_att_norm=1,
                checkpoint_out=tmp / "chk-ITERATION.gguf", lora_out=tmp / "adapter-ITERATION.gguf")
    base.update(over)
    return FinetuneOptions(**base)


def tensors(path: Path) -> dict[str, np.ndarray]:
    return {n: np.array(t.data) for n, t in GGUFFile(path).tensors.items()}


def test_resume_continues_the_same_trajectory(tmp_path, tiny_model):
    """4 steps in one run == 2 steps, stop, resume from LATEST, 2 more steps: bit-exact."""
    one = tmp_path / "one"
    one.mkdir()
    finetune(options(one, tiny_model), quiet=True)
    two = tmp_path / "two"
    two.mkdir()
    finetune(options(two, tiny_model, adam_iter=2), quiet=True)
    res = finetune(options(two, tiny_model, adam_iter=4, checkpoint_in=two / "chk-LATEST.gguf"), quiet=True)
    assert res.state.iteration == 4 and len(res.losses) == 2
    a, b = tensors(one / "chk-4.gguf"), tensors(two / "chk-4.gguf")
    assert a.keys() == b.keys()
    for name in a:                                  # parameters and both Adam moments
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    fa, fb = GGUFFile(one / "chk-4.gguf"), GGUFFile(two / "chk-4.gguf")
    for key in ("training.sample_count", "training.token_count", "training.epoch_count", "llamatune.data_state",
                "training.loss_ema"):
        assert fa.get(key) == fb.get(key), key
    # the running loss average is kept as the checkpoint stores it (f32), so a resumed
    # run averages on from the same value, not from a rounded copy of it
    assert res.state.loss_ema == float(np.float32(res.state.loss_ema)) == fb.get("training.loss_ema")
    for name, arr in tensors(one / "adapter-4.gguf").items():
        np.testing.assert_array_equal(arr, tensors(two / "adapter-LATEST.gguf")[name])


@pytest.mark.parametrize("arch", ["llama", pytest.param("gemma2", marks=pytest.mark.slow)])   # 25 s
def test_compiled_and_cached_kernels_train_the_same_bits(tmp_path, tiny_model, tiny_vocab, arch):
    """A run whose kernels numba compiles and a run that loads them from its disk cache
    (a resumed run, after the first) train the same adapter bit for bit: the fused
    cross-entropy's sum once came out grouped differently in the two. gemma2 adds the
    soft-capped scores and logits, GEGLU and sliding-window attention."""
    if arch != "llama":
        from checks.arch_reference import write_arch_model
        from conftest import tiny_config
        from test_arch_cli import CONFIGS
        tiny_model = write_arch_model(tmp_path / f"{arch}.gguf", tiny_config(arch, **CONFIGS[arch]), tiny_vocab, seed=3)
    (tmp_path / "train.txt").write_text(TEXT)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    adapters = []
    for run in ("compiled", "cached"):
        out = tmp_path / f"{run}.gguf"
        p = subprocess.run([sys.executable, "-m", "llamatune.cli.main", "finetune", "--model-base", str(tiny_model),
                            "--train-data", str(tmp_path / "train.txt"), "-c", "16", "-b", "2", "--adam-iter", "2",
                            "--lora-r", "2", "--save-every", "0", "--lora-out", str(out),
                            "--checkpoint-out", str(tmp_path / f"chk-{run}-ITERATION.gguf"),
                            "--metrics-out", str(tmp_path / f"metrics-{run}.jsonl")],
                           capture_output=True, text=True, env=env, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        adapters.append(tensors(out))
    assert adapters[0].keys() == adapters[1].keys()
    for name, arr in adapters[0].items():
        np.testing.assert_array_equal(arr, adapters[1][name], err_msg=name)


def test_loss_falls_and_step_zero_adapter_is_identity(tmp_path, tiny_model):
    res = finetune(options(tmp_path, tiny_model, adam_iter=12, lora_dropout=0.0, adam_alpha=3e-2), quiet=True)
    assert np.mean(res.losses[-3:]) < res.losses[0] - 0.1


def test_output_without_iteration_is_written_once_per_save(tmp_path, tiny_model, monkeypatch):
    """--lora-out without ITERATION names one file for the iteration and LATEST tags:
    written (and reported) once per save, not twice."""
    from llamatune.commands import finetune as ft
    written = []
    real = ft.write_adapter
    monkeypatch.setattr(ft, "write_adapter", lambda path, *a, **k: (written.append(path), real(path, *a, **k))[1])
    res = finetune(options(tmp_path, tiny_model, adam_iter=2, save_every=1, lora_out=tmp_path / "adapter.gguf"),
                   quiet=True)
    assert written == [tmp_path / "adapter.gguf"] * 2            # steps 1 and 2
    assert res.files == [tmp_path / "chk-2.gguf", tmp_path / "adapter.gguf", tmp_path / "adapter.imatrix.gguf",
                         tmp_path / "chk-LATEST.gguf"]
    written.clear()
    (tmp_path / "t").mkdir()
    finetune(options(tmp_path / "t", tiny_model, adam_iter=1), quiet=True)       # adapter-ITERATION.gguf
    assert written == [tmp_path / "t" / "adapter-1.gguf", tmp_path / "t" / "adapter-LATEST.gguf"]


def test_resume_refuses_changed_frozen_options(tmp_path, tiny_model):
    finetune(options(tmp_path, tiny_model, adam_iter=1), quiet=True)
    with pytest.raises(LlamatuneError, match=r"cannot resume with changed options: --lora-r 2 -> 3"):
        finetune(options(tmp_path, tiny_model, lora_r=3, checkpoint_in=tmp_path / "chk-LATEST.gguf"), quiet=True)


def test_missing_checkpoint_in_starts_fresh(tmp_path, tiny_model):
    res = finetune(options(tmp_path, tiny_model, adam_iter=1, checkpoint_in=tmp_path / "nope.gguf"), quiet=True)
    assert res.state.iteration == 1


def test_epochs_limit_stops_training(tmp_path, tiny_model):
    # 'First Citizen' text: with --sample-start each block is one sample; 1 epoch ends early
    res = finetune(options(tmp_path, tiny_model, adam_iter=500, epochs=1, sample_start="First Citizen:",
                           batch=4), quiet=True)
    assert res.state.epoch == 1 and res.state.iteration < 500


def test_killed_run_leaves_a_loadable_latest(tmp_path, tiny_model):
    """SIGKILL at arbitrary moments of a run that saves every step: the LATEST
    checkpoint that is left always loads, and training resumes from it."""
    (tmp_path / "train.txt").write_text(TEXT)
    cmd = [sys.executable, "-m", "llamatune.cli.main", "finetune", "--model-base", str(tiny_model),
           "--train-data", str(tmp_path / "train.txt"), "-c", "16", "-b", "2", "--adam-iter", "100000",
           "--save-every", "1", "--checkpoint-out", str(tmp_path / "chk-ITERATION.gguf"),
           "--lora-out", str(tmp_path / "adapter-ITERATION.gguf"), "--fn-latest", "LATEST"]
    latest = tmp_path / "chk-LATEST.gguf"
    rng = np.random.default_rng(0)
    for attempt in range(3):
        p = subprocess.Popen(cmd + (["--checkpoint-in", str(latest)] if latest.exists() else []),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 240
        before = ckpt.load(latest).state.iteration if latest.exists() else 0
        while time.time() < deadline:          # wait until this run has saved at least twice
            if latest.exists():
                try:
                    if ckpt.load(latest).state.iteration >= before + 2:
                        break
                except LlamatuneError:
                    pass                            # being replaced right now: try again
            time.sleep(0.05)
        time.sleep(float(rng.uniform(0, 0.3)))     # land somewhere inside a step or a save
        p.send_signal(signal.SIGKILL)
        p.wait()
        c = ckpt.load(latest)                       # must load: never half-written
        assert c.state.iteration >= before + 2
    res = finetune(options(tmp_path, tiny_model, lora_r=4, rank_out=0, rank_att_norm=0, lora_dropout=0.0,
                           adam_iter=c.state.iteration + 1, checkpoint_in=latest, warmup=100, adam_alpha=1e-3,
                           save_every=1), quiet=True)
    assert res.state.iteration == c.state.iteration + 1


@pytest.mark.parametrize("preset,cls", [("finetune-default.toml", FinetuneOptions),
                                        ("finetune-chat-7b-q4.toml", FinetuneOptions),
                                        ("finetune-chat.toml", FinetuneOptions),
                                        ("finetune-chat-pack.toml", FinetuneOptions),
                                        ("scratch-small.toml", ScratchOptions)])
def test_presets_load(preset, cls):
    opts = build_options(cls, {}, REPO / "configs" / preset)
    assert isinstance(opts, cls)


def test_cli_overrides_preset_overrides_default(tmp_path):
    (tmp_path / "p.toml").write_text("lora_r = 6\nbatch = 3\n")
    o = build_options(FinetuneOptions, {"batch": 5, "ctx": None}, tmp_path / "p.toml")
    assert (o.lora_r, o.batch, o.ctx) == (6, 5, FinetuneOptions().ctx)


def test_preset_type_errors(tmp_path):
    (tmp_path / "p.toml").write_text("lora_r = 'four'\n")
    with pytest.raises(LlamatuneError, match=r"p\.toml: 'lora_r' = 'four' is not a valid int"):
        build_options(FinetuneOptions, {}, tmp_path / "p.toml")


@pytest.mark.parametrize("command,cls", [("finetune", FinetuneOptions), ("train-from-scratch", ScratchOptions)])
def test_every_option_is_reachable_from_the_cli(command, cls):
    import typer
    from llamatune.cli.main import app
    cmd = typer.main.get_command(app).commands[command]
    names = {p.name for p in cmd.params}
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in names]
    assert missing == []


def test_runtime_adapter_changes_generation_as_merge_does(tmp_path, tiny_model):
    """An adapter applied at run time gives the logits of the merged f32 model."""
    from llamatune.formats.adapter import load_runtime_adapters
    from llamatune.commands.export import export_lora
    from llamatune.models.infer import Runner
    from llamatune.models.model import Model
    finetune(options(tmp_path, tiny_model, adam_iter=3, rank_att_norm=0, lora_dropout=0.0), quiet=True)
    adapter = tmp_path / "adapter-LATEST.gguf"
    export_lora(tiny_model, [(adapter, 1.0)], tmp_path / "merged.gguf")
    model = Model(tiny_model)
    tokens = np.arange(3, 19).reshape(1, 16)
    base = Runner(model).forward(tokens)
    runtime = Runner(model, load_runtime_adapters(model, [(str(adapter), 1.0)])).forward(tokens)
    merged = Runner(Model(tmp_path / "merged.gguf")).forward(tokens)
    assert np.abs(runtime - base).max() > 1e-3               # the adapter does something
    np.testing.assert_allclose(runtime, merged, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pack", [False, True])
def test_chat_finetune_resumes_the_same_trajectory(tmp_path, tiny_model, pack):
    """Conversations (answers-only targets, padded or packed rows): 3 steps == 2 steps + resume + 1 step."""
    from llamatune.quickstart import chat_sample
    chat = dict(train_data=chat_sample(), chat_template="chatml", ctx=64, batch=3, rank_out=0, rank_att_norm=0,
                pack=pack)
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    res = finetune(options(one, tiny_model, adam_iter=3, **chat), quiet=True)
    assert len(res.losses) == 3 and all(np.isfinite(res.losses))
    finetune(options(two, tiny_model, adam_iter=2, **chat), quiet=True)
    finetune(options(two, tiny_model, adam_iter=3, checkpoint_in=two / "chk-LATEST.gguf", **chat), quiet=True)
    a, b = tensors(one / "chk-3.gguf"), tensors(two / "chk-3.gguf")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert GGUFFile(one / "chk-3.gguf").get("llamatune.data_state") == GGUFFile(two / "chk-3.gguf").get("llamatune.data_state")


def test_pack_needs_segment_aware_attention(monkeypatch, tmp_path):
    from llamatune.data.samples import Samples
    from llamatune.train import inputs as ft
    from llamatune.train.step import StepExecutor
    rows = Samples([1, 2, 3], [0], [3], [0, 1, 1])
    monkeypatch.setattr(StepExecutor, "step", lambda self, inputs, targets, weights, key=(0,): 0.0)
    with pytest.raises(LlamatuneError, match="--pack: this build's attention cannot confine packed samples"):
        ft.check_packing(FinetuneOptions(pack=True), rows)
    got = []
    monkeypatch.setattr(ft, "notice", got.append)
    ft.check_packing(FinetuneOptions(pack=True), Samples([1, 2, 3], [0], [3]))
    assert got == ["--pack applies to conversations and rows; raw text already fills every window"]
    got.clear()
    ft.check_packing(FinetuneOptions(pack=False, ctx=4), rows)          # 3 of 4 tokens: no notice
    assert got == []
    ft.check_packing(FinetuneOptions(pack=False, ctx=8), rows)
    assert got == ["samples fill 38% of --ctx 8 on average, the rest of each window is padding: "
                   "--pack puts several in a window"]
    text = Samples(list(range(6)), [0, 3], [3, 3])                      # text samples at --sample-start
    for opts in (dict(sample_start="<s>", fill_with_next_samples=True), dict(sample_start=""),
                 dict(sample_start="<s>", ctx=6)):
        got.clear()
        ft.check_packing(FinetuneOptions(**{"ctx": 8, **opts}), text)
        assert got == []
    ft.check_packing(FinetuneOptions(sample_start="<s>", ctx=8), text)
    assert got == ["samples fill 38% of --ctx 8 on average, the rest of each window is padding: "
                   "--fill-with-next-samples fills it"]
