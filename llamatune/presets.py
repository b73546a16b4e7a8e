"""Presets: TOML files of option values, addressed by name.

The repository keeps them in configs/; pyproject.toml installs that folder as the
package `llamatune.configs`, so `--config finetune-chat` works from a wheel as from a
checkout. A preset's name is its file's stem, and its first line, a comment, is its
one-line description (`--config list` prints both). `--config` also takes a path, as
before: a value that names an existing file, has a directory part or a suffix is a path.
"""
from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

from .errors import LlamatuneError
from .options import load_preset

LIST = "list"                                   # `--config list`: print the presets


def preset_dir() -> Path:
    """The installed presets (llamatune.configs), or configs/ beside the package in a
    checkout whose editable install predates the package mapping."""
    spec = find_spec("llamatune.configs")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[1] / "configs"


def presets(cls=None) -> dict[str, Path]:
    """Preset name -> file, sorted by name; with `cls` (an options dataclass) only the
    presets whose every key is one of its options (finetune's or train-from-scratch's)."""
    found = {p.stem: p for p in sorted(preset_dir().glob("*.toml"), key=lambda p: p.stem)}
    return {name: p for name, p in found.items() if cls is None or _fits(p, cls)}


def _fits(path: Path, cls) -> bool:
    try:
        load_preset(path, cls)
    except LlamatuneError:
        return False
    return True


def description(path: Path) -> str:
    """The preset's first line, a comment, without its '#'."""
    with open(path, encoding="utf-8") as f:
        first = f.readline().strip()
    return first.lstrip("#").strip() if first.startswith("#") else ""


def listing(cls, columns: int = 80) -> str:
    """`--config list`: each preset of this command, name and description, the
    description wrapped under itself to stay within `columns`."""
    import textwrap
    found = presets(cls)
    width = max(map(len, found), default=0)
    rows = []
    for name, p in found.items():
        lines = textwrap.wrap(description(p), max(columns - width - 2, 20), break_on_hyphens=False) or [""]
        rows += [f"{name:<{width}}  {lines[0]}"] + [" " * (width + 2) + line for line in lines[1:]]
    return "\n".join(rows)


def resolve(value: str | Path, cls) -> Path:
    """The file `--config VALUE` names: a path as given, else a preset of this command."""
    path = Path(value)
    if path.exists() or path.suffix or len(path.parts) > 1:
        return path                             # a path (load_preset reports a missing one)
    every = presets()                           # another command's preset: load_preset names its keys
    if path.name in every:
        return every[path.name]
    raise LlamatuneError(f"--config {value}: no such preset or file (presets: {names(cls) or 'none'}; "
                         f"or give a TOML file's path)")


def names(cls) -> str:
    """The preset names of a command, for the --config help."""
    return ", ".join(presets(cls))
