"""`llamatune chat`: talk to a model (optionally with LoRA adapters) through its chat template.

Each turn renders the whole conversation with the template and its generation
prompt (as llama.cpp's llama-cli / HF `apply_chat_template(add_generation_prompt=True)`),
generates with the KV-cached loop of models/sampling.py, streams the answer and stops at
any end-of-generation token (EOS, <|im_end|>, <|eot_id|>, <end_of_turn>, ...), or
where the answer's text reaches the template's end of turn (`ChatTemplate.stop_text`:
a model whose vocabulary has no such control token writes it as ordinary tokens);
text that may be the start of it is held back until it is known not to be.
"""
from __future__ import annotations

from typing import Callable

from ..models.chat_template import ChatTemplate
from ..models.infer import Runner
from ..models.sampling import generate_ids
from ..options import ChatSampling


Sampling = ChatSampling        # n_predict, temp, top_k, top_p, seed, ctx (llamatune/options/)


class Chat:
    """A conversation with one model; `say` adds a user message and returns the answer."""

    def __init__(self, runner: Runner, template: ChatTemplate, system: str | None = None,
                 sampling: Sampling | None = None):
        self.runner, self.template, self.sampling = runner, template, sampling or Sampling()
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        tok = runner.model.tokenizer
        self._stop = set(tok.eog_ids)
        self._stop_text = template.stop_text()

    def say(self, text: str, write: Callable[[str], None] = lambda s: None) -> str:
        self.messages.append({"role": "user", "content": text})
        s = self.sampling
        ids = self.template.prompt_tokens(self.messages)
        answer = stream_ids(self.runner.model.tokenizer,
                            generate_ids(self.runner, ids, s.n_predict, s.temp, s.top_k, s.top_p,
                                         s.seed + len(self.messages), s.ctx, self._stop), write,
                            self._stop_text)
        self.messages.append({"role": "assistant", "content": answer})
        return answer

    def reset(self) -> None:
        """Forget the conversation; the system message stays."""
        self.messages = [m for m in self.messages if m["role"] == "system"]


def _held(text: str, stop: str | None) -> int:
    """Characters at the end of text that begin `stop` (0 without one)."""
    if stop:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                return k
    return 0


def complete_text(tok, ids: list[int]) -> str:
    """The decoded text of `ids` without the replacement characters that stand for bytes
    that are not (yet) a character: an incomplete UTF-8 sequence at the end (the rest of a
    character split across tokens, still to come, or never: a stream that stops there),
    and sequences a sampled token broke off (byte tokens of a small model), which can
    never complete. A U+FFFD the model wrote as such (its bytes EF BF BD) stays."""
    text = tok.decode(ids)
    if "\ufffd" not in text or not ids:
        return text
    raw = b"".join(tok.token_to_bytes(i) for i in ids)
    if b"\xef\xbf\xbd" not in raw:
        return text.replace("\ufffd", "")
    return text[:-1] if text.endswith("\ufffd") and _incomplete(raw[-4:]) else text


def _incomplete(tail: bytes) -> bool:
    """True when `tail` ends inside a UTF-8 sequence: its last lead byte announces more
    bytes than follow it."""
    for back in range(1, min(len(tail), 4) + 1):
        b = tail[-back]
        if b & 0xC0 != 0x80:                       # not a continuation byte: a lead (or ASCII) byte
            need = 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
            return back < need
    return False


def stream_ids(tok, token_ids, write: Callable[[str], None], stop: str | None = None) -> str:
    """Write the decoded text of a token stream as it grows and return it. The bytes of a
    character split across tokens are held back until it is whole (and dropped if the
    stream ends first or they can never complete: complete_text), so no replacement
    character is ever written in its place; with
    `stop`, the text ends before its first occurrence of `stop` (the stream is left
    there), and an end that may begin it is not written yet."""
    out: list[int] = []
    shown = 0
    for t in token_ids:
        out.append(t)
        text = complete_text(tok, out)
        if stop and stop in text:
            break
        upto = len(text) - _held(text, stop)
        if upto > shown:
            write(text[shown:upto])
            shown = upto
    text = complete_text(tok, out)
    if stop and stop in text:
        text = text[:text.index(stop)]
    if len(text) > shown:
        write(text[shown:])
    return text


def run_chat(runner: Runner, template_override: str | None, prompt: str | None, system: str | None,
             sampling: Sampling, started: Callable[[], None] = lambda: None) -> None:
    """One turn (`prompt`) or a read-answer loop on stdin until EOF or /exit; `started()`
    once the template is found (the start-up line)."""
    import sys

    from ..errors import LlamatuneError
    from ..models.chat_template import BUILTIN, load_template
    tok = runner.model.tokenizer
    template = load_template(tok, template_override, runner.model.path.name)
    if template is None:
        raise LlamatuneError(f"{runner.model.path.name}: the model has no chat template: pass --chat-template "
                             f"with a file or one of {', '.join(BUILTIN)}")
    chat = Chat(runner, template, system, sampling)
    started()

    def write(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    if prompt is not None:
        chat.say(prompt, write)
        write("\n")
        return
    from ..console import err
    err.print(f"chatting with {runner.model.path.name}: type a message and Enter; /help lists the commands, "
              "/exit or Ctrl-D quits", markup=False, highlight=False)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            write("> ")
        line = sys.stdin.readline()
        if not line:
            return
        command = line.strip()
        if command in COMMANDS or (command.startswith("/") and " " not in command):
            if chat_command(chat, command, err):
                return
        elif command:
            chat.say(line.rstrip("\n"), write)
            write("\n")


COMMANDS = {"/help": "this list", "/reset": "forget the conversation (the system message stays)",
            "/exit": "quit (also /quit or Ctrl-D)", "/quit": "quit"}


def chat_command(chat: Chat, command: str, err) -> bool:
    """Run one of COMMANDS (never sent to the model); True when the loop should end."""
    if command in ("/exit", "/quit"):
        return True
    if command == "/reset":
        chat.reset()
        err.print("conversation cleared", markup=False, highlight=False)
    elif command == "/help":
        err.print("\n".join(f"  {name:<7} {what}" for name, what in COMMANDS.items() if name != "/quit"),
                  markup=False, highlight=False)
    else:
        err.print(f"unknown command {command}: /help lists the commands", markup=False, highlight=False)
    return False
