"""The exceptions users see.

Every problem a user can cause (a missing or corrupt file, a wrong shape, an
unsupported architecture, empty data, an option out of range) is raised as a
`LlamatuneError` whose message is one line naming the file or option and what is
wrong. The CLI prints that line and exits non-zero; anything else is a bug and
keeps its traceback. A training run stopped by Ctrl-C or SIGTERM raises
`Interrupted`, whose line says how to go on.
"""


class LlamatuneError(Exception):
    """A user-facing error: one clear line, no traceback."""


class UsageError(LlamatuneError):
    """A command line the command cannot run: an unknown or missing option, a value out of
    range, a preset that does not fit. Exit code 2, as the parser's own errors."""


def listed(problems: list[str], shown: int = 3) -> str:
    """The first `shown` problems and how many more: a file made for another model has
    a problem per tensor, and one readable line beats hundreds of clauses."""
    more = len(problems) - shown
    return "; ".join(problems[:shown]) + (f"; and {more} more" if more > 0 else "")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM in a training run; its message says where the run
    stands and how to go on. `exit_code`: 130 or 143, what a shell reports for a
    process those signals end."""

    def __init__(self, line: str = "", exit_code: int = 130):
        super().__init__(line)
        self.exit_code = exit_code
