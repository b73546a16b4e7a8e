"""Data parallelism with MPI (distributed.py): `mpiexec -n 2` against one process.

Every run is a real command in a subprocess with one OpenBLAS and one numba thread
per process (OpenBLAS's sums depend on its thread count; with equal counts the
ranks must reproduce the single process to the last bit). The tests that start
mpiexec skip with the reason when mpi4py or a working mpiexec is missing
(`pip install -e ".[mpi]"` brings both).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llamatune.train import checkpoint as ckpt
from llamatune.train import distributed
from llamatune.launcher import LAUNCH_VARS, launched_by_mpi, local_rank, local_ranks, share_cores
from llamatune.errors import LlamatuneError
from llamatune.formats.gguf_io import GGUFFile
from llamatune.options import FinetuneOptions

from conftest import TEXT

# as root, Open MPI refuses to start without these; one thread per process for exact comparisons
ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "OPENBLAS_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
for _k in LAUNCH_VARS:          # the test process itself must not look MPI-launched
    ENV.pop(_k, None)
CLI = [sys.executable, "-m", "llamatune.cli.main"]


def mpiexec() -> str | None:
    here = Path(sys.executable).parent / "mpiexec"       # the one the [mpi] extra installs beside python
    return str(here) if here.exists() else shutil.which("mpiexec")


@pytest.fixture(scope="module")
def launcher() -> list[str]:
    """`mpiexec -n 2`, or skip with the reason it cannot start two ranks here."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not installed (pip install -e '.[mpi]')")
    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec on PATH (pip install -e '.[mpi]' installs Open MPI's)")
    probe = [exe, "-n", "2", sys.executable, "-c", "from mpi4py import MPI; print(MPI.COMM_WORLD.Get_size())"]
    try:
        r = subprocess.run(probe, env=ENV, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.skip("mpiexec -n 2 did not start within 60 s")
    if r.returncode != 0 or r.stdout.split() != ["2", "2"]:
        pytest.skip(f"mpiexec -n 2 cannot start here: {(r.stderr or r.stdout).strip()[-300:]}")
    return [exe, "-n", "2"]


def train_args(tmp: Path, model: Path, out: str, **over) -> list[str]:
    (tmp / "train.txt").write_text(TEXT)
    opts = {"model-base": model, "train-data": tmp / "train.txt", "ctx": 16, "batch": 2, "lora-r": 2,
            "adam-iter": 4, "save-every": 0, "warmup": 1, "adam-alpha": 1e-2, "lora-dropout": 0.1,
            "rank-out": 2, "rank-att-norm": 1, "rank-tok-embd": 1, "mpi-check-every": 1,
            "checkpoint-out": tmp / out / "chk-ITERATION.gguf", "lora-out": tmp / out / "adapter-ITERATION.gguf"}
    opts.update(over)
    (tmp / out).mkdir(exist_ok=True)
    return ["finetune"] + [a for k, v in opts.items() for a in (f"--{k}", str(v))]


def run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def tensors(path: Path) -> dict[str, np.ndarray]:
    return {n: np.array(t.data) for n, t in GGUFFile(path).tensors.items()}


def assert_same_training(a: Path, b: Path) -> None:
    """Two checkpoints hold identical parameters, Adam moments and data position."""
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        np.testing.assert_array_equal(ta[name], tb[name], err_msg=name)
    fa, fb = GGUFFile(a), GGUFFile(b)
    for key in ("training.iteration_count", "training.sample_count", "training.token_count",
                "training.loss_ema", "llamatune.data_state"):
        assert fa.get(key) == fb.get(key), key


def ranks_match_grad_acc(tmp_path: Path, launcher: list[str], args: list, iters: int,
                         timing: tuple[str, ...] = ("tokens_per_s",)) -> list[dict]:
    """`llamatune ARGS` in one process with --grad-acc 2 (tmp_path/one) and on the launcher's
    two ranks with --grad-acc 1 (tmp_path/two): the same checkpoint after `iters` steps
    (assert_same_training) and the same metrics rows but for the `timing` keys; the rows."""
    for name, prefix, acc in (("one", [], 2), ("two", launcher, 1)):
        (tmp_path / name).mkdir()
        run(prefix + CLI + [str(a) for a in args + [
            "--grad-acc", acc, "--checkpoint-out", tmp_path / name / "chk-ITERATION.gguf",
            "--lora-out", tmp_path / name / "adapter-ITERATION.gguf"]])
    assert_same_training(tmp_path / "one" / f"chk-{iters}.gguf", tmp_path / "two" / f"chk-{iters}.gguf")
    rows = [[{k: v for k, v in json.loads(x).items() if k not in timing}
             for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()] for name in ("one", "two")]
    assert rows[0] == rows[1]
    return rows[0]


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_model) -> Path:
    """The reference: one process, --grad-acc 2, 4 steps."""
    tmp = tmp_path_factory.mktemp("single")
    run(CLI + train_args(tmp, tiny_model, "out", **{"grad-acc": 2}))
    return tmp / "out"


def test_two_ranks_train_the_adapter_of_one_process_with_grad_acc_2(tmp_path, tiny_model, launcher, single):
    r = run(launcher + CLI + train_args(tmp_path, tiny_model, "out"))
    assert_same_training(single / "chk-4.gguf", tmp_path / "out" / "chk-4.gguf")
    for name, a in tensors(single / "adapter-LATEST.gguf").items():
        np.testing.assert_array_equal(a, tensors(tmp_path / "out" / "adapter-LATEST.gguf")[name], err_msg=name)
    assert GGUFFile(tmp_path / "out" / "chk-4.gguf").get("llamatune.ranks") == 2
    assert not list((tmp_path / "out").glob(".*.lock"))           # rank 0's locks end with the run
    # rank 0 alone reports; the per-step exchange is one LoRA gradient (P float32) per rank
    assert r.stdout.count("finetune: 4 steps") == 1
    n_params = sum(a.size for n, a in tensors(single / "chk-4.gguf").items() if not n.startswith("optimizer."))
    assert f"each rank sent {n_params * 4 / 2**20:.2f} MiB" in r.stderr


def test_train_from_scratch_on_two_ranks_writes_the_model_of_one_process(tmp_path, tiny_model, launcher):
    (tmp_path / "train.txt").write_text(TEXT)
    args = ["train-from-scratch", "--vocab-model", str(tiny_model), "--train-data", str(tmp_path / "train.txt"),
            "--embd", "32", "--head", "4", "--layer", "1", "-c", "16", "-b", "2", "--adam-iter", "3",
            "--save-every", "0", "--warmup", "1"]
    out = lambda d: ["--checkpoint-out", str(tmp_path / d / "chk-ITERATION.gguf"),  # noqa: E731
                     "--model-out", str(tmp_path / d / "model-ITERATION.gguf")]
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    run(CLI + args + out("one") + ["--grad-acc", "2"])
    run(launcher + CLI + args + out("two"))
    assert (tmp_path / "one" / "model-3.gguf").read_bytes() == (tmp_path / "two" / "model-3.gguf").read_bytes()
    assert_same_training(tmp_path / "one" / "chk-3.gguf", tmp_path / "two" / "chk-3.gguf")


def test_full_finetune_on_two_ranks_writes_the_model_of_one_process(tmp_path, tiny_model, launcher):
    """--fine-tune-type full: two ranks train the weights one process trains with --grad-acc 2."""
    full = {"fine-tune-type": "full", "freeze": "token_embd.*", "adam-alpha": 1e-3}
    out = lambda d: {"model-out": tmp_path / d / "model-ITERATION.gguf"}  # noqa: E731
    run(CLI + train_args(tmp_path, tiny_model, "one", **{"grad-acc": 2}, **full, **out("one")))
    run(launcher + CLI + train_args(tmp_path, tiny_model, "two", **full, **out("two")))
    assert (tmp_path / "one" / "model-4.gguf").read_bytes() == (tmp_path / "two" / "model-4.gguf").read_bytes()
    assert_same_training(tmp_path / "one" / "chk-4.gguf", tmp_path / "two" / "chk-4.gguf")


@pytest.mark.slow                                  # 13 s: three launches
def test_checkpoints_resume_with_another_number_of_ranks(tmp_path, tiny_model, launcher, single):
    """2 ranks for 2 steps, then 1 process to step 4 (and the reverse): the single run's trajectory."""
    run(launcher + CLI + train_args(tmp_path, tiny_model, "a", **{"adam-iter": 2}))
    run(CLI + train_args(tmp_path, tiny_model, "a", **{"grad-acc": 2, "checkpoint-in": tmp_path / "a" / "chk-LATEST.gguf"}))
    assert_same_training(single / "chk-4.gguf", tmp_path / "a" / "chk-4.gguf")
    run(CLI + train_args(tmp_path, tiny_model, "b", **{"adam-iter": 2, "grad-acc": 2}))
    run(launcher + CLI + train_args(tmp_path, tiny_model, "b", **{"checkpoint-in": tmp_path / "b" / "chk-LATEST.gguf"}))
    assert_same_training(single / "chk-4.gguf", tmp_path / "b" / "chk-4.gguf")


def test_ranks_given_different_data_are_refused(tmp_path, tiny_model, launcher):
    (tmp_path / "other.txt").write_text(TEXT.upper())
    one = launcher[:-1] + ["1"]                                   # MPMD: mpiexec -n 1 A : -n 1 B
    cmd = (one + CLI + train_args(tmp_path, tiny_model, "out") + [":"]
           + one[1:] + CLI + train_args(tmp_path, tiny_model, "out", **{"train-data": tmp_path / "other.txt"}))
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "ranks were given different training data (rank 0 vs rank(s) 1)" in r.stderr   # printed before the abort
    assert not list((tmp_path / "out").iterdir())                 # nothing trained, nothing written


def test_rank_0_alone_locks_the_outputs(tmp_path, tiny_model, launcher):
    """The two-rank runs above would stop on their own lock if every rank took it; a job
    whose outputs another run holds stops on rank 0 with the holder's line."""
    from llamatune.locks import hold
    from llamatune.outputs import Out
    args = train_args(tmp_path, tiny_model, "out")
    lora_out = tmp_path / "out" / "adapter-ITERATION.gguf"
    with hold([Out("--lora-out", lora_out, "LATEST")], "finetune"):          # held by this process
        r = subprocess.run(launcher + CLI + args, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert f"error: rank 0: --lora-out {lora_out}: another run writes these outputs (pid {os.getpid()} " in r.stderr
    assert not list((tmp_path / "out").iterdir())                 # nothing written, lock files gone


def _pid_of_rank(rank: int, tag: str) -> int | None:
    """The process of this test's job (tagged through its environment) holding `rank`."""
    for proc in Path("/proc").iterdir():
        try:
            env = set((proc / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if f"LLAMATUNE_TEST_JOB={tag}".encode() in env and (
                f"OMPI_COMM_WORLD_RANK={rank}".encode() in env or f"PMI_RANK={rank}".encode() in env):
            return int(proc.name)
    return None


def _signal_rank_mid_run(tmp_path, tiny_model, launcher, sig, **over) -> tuple[str, float]:
    """Start a long 2-rank run that saves every step, send `sig` to rank 1 once LATEST is at
    iteration 3 or more; return (the launcher's stderr, seconds until the job ended)."""
    if not Path("/proc/self/environ").exists():
        pytest.skip("needs /proc to find a rank's process")
    tag = str(tmp_path)
    cmd = launcher + CLI + train_args(tmp_path, tiny_model, "out", **{"adam-iter": 100000, "save-every": 1, **over})
    p = subprocess.Popen(cmd, env={**ENV, "LLAMATUNE_TEST_JOB": tag}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    latest = tmp_path / "out" / "chk-LATEST.gguf"
    pid = None
    try:
        deadline = time.time() + 180
        while time.time() < deadline:                         # until it has saved a few steps
            try:
                if latest.exists() and ckpt.load(latest).state.iteration >= 3:
                    break
            except LlamatuneError:
                pass                                          # being replaced right now
            time.sleep(0.05)
        pid = _pid_of_rank(1, tag)
        assert pid is not None, "rank 1 not found"
        os.kill(pid, sig)
        t = time.time()
        _, stderr = p.communicate(timeout=60)
        ended_after = time.time() - t
    finally:
        if p.poll() is None:
            p.kill()
        if pid is not None and sig == signal.SIGSTOP and Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
    assert p.returncode != 0
    c = ckpt.load(latest)                                     # the last complete checkpoint
    assert c.state.iteration >= 3 and c.state.ranks == 2
    return stderr, ended_after


def test_a_killed_rank_ends_the_job_and_latest_stays_loadable(tmp_path, tiny_model, launcher):
    stderr, ended_after = _signal_rank_mid_run(tmp_path, tiny_model, launcher, signal.SIGKILL)
    assert ended_after < 10
    assert re.search(r"signal 9|Killed|KILLED", stderr), stderr[-1000:]     # the launcher names the dead rank


def test_a_hung_rank_ends_the_job_after_mpi_timeout(tmp_path, tiny_model, launcher):
    """A stopped rank is alive for the launcher; rank 0's watchdog ends the job."""
    stderr, ended_after = _signal_rank_mid_run(tmp_path, tiny_model, launcher, signal.SIGSTOP, **{"mpi-timeout": 2})
    assert 2 <= ended_after < 30
    # whichever collective the live rank reaches first: the step's imatrix statistics (LoRA sft),
    # the gradient exchange or the parameter checksum
    assert re.search(r"error: rank \d: the other ranks did not join the (gradient exchange|parameter checksum|"
                     r"imatrix statistics) within --mpi-timeout 2 s \(a rank hung\?\): ending the job",
                     stderr), stderr[-1000:]


# --------------------------------------------------------------------------- in-process, no MPI
def test_grad_acc_sums_separately_computed_micro_batch_gradients(tmp_path, tiny_model):
    """One process with --grad-acc 2: the step's gradient is g0 + g1 of the two micro-batches,
    each computed from zero (the order K ranks reproduce), not one buffer accumulated across both."""
    from llamatune.commands.finetune import build_job
    from llamatune.data.samples import Batcher
    from llamatune.train.step import StepExecutor
    (tmp_path / "t.txt").write_text(TEXT)
    o = FinetuneOptions(model_base=tiny_model, train_data=tmp_path / "t.txt", ctx=16, batch=2, lora_r=2,
                        rank_out=2, rank_att_norm=1, grad_acc=2)
    job = build_job(o)
    job.init_params(np.random.default_rng(0))
    job.params.data[...] += np.random.default_rng(1).normal(0, 0.01, job.params.size).astype(np.float32)
    executor = StepExecutor(job.cfg, job.weights, job.params, job.targets, o.batch, o.ctx)
    batcher = Batcher(job.samples, o, job.cfg.n_vocab, job.tokenizer.bos_id, job.tokenizer.eos_id)
    batches = [batcher.next_batch(), batcher.next_batch()]
    n = sum(b.n_targets for b in batches)
    weights = [(b.targets >= 0).astype(np.float32) / np.float32(n) for b in batches]
    separate, losses = [], []
    for b, w in zip(batches, weights):
        job.params.zero_grad()
        losses.append(executor.step(b.inputs, b.targets, w, (1, 0, len(separate))))
        separate.append(job.params.grad.copy())
    grads = distributed.GradientSum(distributed.World(), job.params)
    for m, b in grads.mine(batches):
        grads.add(executor.step(b.inputs, b.targets, weights[m], (1, 0, m)))
    assert grads.finish() == 0.0 + losses[0] + losses[1]
    np.testing.assert_array_equal(job.params.grad, separate[0] + separate[1])


def test_resume_freezes_the_global_batch_not_grad_acc(tmp_path):
    from llamatune.train.params import ParamBuffer, ParamSpec
    params = ParamBuffer([ParamSpec("w", (2, 3))])
    path = tmp_path / "chk.gguf"
    ckpt.save(path, ckpt.KIND_LORA, "llama", FinetuneOptions(grad_acc=1), params, ckpt.TrainState(ranks=2), [])
    c = ckpt.load(path)
    assert c.state.ranks == 2
    ckpt.check_frozen_options(c, FinetuneOptions(grad_acc=2), ranks=1)       # 1 x 2 == 2 x 1
    ckpt.check_frozen_options(c, FinetuneOptions(grad_acc=1), ranks=2)
    with pytest.raises(LlamatuneError, match=r"changed options: micro-batches per step \(--grad-acc x ranks\) "
                                             r"1 x 2 -> 1 x 1"):
        ckpt.check_frozen_options(c, FinetuneOptions(grad_acc=1), ranks=1)


def test_launch_detection_and_core_sharing():
    assert not launched_by_mpi({})
    assert local_ranks({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == 2
    assert local_ranks({"PMI_SIZE": "2", "MPI_LOCALNRANKS": "2"}) == 2
    env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "NUMBA_NUM_THREADS": "3"}
    share_cores(env)
    assert env["OPENBLAS_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    assert env["NUMBA_NUM_THREADS"] == "3"                                   # the user's setting wins
    untouched = {}
    share_cores(untouched)
    assert untouched == {}


def test_single_process_world_without_mpi(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    w = distributed.setup(FinetuneOptions(mpi=False))                        # --no-mpi
    assert (w.rank, w.size, w.comm) == (0, 1, None) and w.is_root
    distributed.check_same_job(w, FinetuneOptions(), 1, "x")                  # nothing to compare with


def test_parameter_checks_follow_the_option_default():
    """--mpi-check-every comes from the options (default 10), with no fallback of its own."""
    every = FinetuneOptions().mpi_check_every
    assert [i for i in range(1, 31) if distributed.checksum_due(FinetuneOptions(), i, False)] == [every, 2 * every,
                                                                                                  3 * every]
    assert distributed.checksum_due(FinetuneOptions(mpi_check_every=0), 7, True)
    assert not distributed.checksum_due(FinetuneOptions(mpi_check_every=0), 10, False)


def test_mpi_options_are_validated():
    from llamatune.options import validate
    with pytest.raises(LlamatuneError, match=r"--mpi-check-every -1: must be at least 0"):
        validate(FinetuneOptions(mpi_check_every=-1))
    with pytest.raises(LlamatuneError, match=r"--mpi-timeout nan: must be a finite number"):
        validate(FinetuneOptions(mpi_timeout=float("nan")))


def test_parameters_that_drift_apart_stop_training(tmp_path):
    """The comparisons, with a stand-in communicator whose rank 1 holds other parameters or options."""
    from llamatune.train.params import ParamBuffer, ParamSpec

    class Drifted:
        def allgather(self, value):
            other = {**value, "options": "0"} if isinstance(value, dict) else "0" * len(value)
            return [value, other]

    params = ParamBuffer([ParamSpec("w", (4,))])
    world = distributed.World(rank=0, size=2, comm=Drifted())
    with pytest.raises(LlamatuneError, match=r"parameters differ between ranks after iteration 7 \(rank 0 vs rank\(s\) 1\)"):
        distributed.check_identical_parameters(world, params, 7)
    with pytest.raises(LlamatuneError, match=r"ranks were given different options \(rank 0 vs rank\(s\) 1\)"):
        distributed.check_same_job(world, FinetuneOptions(), 1, "x")


def test_local_rank_from_each_launchers_variable():
    assert local_rank({}) == 0                                    # not under MPI
    assert local_rank({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}) == 3
    assert local_rank({"PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}) == 1
    assert local_rank({"PMIX_RANK": "5", "SLURM_LOCALID": "2"}) == 2
    assert local_rank({"OMPI_COMM_WORLD_SIZE": "4"}) == 0         # no local rank given


def test_each_local_rank_takes_its_own_gpu():
    """One GPU per local rank (local rank mod visible GPUs), set for numba and CuPy; a
    single rank keeps the default GPU. Fake numba.cuda and CuPy modules."""
    from types import SimpleNamespace
    from llamatune.backend import select_gpu
    picked = []

    def fakes(n_gpus):
        cuda = SimpleNamespace(gpus=[object()] * n_gpus, select_device=lambda i: picked.append(("numba", i)))
        device = lambda i: SimpleNamespace(use=lambda: picked.append(("cupy", i)))  # noqa: E731
        return cuda, SimpleNamespace(cuda=SimpleNamespace(Device=device))
    env = {"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}
    assert select_gpu(*fakes(4), env) == 3
    assert picked == [("numba", 3), ("cupy", 3)]
    picked.clear()
    assert select_gpu(*fakes(2), env) == 1                                     # 4 ranks share 2 GPUs
    assert picked == [("numba", 1), ("cupy", 1)]
    picked.clear()
    assert select_gpu(*fakes(4), {"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}) is None
    assert select_gpu(*fakes(4), {}) is None
    assert picked == []
