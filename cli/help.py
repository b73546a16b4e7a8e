"""Help pages that stay readable in an 80-column terminal.

typer's rich help puts each flag, its `--no-` twin, the metavar and the help text in
four table columns and cuts whatever does not fit (`--include-sample-st…`). Every
command of an `App` (a Typer whose commands default to this class) uses
`GroupedHelpCommand` instead: click's plain layout, where a flag longer than the
first column gets its own line with the help text below it, so every flag is shown
whole at any width, and options stay grouped under their help panels ("Training
data", "Optimizer", ...) as in the rich layout. Help text is wrapped between words
only, never at a hyphen, so flags named inside it stay whole as well.
"""
from __future__ import annotations

import textwrap
from typing import Any

import typer
from typer.core import TyperCommand


class GroupedHelpCommand(TyperCommand):
    def format_help(self, ctx: Any, formatter: Any) -> None:
        super(TyperCommand, self).format_help(ctx, formatter)    # click's plain layout, not typer's rich one

    def format_options(self, ctx: Any, formatter: Any) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            default = "Arguments" if param.param_type_name == "argument" else "Options"
            sections.setdefault(getattr(param, "rich_help_panel", None) or default, []).append(record)
        for title, rows in sections.items():
            with formatter.section(title):
                write_rows(formatter, rows)


def write_rows(formatter: Any, rows: list[tuple[str, str]], col_max: int = 30, spacing: int = 2) -> None:
    """click's definition list, except that help text is never broken inside a word
    or at a hyphen, so flags named in it (--fill-with-next-samples) stay whole too."""
    indent = formatter.current_indent
    first = min(max(len(term) for term, _ in rows), col_max)
    width = max(formatter.width - indent - first - spacing, 20)
    for term, text in rows:
        lines = textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False) or [""]
        if len(term) <= first:
            formatter.write(" " * indent + term.ljust(first + spacing) + lines.pop(0) + "\n")
        else:
            formatter.write(" " * indent + term + "\n")
        for line in lines:
            formatter.write(" " * (indent + first + spacing) + line + "\n")


class App(typer.Typer):
    """A Typer whose commands all use GroupedHelpCommand unless told otherwise."""

    def command(self, *args: Any, cls: Any = None, **kwargs: Any):
        return super().command(*args, cls=cls or GroupedHelpCommand, **kwargs)
