"""Commands built from the option dataclasses (llamatune/options.py).

Each dataclass field becomes one command-line option (or argument) with the field's
help text, help group, spellings and default; nothing about an option is written
twice. Every option defaults to None on the command line so that `build_options`
can tell "given" from "not given" and apply the precedence CLI > --config preset >
default (training commands) or CLI > default (the others).
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer


def _base_type(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and args else hint


METAVARS = {Path: "<path>", int: "<int>", float: "<float>", str: "<str>"}   # never a Python type (list[Path])


def _metavar(t: Any) -> str | None:
    """The help's value placeholder: a list option shows its items' one (it is repeatable)."""
    item = typing.get_args(t)[0] if typing.get_origin(t) is list else t
    return METAVARS.get(item)


def _show(value: Any) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _parameter(f: dataclasses.Field, hint: Any, prefix: str = "", **override) -> inspect.Parameter:
    """The typer parameter of one field; `override` replaces metadata (flags, required)."""
    from llamatune.options import cli_flag
    meta = {**f.metadata, **override}
    t = _base_type(hint)
    is_list = typing.get_origin(t) is list
    if meta.get("argument"):
        info = typer.Argument(..., help=meta["help"], show_default=False)
        return inspect.Parameter(prefix + f.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=t)
    flag = cli_flag(f)
    if meta.get("names"):
        decls = list(meta["names"])
    else:
        decls = [flag if meta.get("switch") or t is not bool else f"{flag}/--no-{flag[2:]}"]
        decls += list(meta.get("flags", ()))
    default = None if f.default is dataclasses.MISSING else f.default
    shown = "" if meta.get("required") or default is None or is_list or meta.get("switch") \
        else f" [default: {_show(default)}]"
    shown += " [required]" if meta.get("needed") else ""      # given here or in a preset: checked after both
    info = typer.Option(... if meta.get("required") else None, *decls, help=meta["help"] + shown,
                        rich_help_panel=meta.get("group"), show_default=False,
                        metavar=None if t is bool else _metavar(t))
    annotation = List[typing.get_args(t)[0]] if is_list else t if meta.get("required") else Optional[t]
    return inspect.Parameter(prefix + f.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def _values(kwargs: dict, cls, names, prefix: str = "") -> dict:
    """The given values of these fields of `cls` (None, an empty list or an unset switch:
    not given, so the default applies)."""
    switch = {f.name for f in dataclasses.fields(cls) if f.metadata.get("switch")}
    out = {}
    for name in names:
        v = kwargs.get(prefix + name)
        unset = (v is False and name in switch) or (isinstance(v, (list, tuple)) and not v)
        out[name] = None if unset else list(v) if isinstance(v, tuple) else v
    return out


def _prepare_threads(opts) -> None:
    """The OpenMP spin for the products this command will likely run, before OpenMP starts
    (llamatune.precision.prepare_threads): training a frozen base and quickstart default
    to auto, a command without a --compute-dtype (tokenize, export-lora, ...) to nothing."""
    from llamatune import options as o
    from llamatune.precision import prepare_threads
    requested = getattr(opts, "compute_dtype", "auto" if isinstance(opts, o.QuickstartOptions) else None)
    trainable = isinstance(opts, o.ScratchOptions) or getattr(opts, "fine_tune_type", "lora") == "full"
    prepare_threads(requested, getattr(opts, "device", "cpu"), trainable)


def add_options_command(app: typer.Typer, name: str, cls, run: Callable[..., None], help: str,
                        wrap: Callable[[Callable], Callable], *, preset: bool = False,
                        borrowed: tuple[Any, dict[str, dict]] | None = None) -> None:
    """Register `name` on `app`: parses every field of `cls`, builds the options and calls
    `run(options)`. `preset`: a --config TOML preset (training commands). `borrowed`:
    (another options class, {field name: metadata override}) whose named fields the
    command also takes; then `run(borrowed_options, options)`."""
    from llamatune import presets
    from llamatune.errors import LlamatuneError, UsageError
    from llamatune.options import build_options, check_needed
    params = []
    if preset:
        params.append(inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                                        default=typer.Option(None, "--config", metavar="<name|path>",
                                                             help="Preset of options: a shipped "
                                                             f"preset's name ({presets.names(cls)}; `--config list` "
                                                             "describes them) or a TOML file; command-line options "
                                                             "override it.",
                                                             rich_help_panel="Input and output")))
    if borrowed is not None:
        other, picks = borrowed
        other_fields = {f.name: f for f in dataclasses.fields(other)}
        hints = typing.get_type_hints(other)
        params += [_parameter(other_fields[n], hints[n], "borrowed_", **o) for n, o in picks.items()]
    hints = typing.get_type_hints(cls)
    own = [f.name for f in dataclasses.fields(cls)]
    params += [_parameter(f, hints[f.name]) for f in dataclasses.fields(cls)]

    def command(**kwargs):
        config = kwargs.pop("config", None)
        if config is not None and str(config) == presets.LIST:
            print(presets.listing(cls))
            return
        try:                                       # a wrong value or preset is a usage error (exit 2)
            if config is not None:
                config = presets.resolve(config, cls)       # a shipped preset's name, or a path
            opts = build_options(cls, _values(kwargs, cls, own), config)
            check_needed(opts)
        except LlamatuneError as e:
            raise UsageError(str(e)) from None
        if config is not None:                     # no output may overwrite the preset
            from llamatune.outputs import check_training_paths
            check_training_paths(opts, config)
        _prepare_threads(opts)
        if borrowed is None:
            return run(opts)
        return run(build_options(borrowed[0], _values(kwargs, borrowed[0], borrowed[1], "borrowed_")), opts)

    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = help
    command.__name__ = name.replace("-", "_")
    app.command(name=name, help=help)(wrap(command))
