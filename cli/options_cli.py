"""Training commands built from the option dataclasses (llamatune/options.py).

Each dataclass field becomes one command-line option with the field's help text,
help group and default; nothing about an option is written twice. Every option
defaults to None on the command line so that `build_options` can tell "given"
from "not given" and apply the precedence CLI > --config preset > default.
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any, Callable, Optional

import typer


def _base_type(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and args else hint


def _show(value: Any) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def add_options_command(app: typer.Typer, name: str, cls, run: Callable[[Any], None], help: str,
                        wrap: Callable[[Callable], Callable]) -> None:
    """Register `name` on `app`: parses every field of `cls`, builds the options and calls `run`."""
    from llamatune.options import build_options, cli_flag
    from llamatune.outputs import check_training_paths
    hints = typing.get_type_hints(cls)
    params = [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                                default=typer.Option(None, "--config", help="TOML preset of options "
                                                     "(see configs/); command-line options override it.",
                                                     rich_help_panel="Input and output"))]
    for f in dataclasses.fields(cls):
        t = _base_type(hints[f.name])
        flag = cli_flag(f)
        decls = [f"{flag}/--no-{flag[2:]}"] if t is bool else [flag]
        decls += list(f.metadata.get("flags", ()))
        info = typer.Option(None, *decls, help=f"{f.metadata['help']} [default: {_show(f.default)}]",
                            rich_help_panel=f.metadata["group"], show_default=False)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=info,
                                        annotation=Optional[t]))

    def command(**kwargs):
        preset = kwargs.pop("config")
        opts = build_options(cls, kwargs, preset)
        if preset is not None:                     # no output may overwrite the preset
            check_training_paths(opts, preset)
        run(opts)

    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = help
    command.__name__ = name.replace("-", "_")
    app.command(name=name, help=help)(wrap(command))
