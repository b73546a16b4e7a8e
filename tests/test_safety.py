"""Never lose a user's data: outputs that would overwrite inputs, unwritable outputs,
full disks, numeric options out of range, diverging runs, data too short to train on,
and help pages readable at 80 columns.

Each CLI case runs the command as a subprocess and checks: exit code 1, exactly one
`error:` line naming the problem, no traceback, every input's sha256 unchanged and no
output left behind (or, where a run stopped part-way, only complete outputs).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llamatune.train import checkpoint as ckpt
from llamatune.errors import LlamatuneError
from llamatune.commands.finetune import finetune
from llamatune.formats.gguf_io import GGUFFile
from llamatune.train.guard import Guard
from llamatune.options import FinetuneOptions
from llamatune.outputs import Out, check_paths

from conftest import TEXT

FT = ["finetune", "--model-base", "{model}", "--train-data", "{text}", "-c", "16", "-b", "2", "--adam-iter", "2"]


def cli(*args, timeout=300):
    """The command as a user runs it: a separate process."""
    return subprocess.run([sys.executable, "-m", "llamatune.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def cli_here(*args, env=None):
    """The same command line in this process (faster; same error handling): for the many
    variations of one case, whose first example runs through `cli`."""
    from typer.testing import CliRunner
    from llamatune.cli.main import app
    r = CliRunner().invoke(app, [str(a) for a in args], env=env)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under folder (symlinks as their target's content)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error(p: subprocess.CompletedProcess, match: str, code: int = 1) -> str:
    """One `error:` line holding `match`, exit code `code` (2: a usage error)."""
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and match in lines[0], p.stderr
    return lines[0]


@pytest.fixture
def work(tmp_path, tiny_model):
    """A folder with the inputs: base model (a copy), training text, a preset."""
    (tmp_path / "base.gguf").write_bytes(Path(tiny_model).read_bytes())
    (tmp_path / "train.txt").write_text(TEXT)
    (tmp_path / "preset.toml").write_text("lora_r = 2\n")
    (tmp_path / "out").mkdir()
    return tmp_path


def expand(args, work: Path) -> list[str]:
    sub = {"{model}": str(work / "base.gguf"), "{text}": str(work / "train.txt"), "{w}": str(work)}
    out = []
    for a in args:
        for k, v in sub.items():
            a = a.replace(k, v)
        out.append(a)
    return out


# ---------------------------------------------------------------- outputs that would overwrite inputs

@pytest.mark.parametrize("extra,match,process", [
    (["--lora-out", "{model}"], "--lora-out {w}/base.gguf would overwrite the input --model-base {w}/base.gguf", True),
    (["--checkpoint-out", "{model}"], "--checkpoint-out {w}/base.gguf would overwrite the input --model-base", True),
    (["--lora-out", "{text}"], "--lora-out {w}/train.txt would overwrite the input --train-data", True),
    (["--lora-out", "{w}/link.gguf"], "would overwrite the input --model-base", False),          # a symlink
    (["--lora-out", "{w}/hard-ITERATION.gguf"], "would overwrite the input --model-base", False),  # hard-LATEST
    (["--lora-out", "{w}/preset.toml", "--config", "{w}/preset.toml"], "would overwrite the input --config", False),
    (["--checkpoint-in", "{w}/out/a-LATEST.gguf", "--lora-out", "{w}/out/a-ITERATION.gguf"],
     "--lora-out {w}/out/a-ITERATION.gguf would overwrite the input --checkpoint-in", False),
    (["--lora-out", "{w}/out/x-ITERATION.gguf", "--checkpoint-out", "{w}/out/x-ITERATION.gguf"],
     "would overwrite each other", False),
    (["--lora-out", "{w}/out"], "{w}/out: is a directory (--lora-out names a file)", False),
    (["--lora-out", "{text}/a.gguf"], "{w}/train.txt is not a directory", False),
])
def test_finetune_never_overwrites_inputs(work, extra, match, process):
    os.symlink(work / "base.gguf", work / "link.gguf")
    os.link(work / "base.gguf", work / "hard-LATEST.gguf")
    (work / "out" / "a-LATEST.gguf").write_bytes(b"not yet")
    before = digests(work)
    p = (cli if process else cli_here)(*expand(FT + ["--checkpoint-out", "{w}/out/chk-ITERATION.gguf"] + extra, work))
    one_error(p, match.replace("{w}", str(work)))
    assert digests(work) == before                  # inputs unchanged, nothing written


def test_scratch_model_out_is_not_the_vocab_model(work):
    before = digests(work)
    p = cli(*expand(["train-from-scratch", "--vocab-model", "{model}", "--train-data", "{text}",
                     "--model-out", "{model}"], work))
    one_error(p, "--model-out {w}/base.gguf would overwrite the input --vocab-model".replace("{w}", str(work)))
    assert digests(work) == before


def test_export_and_convert_refuse_their_inputs(work):
    finetune(options(work, adam_iter=1), quiet=True)
    os.symlink(work / "out/adapter-LATEST.gguf", work / "link-to-adapter.gguf")
    before = digests(work)
    one_error(cli("export-lora", "-m", work / "base.gguf", "--lora", work / "out/adapter-1.gguf",
                  "-o", work / "base.gguf"), "would overwrite the input --model-base")
    one_error(cli_here("convert-checkpoint", work / "out/adapter-LATEST.gguf", "-o", work / "link-to-adapter.gguf"),
              "would overwrite the input INPUT")
    one_error(cli_here("convert-checkpoint", work / "out/chk-1.gguf", "-o", work / "base.gguf", "--model-base",
                  work / "base.gguf"), "would overwrite the input --model-base")
    assert digests(work) == before


def test_quickstart_workdir_must_be_a_directory(work):
    before = digests(work)
    one_error(cli_here("quickstart", "--workdir", work / "train.txt"),
              f"{work}/train.txt: exists and is not a directory (--workdir names a directory)")
    assert digests(work) == before


def test_resume_from_the_latest_checkpoint_output_is_allowed(tmp_path):
    check_paths([("--checkpoint-in", tmp_path / "chk-LATEST.gguf")],
                [Out("--checkpoint-out", tmp_path / "chk-ITERATION.gguf", "LATEST"),
                 Out("--lora-out", tmp_path / "adapter-ITERATION.gguf", "LATEST")],
                may_share=[("--checkpoint-in", "--checkpoint-out")])
    with pytest.raises(LlamatuneError, match="would overwrite the input --checkpoint-in"):
        check_paths([("--checkpoint-in", tmp_path / "chk-7.gguf")],
                    [Out("--checkpoint-out", tmp_path / "chk-ITERATION.gguf", "LATEST")])


# ---------------------------------------------------------------- outputs that cannot be written

def mount_tmpfs(where: Path, options: str) -> bool:
    """Mount a small tmpfs (needs root and a kernel that allows it); False when it cannot."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                              capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def umount(where: Path) -> None:
    subprocess.run(["umount", str(where)], capture_output=True, timeout=20)


def test_read_only_output_directory_is_refused_before_anything_is_written(work):
    ro = work / "ro"
    if not mount_tmpfs(ro, "ro,size=1m"):
        if os.geteuid() == 0:
            pytest.skip("cannot mount a read-only tmpfs here, and chmod does not stop root")
        ro.chmod(0o555)
    try:
        before = digests(work)
        p = cli(*expand(FT + ["--checkpoint-out", "{w}/out/chk-ITERATION.gguf",
                              "--lora-out", "{w}/ro/adapter-ITERATION.gguf"], work))
        one_error(p, f"directory {ro} is not writable")
        assert digests(work) == before               # no checkpoint in out/ either: no partial set
    finally:
        umount(ro) if os.path.ismount(ro) else ro.chmod(0o755)


def test_low_disk_space_is_refused_up_front(work, monkeypatch):
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 50_000, 50_000))
    o = FinetuneOptions(model_base=work / "base.gguf", train_data=work / "train.txt", ctx=16, batch=2, adam_iter=2,
                        checkpoint_out=work / "out/chk-ITERATION.gguf", lora_out=work / "out/adapter-ITERATION.gguf")
    with pytest.raises(LlamatuneError, match=r"out: 0.0 MiB free, but the first save writes about 0.[3-4] MiB"):
        finetune(o, quiet=True)
    assert list((work / "out").iterdir()) == []


def assert_latest_complete(folder: Path, at_least: int) -> int:
    """chk-LATEST and adapter-LATEST load, agree with each other, and no temporary file is left."""
    c = ckpt.load(folder / "chk-LATEST.gguf")
    assert c.state.iteration >= at_least
    lora = {n: np.array(t.data) for n, t in GGUFFile(folder / "adapter-LATEST.gguf").tensors.items()}
    numbered = {n: np.array(t.data) for n, t in GGUFFile(folder / f"adapter-{c.state.iteration}.gguf").tensors.items()}
    assert lora.keys() == numbered.keys() and all(np.array_equal(lora[n], numbered[n]) for n in lora)
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    return c.state.iteration


def test_disk_full_during_a_save_on_a_small_tmpfs(work):
    full = work / "full"
    if not mount_tmpfs(full, "size=3m"):
        pytest.skip("cannot mount a tmpfs here (test_disk_full_with_a_failing_writer covers the same path)")
    try:
        before = {k: v for k, v in digests(work).items() if not k.startswith("full")}
        p = cli(*expand(FT[:-1] + ["400", "--save-every", "1", "--checkpoint-out", "{w}/full/chk-ITERATION.gguf",
                                   "--lora-out", "{w}/full/adapter-ITERATION.gguf"], work))
        one_error(p, "cannot write (no space left on device)")
        assert {k: v for k, v in digests(work).items() if not k.startswith("full")} == before
        assert_latest_complete(full, 2)
    finally:
        umount(full)


def test_disk_full_with_a_failing_writer(work, monkeypatch):
    """The same without a mount: a tensor write inside the 2nd save fails with ENOSPC."""
    import gguf
    real, calls = gguf.GGUFWriter.write_tensor_data, []

    def failing(self, *args, **kwargs):
        calls.append(self.path.name)
        # the first tensor of chk-2 (its temporary file, .chk-2.gguf.XXXX.tmp, beside it), after
        # save 1 wrote chk-1, adapter-1, adapter-LATEST and their imatrix files whole
        if self.path.name.startswith(".chk-2.gguf."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", failing)
    o = FinetuneOptions(model_base=work / "base.gguf", train_data=work / "train.txt", ctx=16, batch=2, adam_iter=9,
                        save_every=1, lora_r=1, rank_wk=0, rank_wv=0, rank_wo=0, rank_ffn_gate=0, rank_ffn_up=0,
                        rank_ffn_down=0, checkpoint_out=work / "out/chk-ITERATION.gguf",
                        lora_out=work / "out/adapter-ITERATION.gguf")
    with pytest.raises(LlamatuneError, match=r"^\S+/chk-2.gguf: cannot write \(no space left on device\); any earlier"):
        finetune(o, quiet=True)
    assert any(name.startswith(".chk-1.gguf.") for name in calls)
    assert assert_latest_complete(work / "out", 1) == 1


# ---------------------------------------------------------------- numbers

@pytest.mark.parametrize("args,match,process", [
    (FT + ["--adam-beta1", "2"], "--adam-beta1 2.0: must be in [0, 1)", True),
    (FT + ["--adam-beta2", "nan"], "--adam-beta2 nan: must be a finite number", False),
    (FT + ["--threads", "-1"], "--threads -1: must be at least 0", True),
    (FT + ["--warmup", "-5"], "--warmup -5: must be at least 0", True),
    (FT + ["--adam-alpha", "inf"], "--adam-alpha inf: must be a finite number", False),
    (FT + ["--adam-min-alpha", "1"], "--adam-min-alpha 1.0: must be in [0, 0.001]", False),
    (FT + ["--adam-eps", "0"], "--adam-eps 0.0: must be greater than 0", False),
    (FT + ["--adam-gclip", "-1"], "--adam-gclip -1.0: must be at least 0", False),
    (FT + ["--cos-decay-min", "1.5"], "--cos-decay-min 1.5: must be in [0, 1]", False),
    (FT + ["--lora-alpha", "nan"], "--lora-alpha nan: must be a finite number", False),
    (FT + ["--spike-threshold", "1"], "--spike-threshold 1.0: must be greater than 1", False),
    (FT + ["--max-bad-steps", "0"], "--max-bad-steps 0: must be at least 1", False),
    (FT + ["--epochs", "0"], "--epochs 0: must be at least 1 (or -1)", False),
    (FT + ["--tf32"], "--tf32 runs matmuls on a GPU's tensor cores: it needs --device cuda or auto", False),
    (FT + ["--compute-dtype", "tf32"], "--compute-dtype tf32 runs matmuls on a GPU's tensor cores: it needs "
     "--device cuda or auto", False),
    (["generate", "-m", "{model}", "-p", "x", "--temp", "nan"], "--temp nan: must be a finite number", True),
    (["generate", "-m", "{model}", "-p", "x", "-c", "0"], "-c/--ctx 0: must be at least 1", True),
    (["generate", "-m", "{model}", "-p", "x", "-n", "-2"], "-n/--n-predict -2: must be at least 0 (or -1)", False),
    (["generate", "-m", "{model}", "-p", "x", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]", False),
    (["generate", "-m", "{model}", "-p", "x", "--top-k", "-1"], "--top-k -1: must be at least 0", False),
    (["generate", "-m", "{model}", "-p", "x", "--lora-scaled", "{model}:nan"], "scale nan: must be a finite number",
     True),
    (["perplexity", "-m", "{model}", "-f", "{text}", "--lora-scaled", "{model}:inf"], "must be a finite number", False),
    (["perplexity", "-m", "{model}", "-f", "{text}", "-b", "0"], "-b/--batch 0: must be at least 1", False),
])
def test_numbers_out_of_range(work, args, match, process):
    before = digests(work)
    one_error((cli if process else cli_here)(*expand(args, work)), match, code=2)
    assert digests(work) == before


def test_generate_n_minus_one_runs_until_eos_or_full_context(tiny_model):
    p = cli("generate", "-m", tiny_model, "-p", "First", "-n", "-1", "--temp", "0", "-c", "24")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    from llamatune.commands.generate import generate
    from llamatune.models.infer import Runner
    from llamatune.models.model import Model
    runner = Runner(Model(tiny_model))
    ids = list(generate(runner, "First", -1, temp=0, n_ctx=24, stop_at_eos=False))
    assert len(ids) == 24 - len(runner.model.tokenizer.encode("First", add_special=True))


# ---------------------------------------------------------------- data

@pytest.mark.parametrize("text,match", [
    (" \n\t\n  \n", "the training data is only whitespace"),
    ("First Citizen: hear me.", "fewer than one sample of 16 tokens: use more text or a smaller --ctx"),
])
def test_training_data_too_small(work, text, match):
    (work / "train.txt").write_text(text)
    before = digests(work)
    one_error(cli(*expand(FT, work)), match)
    assert digests(work) == before


# ---------------------------------------------------------------- divergence guard

def options(work: Path, **over) -> FinetuneOptions:
    base = dict(model_base=work / "base.gguf", train_data=work / "train.txt", ctx=16, batch=2, adam_iter=6,
                warmup=1, save_every=1, checkpoint_out=work / "out/chk-ITERATION.gguf",
                lora_out=work / "out/adapter-ITERATION.gguf")
    return FinetuneOptions(**{**base, **over})


def test_huge_learning_rate_leaves_no_diverged_latest_and_a_sane_one_resumes(work):
    finetune(options(work, adam_iter=2), quiet=True)                  # two healthy saves
    latest = work / "out/chk-LATEST.gguf"
    before = digests(work / "out")
    p = cli(*expand(FT[:-1] + ["20", "--save-every", "1", "--adam-alpha", "1e6", "--warmup", "1",
                               "--checkpoint-in", str(latest), "--checkpoint-out", "{w}/out/chk-ITERATION.gguf",
                               "--lora-out", "{w}/out/adapter-ITERATION.gguf"], work))
    one_error(p, "training diverged: 5 bad steps in a row (--max-bad-steps 5)")
    after = digests(work / "out")
    log = [json.loads(line) for line in (work / "out/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log][-5:] == [3, 4, 5, 6, 7]           # the log records the skipped steps,
    del before["metrics.jsonl"], after["metrics.jsonl"]
    assert after == before                                            # but nothing diverged was saved
    res = finetune(options(work, adam_iter=4, checkpoint_in=latest), quiet=True)
    assert res.state.iteration == 4 and all(np.isfinite(res.losses)) and len(res.losses) == 2
    assert assert_latest_complete(work / "out", 4) == 4


def poisoned_step(monkeypatch, bad_steps: dict[int, float]):
    """StepExecutor.step returns `value` at the given 0-based optimizer steps (a corrupted batch)."""
    from llamatune.train.step import StepExecutor
    real = StepExecutor.step

    def step(self, inputs, targets, weights, key=(0,), **kw):
        loss = real(self, inputs, targets, weights, key, **kw)
        return bad_steps.get(int(key[1]), loss)

    monkeypatch.setattr(StepExecutor, "step", step)


@pytest.mark.parametrize("value", [float("nan"), 1e3])      # a NaN loss, a spike
def test_a_bad_step_is_skipped_and_training_continues(work, monkeypatch, value):
    clean = finetune(options(work, adam_iter=4, save_every=0, checkpoint_out=work / "c-ITERATION.gguf",
                             lora_out=work / "a-ITERATION.gguf"), quiet=True)
    poisoned_step(monkeypatch, {2: value})
    res = finetune(options(work, adam_iter=4, save_every=0), quiet=True)
    assert len(res.losses) == 3 and res.losses[:2] == clean.losses[:2]
    assert res.state.guard == {"recent": res.losses, "bad_in_row": 0, "bad_total": 1}
    c = ckpt.load(work / "out/chk-LATEST.gguf")
    assert c.state.iteration == 4 and c.state.guard["bad_total"] == 1
    skipped = {n: np.array(t.data) for n, t in c.file.tensors.items()}
    normal = {n: np.array(t.data) for n, t in GGUFFile(work / "c-LATEST.gguf").tensors.items()}
    assert any(not np.array_equal(skipped[n], normal[n]) for n in normal)   # the update at step 2 was not applied


def test_save_waits_for_a_healthy_step_and_resumes_exactly(work, monkeypatch):
    """A save due at iteration 2 is made only once the next step's loss shows that state is
    sane; step 2 (0-based) is bad, so the state is saved at iteration 3 instead (the skipped
    step consumed its batch). Resuming from there reproduces the rest bit-exactly."""
    poisoned_step(monkeypatch, {2: float("nan")})
    finetune(options(work, adam_iter=5, save_every=2), quiet=True)
    saved = sorted(int(p.stem.split("-")[1]) for p in (work / "out").glob("chk-[0-9]*.gguf"))
    assert saved == [3, 4, 5]
    assert ckpt.load(work / "out/chk-3.gguf").state.guard["bad_total"] == 1
    finetune(options(work, adam_iter=5, save_every=2, checkpoint_in=work / "out/chk-3.gguf",
                     checkpoint_out=work / "again/chk-ITERATION.gguf", lora_out=work / "again/a-ITERATION.gguf",
                     output_dir=work / "again"),
             quiet=True)
    a, b = ckpt.load(work / "out/chk-5.gguf"), ckpt.load(work / "again/chk-5.gguf")
    assert a.state == b.state
    for name, t in a.file.tensors.items():
        np.testing.assert_array_equal(np.array(t.data), np.array(b.file.tensors[name].data), err_msg=name)


def test_final_state_is_saved_only_if_its_recomputed_loss_is_sane(work, monkeypatch):
    """No later step verifies the last update, so the loss of its batches is recomputed
    (the 4th forward of a 3-step run): when that is not sane, LATEST stays at iteration 2."""
    from llamatune.train.step import StepExecutor
    real, calls = StepExecutor.step, []

    def step(self, *args, **kw):
        calls.append(1)
        loss = real(self, *args, **kw)
        return float("nan") if len(calls) == 4 else loss

    monkeypatch.setattr(StepExecutor, "step", step)
    res = finetune(options(work, adam_iter=3), quiet=True)
    assert len(calls) == 4 and len(res.losses) == 3 and res.state.iteration == 3
    assert not (work / "out/chk-3.gguf").exists()
    assert assert_latest_complete(work / "out", 2) == 2
    assert [p.name for p in res.files] == ["chk-2.gguf", "adapter-2.gguf", "adapter-2.imatrix.gguf",
                                           "adapter-LATEST.gguf", "adapter-LATEST.imatrix.gguf", "chk-LATEST.gguf"]


def interrupt_at(monkeypatch, call: int, signum: int | None = None) -> list:
    """StepExecutor.step is stopped at its `call`-th call (1-based) of the list returned: by
    Ctrl-C (KeyboardInterrupt), or by `signum` sent to this process."""
    from llamatune.train.step import StepExecutor
    real, calls = StepExecutor.step, []

    def step(self, *args, **kw):
        calls.append(1)
        if len(calls) == call:
            if signum is None:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
        return real(self, *args, **kw)
    monkeypatch.setattr(StepExecutor, "step", step)
    return calls


def test_ctrl_c_says_where_the_run_stands_and_how_to_go_on(work, monkeypatch):
    """A save due at iteration 2 is made during the 3rd step, the one due at 4 during the
    5th: Ctrl-C in the 5th step leaves LATEST at iteration 2, and says so."""
    from llamatune.errors import Interrupted
    latest = work / "out/chk-LATEST.gguf"
    interrupt_at(monkeypatch, 5)
    with pytest.raises(Interrupted) as e:
        finetune(options(work, adam_iter=8, save_every=2), quiet=True)
    assert str(e.value) == f"at iteration 4; {latest} holds iteration 2: go on with --checkpoint-in {latest}"
    assert ckpt.load(latest).state.iteration == 2
    interrupt_at(monkeypatch, 1)                                       # resumed, then stopped at once
    with pytest.raises(Interrupted) as e:
        finetune(options(work, adam_iter=8, save_every=2, checkpoint_in=latest), quiet=True)
    assert str(e.value) == f"at iteration 2; nothing saved since iteration 2: go on with --checkpoint-in {latest}"
    interrupt_at(monkeypatch, 1)
    with pytest.raises(Interrupted) as e:                              # a fresh run
        finetune(options(work, adam_iter=8, save_every=3, checkpoint_out=work / "new/chk-ITERATION.gguf",
                         output_dir=work / "new", overwrite=True), quiet=True)
    assert str(e.value) == "at iteration 0; nothing saved yet (--save-every 3)"
    interrupt_at(monkeypatch, 1)                                       # and on the command line
    p = cli_here(*expand(FT[:-1] + ["8", "--save-every", "2", "--checkpoint-in", str(latest),
                                    "--checkpoint-out", "{w}/out/chk-ITERATION.gguf",
                                    "--lora-out", "{w}/out/adapter-ITERATION.gguf"], work))
    assert p.returncode == 130 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == ("interrupted at iteration 2; nothing saved since iteration 2: "
                                                 f"go on with --checkpoint-in {latest}")


def test_sigterm_ends_a_run_like_ctrl_c_and_the_handler_is_put_back(work, monkeypatch):
    """SIGTERM (a batch system's time limit) in the 5th step: the same line as Ctrl-C's,
    exit code 143; the SIGTERM handler of the caller is back afterwards."""
    import signal
    from llamatune.errors import Interrupted
    calls = interrupt_at(monkeypatch, 5, signal.SIGTERM)
    before = signal.getsignal(signal.SIGTERM)
    latest = work / "out/chk-LATEST.gguf"
    with pytest.raises(Interrupted) as e:
        finetune(options(work, adam_iter=8, save_every=2), quiet=True)
    assert e.value.exit_code == 143 and len(calls) == 5
    assert str(e.value) == f"at iteration 4; {latest} holds iteration 2: go on with --checkpoint-in {latest}"
    assert signal.getsignal(signal.SIGTERM) is before
    assert not [p for p in (work / "out").iterdir() if p.name.startswith(".")]   # no temporary file left
    calls.clear()
    p = cli_here(*expand(FT[:-1] + ["8", "--save-every", "2", "--checkpoint-in", str(latest),
                                    "--checkpoint-out", "{w}/out/chk-ITERATION.gguf",
                                    "--lora-out", "{w}/out/adapter-ITERATION.gguf"], work))
    assert p.returncode == 143 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == (f"terminated at iteration 6; {latest} holds iteration 4: "
                                                 f"go on with --checkpoint-in {latest}")


def test_guard_rules():
    g = Guard(4.0, 2)
    assert g.judge(5.0, 1.0) is None
    g.record(5.0, None, 1)
    assert g.judge(float("inf"), 1.0) == "loss is inf"
    assert g.judge(5.0, float("nan")) == "gradient norm is nan"
    assert g.judge(5.0, 0.0) == "gradient norm is 0 at loss 5.0000 (saturated activations)"
    assert g.judge(20.5, 1.0) == "loss 20.5000 is over 4 times the recent mean 5.0000"
    assert g.judge(19.9, 1.0) is None
    small = Guard(4.0, 2, {"recent": [0.1]})
    assert small.judge(0.9, 1.0) is None              # 9x, but less than 1 nat above: noise, not a spike
    g.record(20.5, "spike", 2)
    with pytest.raises(LlamatuneError, match="training diverged: 2 bad steps in a row .* at iteration 3: spike"):
        g.record(20.5, "spike", 3)
    assert Guard(4.0, 2, g.state()).state() == g.state()
    with pytest.raises(LlamatuneError, match="invalid llamatune.guard_state"):
        Guard(4.0, 2, {"recent": ["x"]})


# ---------------------------------------------------------------- help at 80 columns

def test_help_shows_every_flag_whole_at_80_columns():
    import typer.main
    from llamatune.cli.main import app
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        text = cli_here(name, "--help", env={"COLUMNS": "80"}).stdout
        assert "…" not in text and max(map(len, text.splitlines())) <= 80, name
        words = set(text.replace(",", " ").split())
        flags = [f for p in command.params for f in (*p.opts, *p.secondary_opts) if f.startswith("-")]
        assert flags and all(f in words for f in flags), (name, [f for f in flags if f not in words])
