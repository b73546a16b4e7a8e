"""Output locks (locks.py): two runs never write the same outputs; a lock dies with its
process; runs with other outputs in the same folder are not held up."""
from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from llamatune import locks
from llamatune.commands.finetune import finetune
from llamatune.errors import LlamatuneError
from llamatune.locks import Held, hold, hold_training, lock_paths
from llamatune.options import FinetuneOptions
from llamatune.outputs import Out

from conftest import TEXT

HOLDER = """
import sys
from pathlib import Path
from llamatune.locks import hold
from llamatune.outputs import Out
with hold([Out("--output", Path(sys.argv[1]))], "export-lora"):
    print("held", flush=True)
    sys.stdin.read()
"""


@contextmanager
def held_elsewhere(output: Path):
    """Another process holding the lock of `output` until the block ends."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(output)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "held\n"
        yield p
    finally:
        p.stdin.close()
        p.wait(timeout=60)


def holder_pattern(pid: int, command: str) -> str:
    """The line a holder writes into its lock files, which a blocked run quotes."""
    return (rf"pid {pid} on host {re.escape(socket.gethostname())}, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d "
            rf"\w+: llamatune {command}")


def lock_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".lock"))


def test_lock_files_are_named_after_each_output_stem(tmp_path):
    tmp_path = tmp_path.resolve()
    assert lock_paths(Out("--checkpoint-out", tmp_path / "chk-ITERATION.gguf", "LATEST")) == \
        [tmp_path / ".chk-ITERATION.lock", tmp_path / ".chk-LATEST.lock"]
    assert lock_paths(Out("--output", tmp_path / "merged.Q8_0.gguf")) == [tmp_path / ".merged.Q8_0.lock"]
    # the metrics log and its plot share one lock
    assert lock_paths(Out("--metrics-out", tmp_path / "m.jsonl")) == lock_paths(Out("plot", tmp_path / "m.png"))
    (tmp_path / "link").symlink_to(tmp_path)          # one folder by two names: one lock
    assert lock_paths(Out("--output", tmp_path / "link" / "x.gguf")) == [tmp_path / ".x.lock"]


def test_a_held_output_stops_the_second_run_with_the_holders_line(tmp_path):
    from llamatune.commands.export import export_lora
    out = tmp_path / "merged.gguf"
    with held_elsewhere(out) as other:
        assert (tmp_path / ".merged.lock").read_text().startswith(f"pid {other.pid} on host ")
        # the base model does not exist: the lock is checked before anything loads
        with pytest.raises(Held, match=r"^--output .*merged\.gguf: another run writes these outputs \("
                           + holder_pattern(other.pid, "export-lora")
                           + r"\): wait for it to end or choose other output names \(lock .*\.merged\.lock\)$"):
            export_lora(tmp_path / "missing-base.gguf", [(tmp_path / "a.gguf", 1.0)], out)
    assert lock_files(tmp_path) == []                 # its holder removed it on the way out
    with pytest.raises(LlamatuneError, match="missing-base.gguf"):
        export_lora(tmp_path / "missing-base.gguf", [(tmp_path / "a.gguf", 1.0)], out)


def test_convert_checkpoint_output_is_locked(tmp_path):
    from llamatune.commands.convert import convert
    peft = tmp_path / "peft"
    peft.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (peft / name).write_text("")
    with held_elsewhere(tmp_path / "out.gguf") as other:
        with pytest.raises(Held, match=holder_pattern(other.pid, "export-lora")):
            convert(peft, tmp_path / "out.gguf")


def test_a_stale_lock_file_is_reused_and_removed(tmp_path):
    """What a run killed with kill -9 leaves: a lock file nobody holds."""
    (tmp_path / ".out.lock").write_text("pid 1 on host gone, started 2000-01-01 00:00:00 UTC: llamatune finetune "
                                        "with a long tail that the next holder's line must not keep\n")
    with hold([Out("-o", tmp_path / "out.gguf")], "export-lora"):
        line = (tmp_path / ".out.lock").read_text()
        assert re.fullmatch(holder_pattern(os.getpid(), "export-lora") + "\n", line), line
    assert lock_files(tmp_path) == []


def test_directories_made_for_locks_are_removed_unless_written(tmp_path):
    with hold([Out("-o", tmp_path / "a" / "b" / "out.gguf")], "export-lora"):
        assert lock_files(tmp_path / "a" / "b") == [".out.lock"]
    assert list(tmp_path.iterdir()) == []              # the run wrote nothing: no empty folders left
    with hold([Out("-o", tmp_path / "a" / "b" / "out.gguf")], "export-lora"):
        (tmp_path / "a" / "b" / "out.gguf").write_text("x")
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["out.gguf"]


def test_a_lock_file_unlinked_by_its_holder_before_we_lock_it_is_taken_again(tmp_path, monkeypatch):
    """A holder removes its lock file while releasing: a run that opened the file just
    before must not keep a lock on the removed file (a third run could lock a new one)."""
    real_open, opened = os.open, []

    def open_then_release(path, *args):
        fd = real_open(path, *args)
        opened.append(os.fstat(fd).st_ino)
        if len(opened) == 1:
            os.unlink(path)                    # the previous holder's release, between open and flock
        return fd
    monkeypatch.setattr(locks.os, "open", open_then_release)
    with hold([Out("-o", tmp_path / "out.gguf")], "export-lora"):
        assert len(opened) == 2
        assert (tmp_path / ".out.lock").stat().st_ino == opened[1]
    assert lock_files(tmp_path) == []


def test_file_systems_without_locks_get_a_notice(tmp_path, monkeypatch, capsys):
    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(locks.fcntl, "flock", refuse)
    with hold([Out("-o", tmp_path / "out.gguf")], "export-lora"):
        pass
    assert re.search(r"does not support file locks: another run writing .*out\.gguf would not be detected",
                     capsys.readouterr().err.replace("\n", ""))


def test_lock_errors(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    with pytest.raises(LlamatuneError, match=r"file/\.out\.lock: cannot create the lock file \(Not a directory\)"):
        with hold([Out("-o", tmp_path / "file" / "out.gguf")], "export-lora"):
            pass

    def broken(fd, op):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(locks.fcntl, "flock", broken)
    with pytest.raises(LlamatuneError, match=r"\.out\.lock: cannot lock \(Input/output error\)"):
        with hold([Out("-o", tmp_path / "out.gguf")], "export-lora"):
            pass

    def vanishing(path, *args):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")
    monkeypatch.setattr(locks.os, "open", vanishing)
    with pytest.raises(LlamatuneError, match=r"\.out\.lock: cannot create the lock file \(its directory keeps "
                                             r"disappearing\)"):
        with hold([Out("-o", tmp_path / "out.gguf")], "export-lora"):
            pass


def test_other_mpi_ranks_and_dry_runs_take_no_lock(tmp_path):
    o = FinetuneOptions(checkpoint_out=tmp_path / "chk-ITERATION.gguf", lora_out=tmp_path / "a-ITERATION.gguf")
    with hold_training(o, "finetune", enabled=False):         # an MPI rank other than 0
        assert lock_files(tmp_path) == []
    o.dry_run = True
    with hold_training(o, "finetune"):
        assert lock_files(tmp_path) == []
    o.dry_run = False
    with hold_training(o, "finetune"):
        assert lock_files(tmp_path) == [".a-ITERATION.lock", ".a-LATEST.lock", ".chk-ITERATION.lock",
                                        ".chk-LATEST.lock", ".metrics.lock"]


def finetune_cli(tmp: Path, model: Path, name: str, adam_iter: int) -> list[str]:
    return [sys.executable, "-m", "llamatune.cli.main", "finetune", "--model-base", str(model),
            "--train-data", str(tmp / "train.txt"), "-c", "16", "-b", "2", "--lora-r", "2",
            "--adam-iter", str(adam_iter), "--save-every", "1", "--no-plot",
            "--checkpoint-out", str(tmp / f"{name}chk-ITERATION.gguf"),
            "--lora-out", str(tmp / f"{name}adapter-ITERATION.gguf")]


def test_two_real_runs_race_for_one_output_set(tmp_path, tiny_model):
    """Two processes started together with the same outputs: one trains, the other exits 1
    with one line naming it. A run with other outputs in the same folder trains meanwhile.
    Once the first is killed with kill -9, its lock is no obstacle to the next run."""
    (tmp_path / "train.txt").write_text(TEXT)
    cmd = finetune_cli(tmp_path, tiny_model, "", 100000)
    logs = [tmp_path / f"stderr-{i}.txt" for i in range(2)]
    runs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w")) for log in logs]
    try:
        deadline = time.time() + 120
        while all(p.poll() is None for p in runs) and time.time() < deadline:
            time.sleep(0.05)
        assert any(p.poll() is not None for p in runs), "both runs still going after 120 s"
        loser = next(p for p in runs if p.poll() is not None)
        winner = next(p for p in runs if p is not loser)
        err = logs[runs.index(loser)].read_text()
        assert loser.returncode == 1, err
        assert re.fullmatch(r"error: --\S+ \S+: another run writes these outputs \(" + holder_pattern(winner.pid, "finetune")
                            + r"\): wait for it to end or choose other output names \(lock \S+\.lock\)\n", err), err
        # another output set in the same folder: trains to the end while the winner runs
        o = FinetuneOptions(model_base=tiny_model, train_data=tmp_path / "train.txt", ctx=16, batch=2, lora_r=2,
                            adam_iter=2, save_every=0, plot=False, checkpoint_out=tmp_path / "b-chk-ITERATION.gguf",
                            lora_out=tmp_path / "b-adapter-ITERATION.gguf", metrics_out=tmp_path / "b-metrics.jsonl")
        assert finetune(o, quiet=True).state.iteration == 2
        assert winner.poll() is None, logs[runs.index(winner)].read_text()
    finally:
        for p in runs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()
    assert winner.returncode == -signal.SIGKILL
    assert ".chk-LATEST.lock" in lock_files(tmp_path)            # left behind by kill -9, held by nobody
    o = FinetuneOptions(model_base=tiny_model, train_data=tmp_path / "train.txt", ctx=16, batch=2, lora_r=2,
                        adam_iter=1, save_every=0, plot=False, checkpoint_out=tmp_path / "chk-ITERATION.gguf",
                        lora_out=tmp_path / "adapter-ITERATION.gguf", overwrite=True)     # starts over
    assert finetune(o, quiet=True).state.iteration == 1
    assert lock_files(tmp_path) == []
