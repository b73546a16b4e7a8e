"""How an option is declared and read: `opt` (a dataclass field with its help text,
help group and command-line spellings), presets, precedence and range checks. The
option classes themselves are in training.py and commands.py."""
from __future__ import annotations

import dataclasses
from dataclasses import field, fields
from pathlib import Path
from typing import Any

import tomllib

from ..errors import LlamatuneError


def opt(default: Any, help: str, group: str | None, *, flags: tuple[str, ...] = (), frozen: bool = False,
        names: tuple[str, ...] = (), switch: bool = False, required: bool = False, argument: bool = False,
        needed: bool = False):
    """A field with CLI metadata. `frozen` options must not change when resuming.
    `flags`: short or extra spellings beside --field-name; `names`: the whole list of
    spellings instead; `switch`: a plain on-flag (no --no- twin); `required`: must be
    given; `needed`: must be given, on the command line or in a preset (checked after
    both are read; marked [required] in the help as `required` is); `argument`:
    positional. `group` None: the help's plain "Options" section.
    A list default is copied for each instance."""
    meta = {"help": help, "group": group, "flags": flags, "frozen": frozen, "names": names, "switch": switch,
            "required": required, "argument": argument, "needed": needed}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def option_fields(cls) -> list[dataclasses.Field]:
    return list(fields(cls))


def cli_flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _coerce(f: dataclasses.Field, value: Any, source: str) -> Any:
    """Check and convert a preset value to the field's type."""
    t = str(f.type)
    try:
        if "bool" in t:
            if not isinstance(value, bool):
                raise TypeError
            return value
        if "Path" in t:
            return None if value is None else Path(value)
        if "int" in t:
            if isinstance(value, bool) or int(value) != value:
                raise TypeError
            return int(value)
        if "float" in t:
            return float(value)
        if "str" in t:
            if not isinstance(value, str):
                raise TypeError
            return value
    except (TypeError, ValueError):
        raise LlamatuneError(f"{source}: '{f.name}' = {value!r} is not a valid {t.replace('Optional[', '').rstrip(']')}") from None
    return value


def load_preset(path: Path, cls) -> dict[str, Any]:
    """Read a TOML preset: keys are option names (dashes or underscores); unknown keys are errors."""
    if not path.exists():
        raise LlamatuneError(f"{path}: preset file not found")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise LlamatuneError(f"{path}: not valid TOML ({e})") from None
    by_name = {f.name: f for f in fields(cls)}
    flat: dict[str, Any] = {}
    for key, value in raw.items():     # allow [sections] for readability; they are flattened
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for k, v in items:
            flat[k.replace("-", "_")] = v
    unknown = sorted(k for k in flat if k not in by_name)
    if unknown:
        raise LlamatuneError(f"{path}: unknown option(s) {', '.join(unknown)}")
    return {k: _coerce(by_name[k], v, str(path)) for k, v in flat.items()}


def build_options(cls, cli_values: dict[str, Any], preset: Path | None = None):
    """CLI values (None = not given) over preset values over dataclass defaults, validated.
    `preset`: a TOML file (presets.resolve turns a shipped preset's name into its file).
    (That no output overwrites the preset is outputs.check_training_paths's to say.)"""
    values = load_preset(preset, cls) if preset is not None else {}
    values.update({k: v for k, v in cli_values.items() if v is not None})
    opts = cls(**values)
    if hasattr(opts, "check"):            # each class range-checks its own values
        opts.check()
    return opts


def check_needed(opts) -> None:
    """Every `needed` option has a value (from the command line or a preset)."""
    missing = [cli_flag(f) for f in fields(opts) if f.metadata.get("needed") and getattr(opts, f.name) is None]
    if missing:
        raise LlamatuneError(f"missing option {', '.join(missing)} (give it on the command line or in the "
                             "--config preset)")


def check_number(flag: str, value, lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False,
                 also: tuple = ()) -> None:
    """One range check for every numeric option and argument: NaN and infinities are never
    accepted; `lo`/`hi` bound the value (closed unless *_open); values in `also` are allowed."""
    import math
    if value in also:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise LlamatuneError(f"{flag} {value}: must be a finite number")
    low = lo is None or (value > lo if lo_open else value >= lo)
    high = hi is None or (value < hi if hi_open else value <= hi)
    if low and high:
        return
    if hi is None:
        want = f"greater than {lo}" if lo_open else f"at least {lo}"
    elif lo is None:
        want = f"less than {hi}" if hi_open else f"at most {hi}"
    else:
        want = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    extra = "".join(f" (or {a})" for a in also)
    raise LlamatuneError(f"{flag} {value}: must be {want}{extra}")
