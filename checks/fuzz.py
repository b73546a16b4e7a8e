"""Seeded fuzzing of every llamatune reader: mutated GGUF models, adapters and checkpoints.

    python -m checks.fuzz --cases 20000 [--seed 0] [--timeout 20] [--cli 100]

Seed files (a tiny F32 llama, the same in Q8_0, a Q4_K llama, a LoRA adapter, a
finetune checkpoint) are written with the project's own writer. Each case takes one
seed file and applies one to three mutations chosen by `numpy.random.default_rng
([seed, case])`: truncation; bit flips in the header, metadata, tensor infos or
data; huge counts and string/array lengths; tensor and metadata type swaps; tensor
offsets past the end, misaligned or overlapping; duplicated keys and tensor infos;
metadata values of the wrong type or out of range; inf/nan/huge values in the data.
The mutant then goes through a library reader:

    gguf        GGUFFile: metadata values and every tensor's bytes
    model       Model (weights, tokenizer) and a 4-token forward pass
    adapter     read_adapter + load_runtime_adapters and a forward pass with it
    checkpoint  checkpoint.load + load_into a ParamBuffer of the run that wrote it
    export      export_lora with the mutant as the base or as the adapter
    convert     convert-checkpoint of a mutated checkpoint, adapter, PEFT safetensors or ggla .bin
    cli         (--cli N cases) the `llamatune` command on the mutant, as a subprocess

The invariant: a case either loads or fails with a one-line LlamatuneError (exit 1
and one `error:` line without traceback on the command line); no other exception,
no input file modified, no hang (each case runs in a worker process that is killed
after --timeout seconds), no crash (a worker killed by a signal). The table lists
per reader: cases, loaded, clean errors, other exceptions, modified inputs, hangs,
crashes; then the top sites of other exceptions.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from checks.fuzz_mutate import CKPT_FLAGS, CKPT_OPTIONS, Layout, make_corpus, mutate, mutate_bytes

REPO = Path(__file__).resolve().parents[1]
READERS = ("gguf", "model", "adapter", "checkpoint", "export", "convert")
SEED_OF = {"gguf": ("model-f32", "model-q8", "model-q4k", "adapter", "checkpoint"),
           "model": ("model-f32", "model-q8", "model-q4k"), "adapter": ("adapter",),
           "checkpoint": ("checkpoint",), "export": ("model-q8", "adapter"),
           "convert": ("checkpoint", "adapter", "peft", "ggla")}
NOT_GGUF = ("peft", "ggla")          # seeds mutated as plain bytes (safetensors, ggla .bin)


# --------------------------------------------------------------------------- readers

class Readers:
    """Runs one reader on a mutant; seed files stay loaded between cases."""

    def __init__(self, corpus: dict[str, Path], workdir: Path):
        from llamatune.formats.gguf_io import GGUFFile
        from llamatune.models.model import Model
        self.corpus, self.workdir = corpus, workdir
        self.base = Model(corpus["model-f32"])
        self.base_q8 = corpus["model-q8"]
        self.tokens = np.array([[1, 5, 9, 13]])
        self.GGUFFile = GGUFFile

    def gguf(self, path: Path) -> None:
        f = self.GGUFFile(path)
        _ = f.metadata
        for t in f.tensors.values():
            t.raw_rows().sum()

    def model(self, path: Path) -> None:
        from llamatune.models.infer import Runner
        from llamatune.models.model import Model
        m = Model(path)
        m.tokenizer.encode("First Citizen", add_special=True)
        Runner(m).forward(self.tokens)

    def adapter(self, path: Path) -> None:
        from llamatune.formats.adapter import load_runtime_adapters, read_adapter
        from llamatune.models.infer import Runner
        read_adapter(path, self.base.file)
        Runner(self.base, load_runtime_adapters(self.base, [(str(path), 0.5)])).forward(self.tokens)

    def checkpoint(self, path: Path) -> None:
        from llamatune.train import checkpoint as ckpt
        from llamatune.train.lora import lora_specs, lora_targets
        from llamatune.options import FinetuneOptions
        from llamatune.train.params import ParamBuffer
        c = ckpt.load(path)
        opts = FinetuneOptions(**CKPT_OPTIONS)
        ckpt.check_frozen_options(c, opts)
        c.load_into(ParamBuffer(lora_specs(lora_targets(self.base.config, opts.ranks(), 4.0, tied=False))))

    def convert(self, path: Path, seed_name: str) -> None:
        from llamatune.commands.convert import convert
        out = self.workdir / ("out-peft" if seed_name == "adapter" else "out.gguf")
        to = {"checkpoint": "gguf-adapter", "adapter": "peft", "peft": "gguf-adapter", "ggla": "gguf-adapter"}
        try:
            convert(path, out, to[seed_name], self.corpus["model-f32"])
        finally:
            if out.is_dir():
                for p in out.iterdir():
                    p.unlink()
                out.rmdir()
            out.unlink(missing_ok=True)

    def export(self, path: Path, seed_name: str) -> None:
        from llamatune.commands.export import export_lora
        out = self.workdir / "merged.gguf"
        if seed_name == "adapter":
            export_lora(self.base_q8, [(path, 1.0)], out)
        else:
            export_lora(path, [(self.corpus["adapter"], 1.0)], out)
        out.unlink(missing_ok=True)


def _site(exc: BaseException) -> str:
    """`ExcType at file:line (function)` of the innermost llamatune frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "llamatune" in f.filename or f"{os.sep}kernels{os.sep}" in f.filename]
    f = (ours or frames or [None])[-1]
    where = f"{Path(f.filename).name}:{f.lineno} ({f.name})" if f else "?"
    return f"{type(exc).__name__} at {where}"


def sha(path: Path) -> str:
    """sha256 of a file, or of every file of a directory (a PEFT adapter)."""
    if path.is_dir():
        return ",".join(f"{p.name}:{sha(p)}" for p in sorted(path.iterdir()))
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


def case_spec(seed: int, case: int) -> tuple[str, str, np.random.Generator]:
    """(reader, seed file name, generator) of one case: the same for a seed, whatever else runs."""
    rng = np.random.default_rng([seed, case])
    reader = READERS[int(rng.integers(len(READERS)))]
    seeds = SEED_OF[reader]
    return reader, seeds[int(rng.integers(len(seeds)))], rng


def run_case(readers: Readers, layouts: dict, seed: int, case: int) -> dict:
    """Mutate, run one reader, classify. Runs inside the worker."""
    from llamatune.errors import LlamatuneError
    reader, seed_name, rng = case_spec(seed, case)
    seed_bytes, layout = layouts[seed_name]
    blob, done = mutate(seed_bytes, layout, rng) if layout else mutate_bytes(seed_bytes, rng)
    path = readers.workdir / f"case-{case}-{seed_name}.gguf"
    written = path
    if seed_name == "peft":                  # a PEFT directory: its config and the mutated safetensors
        path = readers.workdir / f"case-{case}-peft"
        path.mkdir()
        (path / "adapter_config.json").write_bytes((readers.corpus["peft"] / "adapter_config.json").read_bytes())
        written = path / "adapter_model.safetensors"
    written.write_bytes(blob)
    before = [sha(p) for p in readers.corpus.values()]
    result = {"case": case, "reader": reader, "seed_file": seed_name, "mutations": done}
    try:
        if reader in ("export", "convert"):
            getattr(readers, reader)(path, seed_name)
        else:
            getattr(readers, reader)(path)
        result["outcome"] = "loaded"
    except LlamatuneError as e:
        one_line = "\n" not in str(e) and str(e).strip() != ""
        result["outcome"] = "clean" if one_line else "other"
        result["message"] = str(e)[:300]
        if not one_line:
            result["site"] = "LlamatuneError of several lines at " + _site(e).split(" at ", 1)[1]
    except Exception as e:        # noqa: BLE001 - classifying every other exception is the point
        result["outcome"] = "other"
        result["site"] = _site(e)
        result["message"] = f"{type(e).__name__}: {str(e)[:300]}"
    if sha(written) != hashlib.sha256(blob).hexdigest() or [sha(p) for p in readers.corpus.values()] != before:
        result["modified"] = True
    for p in ([*path.iterdir(), path] if path.is_dir() else [path]):
        p.rmdir() if p.is_dir() else p.unlink()
    return result


def worker(corpus_dir: Path, seed: int) -> None:
    """Read case numbers from stdin, write one JSON result per line to the original stdout."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    import llamatune  # noqa: F401  (threading policy first)
    corpus = {k: Path(v) for k, v in json.loads((corpus_dir / "corpus.json").read_text()).items()}
    workdir = Path(tempfile.mkdtemp(prefix="cases-", dir=corpus_dir))
    layouts = {name: (p.read_bytes(), Layout(p)) for name, p in corpus.items() if name not in NOT_GGUF}
    layouts["ggla"] = (corpus["ggla"].read_bytes(), None)
    layouts["peft"] = ((corpus["peft"] / "adapter_model.safetensors").read_bytes(), None)
    readers = Readers(corpus, workdir)
    proto.write("ready\n")
    for line in sys.stdin:
        try:
            result = run_case(readers, layouts, seed, int(line))
        except Exception as e:    # noqa: BLE001 - a bug of this harness, not of a reader: report it
            reader, seed_name, _ = case_spec(seed, int(line))
            result = {"case": int(line), "reader": reader, "seed_file": seed_name, "outcome": "other",
                      "site": "fuzz harness: " + _site(e), "message": str(e)[:300]}
        proto.write(json.dumps(result) + "\n")


# --------------------------------------------------------------------------- the driver

class Worker:
    def __init__(self, corpus_dir: Path, seed: int, start_timeout: float):
        self.proc = subprocess.Popen([sys.executable, "-m", "checks.fuzz", "--worker", str(Path(corpus_dir).resolve()),
                                      "--seed", str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, bufsize=1, cwd=REPO)
        if self.read(start_timeout) != "ready":
            self.kill()
            raise RuntimeError("fuzz worker did not start")

    def read(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return line.strip() if line else None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def run_cli_case(corpus: dict[str, Path], seed: int, case: int, workdir: Path, timeout: float) -> dict:
    """One mutant through the `llamatune` command (perplexity, generate, export-lora, or finetune
    resuming from a mutated checkpoint)."""
    rng = np.random.default_rng([seed, case, 1])
    seed_name = str(rng.choice(["model-f32", "model-q8", "adapter", "checkpoint"]))
    blob, done = mutate(corpus[seed_name].read_bytes(), Layout(corpus[seed_name]), rng)
    path = workdir / f"cli-{case}.gguf"
    path.write_bytes(blob)
    text = corpus["model-f32"].parent / "text.txt"
    cmd = [sys.executable, "-m", "llamatune.cli.main"]
    if seed_name == "adapter":
        cmd += ["perplexity", "-m", str(corpus["model-f32"]), "-f", str(text), "-c", "16", "--lora", str(path)]
    elif seed_name == "checkpoint":
        out = workdir / "cli-out"
        cmd += ["finetune", "--model-base", str(corpus["model-f32"]), "--train-data", str(text), "--checkpoint-in",
                str(path), *CKPT_FLAGS, "--adam-iter", "4", "--checkpoint-out", str(out / "chk-ITERATION.gguf"),
                "--lora-out", str(out / "lora-ITERATION.gguf")]
    elif rng.random() < 0.5:
        cmd += ["perplexity", "-m", str(path), "-f", str(text), "-c", "16"]
    elif rng.random() < 0.5:
        cmd += ["generate", "-m", str(path), "-p", "First", "-n", "4", "--temp", "0"]
    else:
        cmd += ["export-lora", "-m", str(path), "--lora", str(corpus["adapter"]), "-o", str(workdir / "m.gguf")]
    result = {"case": case, "reader": "cli", "seed_file": seed_name, "mutations": done, "cmd": cmd[3]}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        result["outcome"] = "hang"
        return result
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    if p.returncode == 0:
        result["outcome"] = "loaded"
    elif p.returncode == 1 and len(lines) == 1 and "Traceback" not in p.stderr:
        result["outcome"], result["message"] = "clean", lines[0][:300]
    elif p.returncode < 0:
        result["outcome"] = "crash"
    else:
        result["outcome"] = "other"
        tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()][-1:] or [f"exit {p.returncode}"]
        result["site"] = f"{cmd[3]}: {tail[0][:120]}"
    if hashlib.sha256(path.read_bytes()).hexdigest() != hashlib.sha256(blob).hexdigest():
        result["modified"] = True
    path.unlink(missing_ok=True)
    (workdir / "m.gguf").unlink(missing_ok=True)
    shutil.rmtree(workdir / "cli-out", ignore_errors=True)
    return result


def campaign(n_cases: int, seed: int = 0, timeout: float = 20.0, n_cli: int = 0, workdir: Path | None = None,
             progress=None) -> list[dict]:
    """Run `n_cases` library cases (case numbers 0..n-1) and `n_cli` command-line cases."""
    own = workdir is None
    tmp = tempfile.TemporaryDirectory(prefix="llamatune-fuzz-") if own else None
    workdir = Path(tmp.name) if own else Path(workdir)
    try:
        corpus = make_corpus(workdir / "corpus")
        results = []
        w = Worker(workdir / "corpus", seed, start_timeout=600)
        case = 0
        while case < n_cases:
            w.proc.stdin.write(f"{case}\n")
            w.proc.stdin.flush()
            line = w.read(timeout)
            if line is None:                                   # no answer: hang or crash
                try:
                    code = w.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    code = None
                reader, seed_name, _ = case_spec(seed, case)
                outcome = "hang" if code is None else "crash"
                results.append({"case": case, "reader": reader, "seed_file": seed_name, "outcome": outcome,
                                "site": f"exit {code}"})
                w.kill()
                w = Worker(workdir / "corpus", seed, start_timeout=600)
            else:
                results.append(json.loads(line))
            case += 1
            if progress:
                progress(len(results), n_cases + n_cli)
        w.kill()
        for i in range(n_cli):
            results.append(run_cli_case(corpus, seed, i, workdir, timeout=max(timeout, 60)))
            if progress:
                progress(len(results), n_cases + n_cli)
        return results
    finally:
        if tmp is not None:
            tmp.cleanup()


def table(results: list[dict]) -> str:
    """Per reader: cases, loaded, clean errors, other exceptions, modified inputs, hangs, crashes."""
    by = defaultdict(Counter)
    sites = defaultdict(Counter)
    for r in results:
        c = by[r["reader"]]
        c["cases"] += 1
        c[r["outcome"]] += 1
        c["modified"] += bool(r.get("modified"))
        if r["outcome"] in ("other", "hang", "crash"):
            sites[r["reader"]][r.get("site", r["outcome"])] += 1
    cols = ("cases", "loaded", "clean", "other", "modified", "hang", "crash")
    head = ("reader", "cases", "loaded", "clean errors", "other exceptions", "inputs modified", "hangs", "crashes")
    rows = [[name] + [str(by[name][k]) for k in cols] for name in list(READERS) + ["cli"] if name in by]
    total = Counter()
    for name in by:
        total.update(by[name])
    rows.append(["total"] + [str(total[k]) for k in cols])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    for name, counter in sites.items():
        lines.append(f"\n{name}: top exception sites")
        lines += [f"  {n:5d}  {s}" for s, n in counter.most_common(8)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000, help="library cases")
    ap.add_argument("--cli", type=int, default=None, help="command-line cases (default: cases/200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per case before it counts as a hang")
    ap.add_argument("--failures", type=Path, default=None, help="write every non-clean case here (JSON lines)")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker, a.seed)
        return
    n_cli = a.cases // 200 if a.cli is None else a.cli
    t0 = time.time()

    def progress(done: int, total: int) -> None:
        if done % 500 == 0 or done == total:
            print(f"  {done}/{total} cases, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)

    results = campaign(a.cases, a.seed, a.timeout, n_cli, progress=progress)
    print(f"{len(results)} cases (seed {a.seed}) in {time.time() - t0:.0f} s\n")
    print(table(results))
    if a.failures:
        with open(a.failures, "w") as f:
            for r in results:
                if r["outcome"] in ("other", "hang", "crash") or r.get("modified"):
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
