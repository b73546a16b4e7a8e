"""Output paths checked before a command runs, so inputs are never overwritten and
no command stops half-way for a reason it could have seen at the start.

`check_paths(inputs, outputs)` is the one check every writing command calls:
  * an output (its ITERATION forms included: any step number and the LATEST name)
    that names an input is refused, after resolving symlinks and, where the files
    exist, comparing (st_dev, st_ino) so hard links are caught too;
  * two outputs that would overwrite each other are refused;
  * an output that is an existing directory (unless a directory is what is
    written), or whose directory cannot be written or created, is refused.
Pairs in `may_share` are allowed to coincide: `--checkpoint-in chk-LATEST.gguf` with
`--checkpoint-out chk-ITERATION.gguf` is the normal resume (the input is memory-mapped
and outputs are replaced by atomic rename, so the old file stays intact while read).
`check_free_space` refuses a run whose first save would not fit on the disk.

A training run's outputs (`check_training_paths`) follow three more rules:
  * `place_outputs`: its relative output names (the `*_out` options, the metrics log)
    are placed in --output-dir;
  * a folder an output goes to must exist, but for --output-dir itself (created);
  * `check_new_run`, once the run holds its locks: a run that starts afresh (nothing to
    resume) refuses to replace an earlier run's LATEST files unless --overwrite.
`prune_saves` keeps the newest --save-total-limit numbered saves.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .errors import LlamatuneError
from .options import cli_flag

ITERATION = "ITERATION"
PLOT_LABEL = "--metrics-out (its plot)"     # the loss plot: redrawn from the metrics, never an earlier run's data


@dataclass(frozen=True)
class Out:
    """An output: `path` may hold ITERATION (replaced by step numbers and by `latest`)."""
    label: str                  # the option that names it, e.g. "--lora-out"
    path: Path
    latest: str = ""            # the --fn-latest replacement for ITERATION ("" = none)
    is_dir: bool = False        # a directory is written (PEFT adapter, quickstart workdir)

    def concrete(self) -> Path:
        """The one path always written: the LATEST form, or the path itself."""
        return Path(str(self.path).replace(ITERATION, self.latest))

    def pattern(self) -> re.Pattern:
        """Matches every resolved path this output can write (any step number, LATEST)."""
        parts = str(_resolve(self.path)).split(ITERATION)
        tags = "(?:" + r"\d+|" + re.escape(self.latest) + ")"
        return re.compile(tags.join(map(re.escape, parts)) + r"\Z")

    def existing(self) -> list[Path]:
        """Files or directories already present that this output would replace."""
        if ITERATION not in self.path.name:
            return [self.concrete()] if os.path.lexists(self.concrete()) else []
        folder = _resolve(self.concrete().parent)
        rx = self.pattern()
        try:
            return [p for p in folder.iterdir() if rx.match(str(folder / p.name))]
        except OSError:                   # no such directory (yet): nothing to replace
            return []


def _resolve(p: Path) -> Path:
    return Path(os.path.abspath(Path(p).expanduser().resolve()))


def _inode(p: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(p)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _clash(inp: Path, out: Out) -> bool:
    if out.pattern().match(str(_resolve(inp))):
        return True
    ident = _inode(inp)
    return ident is not None and any(_inode(p) == ident for p in out.existing())


def _not_writable(folder: Path) -> str | None:
    """Why no file can be created in `folder` (None when one can): a real probe, so
    permissions, read-only mounts and root's rights all count as they will when writing.
    An unnamed file where the system has them (Linux's O_TMPFILE, which TemporaryFile
    tries first): a process killed mid-probe (an MPI job aborted by another rank) leaves
    no file behind."""
    try:
        with tempfile.TemporaryFile(prefix=".llamatune-probe.", dir=folder):
            pass
    except OSError as e:
        return f"directory {folder} is not writable ({e.strerror})"
    return None


def _cannot_write(out: Out) -> str | None:
    """Why `out` cannot be written (None when it can)."""
    target = out.concrete()
    if not out.is_dir and target.is_dir():
        return f"{target}: is a directory ({out.label} names a file)"
    if out.is_dir and target.exists() and not target.is_dir():
        return f"{target}: exists and is not a directory ({out.label} names a directory)"
    for p in out.existing():
        if not out.is_dir and p.is_dir():
            return f"{p}: is a directory ({out.label} names a file)"
    folder = _resolve(target.parent)
    probe = folder
    while not probe.exists():            # the nearest existing ancestor must let us create the rest
        probe = probe.parent
    if not probe.is_dir():
        return f"{target}: cannot create directory {folder}: {probe} is not a directory"
    problem = _not_writable(probe) or (_not_writable(target) if out.is_dir and target.is_dir() else None)
    return f"{target}: {problem}" if problem else None


def check_paths(inputs: Iterable[tuple[str, Path | None]], outputs: Iterable[Out],
                may_share: Iterable[tuple[str, str]] = ()) -> None:
    """Refuse, with one line naming both paths, any output that would overwrite an input
    or another output, and any output that cannot be written. Nothing is created."""
    inputs = [(label, Path(p)) for label, p in inputs if p is not None]
    outputs = [o for o in outputs if o.path is not None]
    allowed = set(may_share)
    for out in outputs:
        for label, inp in inputs:
            if (label, out.label) not in allowed and _clash(inp, out):
                raise LlamatuneError(f"{out.label} {out.path} would overwrite the input {label} {inp}: "
                                     "choose another output name")
    for i, a in enumerate(outputs):
        for b in outputs[i + 1:]:
            if _clash(b.concrete(), a) or _clash(a.concrete(), b):
                raise LlamatuneError(f"{a.label} {a.path} and {b.label} {b.path} would overwrite each other")
    for out in outputs:
        problem = _cannot_write(out)
        if problem:
            raise LlamatuneError(problem)


def place_outputs(opts) -> None:
    """--output-dir: each relative output path of a training run (the `*_out` options,
    the metrics log) is made relative to it, once (a second call changes nothing)."""
    from dataclasses import fields
    if getattr(opts, "_outputs_placed", False):
        return
    folder = Path(opts.output_dir)
    for f in fields(opts):
        value = getattr(opts, f.name)
        if f.name.endswith("_out") and isinstance(value, Path) and not value.is_absolute():
            setattr(opts, f.name, folder / value)
    opts._outputs_placed = True


def _missing_folder(outputs: Iterable[Out], made: Path) -> str | None:
    """An output whose folder does not exist, unless it is `made` (--output-dir, created)."""
    for out in outputs:
        folder = _resolve(out.concrete().parent)
        if not folder.exists() and folder != _resolve(made):
            return (f"{out.label} {out.path}: folder {out.concrete().parent} does not exist (create it, or give "
                    "a name inside --output-dir)")
    return None


def training_paths(opts, preset: Path | None = None) -> tuple[list[tuple[str, Path | None]], list[Out]]:
    """Inputs and outputs of a training command, from its option fields: a path option
    named `*_out` is an output (ITERATION forms included), every other one an input;
    with --save-best also the BEST forms, and the metrics log and its plot."""
    from dataclasses import fields

    inputs: list[tuple[str, Path | None]] = [("--config", preset)]
    outputs: list[Out] = []
    unwritten = opts.unwritten_outputs() if hasattr(opts, "unwritten_outputs") else ()
    for f in fields(opts):
        value = getattr(opts, f.name)
        if "Path" not in str(f.type) or value is None or f.name in unwritten or f.name == "output_dir":
            continue
        if f.name.endswith("_out"):
            outputs.append(Out(cli_flag(f), Path(value), opts.fn_latest))
        else:
            inputs.append((cli_flag(f), Path(value)))
    if opts.save_best:
        outputs += [Out(o.label, Path(str(o.path).replace(ITERATION, "BEST"))) for o in list(outputs)
                    if ITERATION in str(o.path)]
    metrics = metrics_path(opts)
    if opts.metrics_out is None:                    # the default log beside the checkpoints
        outputs.append(Out("--metrics-out", metrics))
    if opts.plot:
        outputs.append(Out(PLOT_LABEL, metrics.with_suffix(".png")))
    return inputs, outputs


def check_training_paths(opts, preset: Path | None = None) -> None:
    """check_paths for a training command, its outputs placed in --output-dir first;
    resuming from a checkpoint output is allowed; every output's folder must exist, but
    --output-dir's own."""
    place_outputs(opts)
    inputs, outputs = training_paths(opts, preset)
    check_paths(inputs, outputs, may_share=[("--checkpoint-in", "--checkpoint-out")])
    problem = _missing_folder(outputs, Path(opts.output_dir))
    if problem:
        raise LlamatuneError(problem)


def check_new_run(opts) -> None:
    """Refuse a run that starts afresh (no --checkpoint-in to resume) where an earlier run
    left its LATEST files (or the metrics log), unless --overwrite: one line naming them,
    with the --checkpoint-in that resumes that run."""
    resume = opts.checkpoint_in is not None and Path(opts.checkpoint_in).exists()
    if opts.overwrite or resume:
        return
    _, outputs = training_paths(opts)
    found = [o.concrete() for o in outputs if o.label != PLOT_LABEL and os.path.lexists(o.concrete())]
    if not found:
        return
    latest = Path(str(opts.checkpoint_out).replace(ITERATION, opts.fn_latest))
    how = f"resume it with --checkpoint-in {latest}, " if latest.exists() else ""
    names = ", ".join(str(p) for p in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    raise LlamatuneError(f"{names}: an earlier run's files, which this new run would replace: {how}give "
                         "--overwrite to start over, or choose another --output-dir")


def prune_saves(files: Iterable[Path], iteration: int, keep: int) -> list[Path]:
    """--save-total-limit: for each file of the save at `iteration` whose name holds that
    number (chk-40.gguf, adapter-40.gguf, adapter-40.imatrix.gguf), delete the files of
    the same name with other numbers (earlier saves, this run's or an earlier one's) but
    the newest `keep`; LATEST and BEST names hold no number and stay. Returns the deleted."""
    if keep <= 0:
        return []
    gone = []
    for path in files:
        parts = re.split(rf"(?<!\d){iteration}(?!\d)", path.name)
        if len(parts) != 2:
            continue
        rx = re.compile(re.escape(parts[0]) + r"(\d+)" + re.escape(parts[1]) + r"\Z")
        numbered = sorted((int(m.group(1)), p) for p in path.parent.iterdir() if (m := rx.match(p.name)))
        for _, old in numbered[:-keep]:
            old.unlink(missing_ok=True)
            gone.append(old)
    return gone


def check_free_space(needs: Iterable[tuple[Path, int]]) -> None:
    """Refuse when the bytes the first save writes (per file system) exceed the free space."""
    by_device: dict[int, tuple[Path, int]] = {}
    for path, size in needs:
        probe = _resolve(path).parent
        while not probe.exists():
            probe = probe.parent
        dev = os.stat(probe).st_dev
        where, total = by_device.get(dev, (probe, 0))
        by_device[dev] = (where, total + size)
    for where, total in by_device.values():
        free = shutil.disk_usage(where).free
        if total > free:
            raise LlamatuneError(f"{where}: {free / 2**20:,.1f} MiB free, but the first save writes about "
                                 f"{total / 2**20:,.1f} MiB there (checkpoint and outputs, each with its LATEST "
                                 "copy): free some space or choose another directory")


METRICS_NAME = "metrics.jsonl"


def metrics_path(opts) -> Path:
    """--metrics-out, or metrics.jsonl in the directory of the checkpoints."""
    return Path(opts.metrics_out) if opts.metrics_out is not None else Path(opts.checkpoint_out).parent / METRICS_NAME
