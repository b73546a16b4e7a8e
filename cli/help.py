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

import sys
import textwrap
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

try:                                        # typer 0.2x carries its own copy of click
    from typer import _click as click
except ImportError:                         # pragma: no cover - older typer on click
    import click

USAGE_EXIT = 2              # a command line the command cannot run: the parser's errors and ours


class GroupedHelpCommand(TyperCommand):
    def format_help(self, ctx: Any, formatter: Any) -> None:
        super(TyperCommand, self).format_help(ctx, formatter)    # click's plain layout, not typer's rich one

    def format_options(self, ctx: Any, formatter: Any) -> None:
        """Options under their groups; the required ones (marked [required]) first, and the
        groups that hold them before the others."""
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            default = "Arguments" if param.param_type_name == "argument" else "Options"
            sections.setdefault(getattr(param, "rich_help_panel", None) or default, []).append(record)
        needed = lambda row: "[required]" in row[1] or "; required]" in row[1]      # noqa: E731
        order = sorted(sections.items(), key=lambda kv: not any(map(needed, kv[1])))
        for title, rows in order:
            with formatter.section(title):
                write_rows(formatter, sorted(rows, key=lambda row: not needed(row)))


def write_rows(formatter: Any, rows: list[tuple[str, str]], col_max: int = 30, spacing: int = 2) -> None:
    """click's definition list, except that help text is never broken inside a word
    or at a hyphen, so flags named in it (--fill-with-next-samples) stay whole too."""
    indent = formatter.current_indent
    first = min(max(len(term) for term, _ in rows), col_max)
    width = max(formatter.width - indent - first - spacing, 20)
    for term, text in rows:
        lines = textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False) or [""]
        if len(term) <= first:
            formatter.write(" " * indent + term.ljust(first + spacing) + lines.pop(0) + "\n")
        else:
            formatter.write(" " * indent + term + "\n")
        for line in lines:
            formatter.write(" " * (indent + first + spacing) + line + "\n")


def usage_line(e: Any) -> str:
    """A parser error (a click exception) in the project's one style: `error: ...` and
    where the options (or, at the top, the commands) are listed."""
    ctx = getattr(e, "ctx", None)
    what = "commands" if isinstance(getattr(ctx, "command", None), TyperGroup) else "options"
    hint = f" ({ctx.command_path} --help lists the {what})" if ctx is not None else ""
    return f"error: {e.format_message().rstrip('.')}{hint}"


class Group(TyperGroup):
    """The top command: click's plain help, and the parser's errors as one `error:` line
    with exit code 2, as the commands' own usage errors (errors.UsageError)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        super(TyperGroup, self).format_help(ctx, formatter)      # click's plain layout, as the commands

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        """Each command with its whole one-line help, wrapped (click cuts it at about 45 characters)."""
        rows = [(name, cmd.help or "") for name, cmd in self.commands.items() if not cmd.hidden]
        with formatter.section("Commands"):
            write_rows(formatter, rows)

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":        # `llamatune` alone: the help, as -h prints it
                print(e.format_message())
                sys.exit(0)
            print(usage_line(e), file=sys.stderr)
            sys.exit(USAGE_EXIT if isinstance(e, click.exceptions.UsageError) else e.exit_code)
        except click.exceptions.Abort:
            print("aborted", file=sys.stderr)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


class App(typer.Typer):
    """A Typer whose commands all use GroupedHelpCommand unless told otherwise."""

    def command(self, *args: Any, cls: Any = None, **kwargs: Any):
        return super().command(*args, cls=cls or GroupedHelpCommand, **kwargs)
