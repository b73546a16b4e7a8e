"""Where user-facing text goes: results on stdout, notices and progress on stderr."""
from __future__ import annotations

from rich.console import Console

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def notice(message: str) -> None:
    """One informational line on stderr (never mixed into a command's results)."""
    err.print(f"[dim]llamatune:[/dim] {message}", markup=True)
