"""The one exception type users see.

Every problem a user can cause (a missing or corrupt file, a wrong shape, an
unsupported architecture, empty data, an option out of range) is raised as a
`LlamatuneError` whose message is one line naming the file or option and what is
wrong. The CLI prints that line and exits non-zero; anything else is a bug and
keeps its traceback.
"""


class LlamatuneError(Exception):
    """A user-facing error: one clear line, no traceback."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C in a training run; its message says where the run stands and how to go on."""
