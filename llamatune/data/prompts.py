"""GRPO's data: HF TRL's prompt-only rows, one prompt per row, its other fields kept for
the rewards (rewards.py).

      {"prompt": "text", "answer": "42", ...}        BOS + the text, as completion rows' prompts
      {"prompt": [{"role", "content"}, ...], ...}    a conversation rendered with the chat
                                                     template and its generation prompt
A prompt and its completions share one row of --ctx + 1 tokens: a prompt longer than
--ctx + 1 - --max-completion-length is an error naming its line (skipped and counted with
--skip-bad-rows).
"""
from __future__ import annotations

import json

import numpy as np

from ..errors import LlamatuneError
from .datasets import RowEncoder, RowError, _messages, _text, concatenated, encoded_rows, rows_text
from .samples import Samples, _hash


class PromptSamples(Samples):
    """Samples that are prompts (mask 0: a prompt is never trained on); rows[i]: prompt i's
    row as read ("prompt" as given, and the other fields). The hash covers the rows too."""

    def __init__(self, tokens, begins, sizes, rows: list[dict]):
        super().__init__(tokens, begins, sizes, np.zeros(len(tokens), np.int8))
        self.rows = rows
        text = json.dumps(rows, sort_keys=True, ensure_ascii=False).encode("utf-8")
        self.hash = _hash(self.tokens, self.begins, self.sizes, np.frombuffer(text, np.uint8))

    def prompt_ids(self, i: int) -> list[int]:
        b = int(self.begins[i])
        return self.tokens[b:b + int(self.sizes[i])].tolist()


def encode_prompt(enc: RowEncoder, row) -> list[int]:
    """A prompt-only row's prompt tokens (text: BOS + text; messages: the chat template's
    rendering with the generation prompt)."""
    if isinstance(row, RowError):
        raise row
    if not isinstance(row, dict):
        raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
    if "prompt" not in row:
        raise RowError(f"--method grpo reads prompt-only rows: no 'prompt' field (found "
                       f"{', '.join(sorted(row)) or 'none'})")
    prompt = row["prompt"]
    if isinstance(prompt, list):
        return enc.template.prompt_tokens(_messages(prompt, "prompt"))
    tok = enc.tok
    ids = tok.encode(_text(prompt, "prompt"), add_special=True)
    if tok.add_eos and ids and ids[-1] == tok.eos_id:
        ids = ids[:-1]
    return ids


def load_prompts(path, tokenizer, opts, role: str = "training") -> PromptSamples:
    """The prompts of a training or validation file (module doc)."""
    text = rows_text(path, opts, role, "prompt-only rows (JSONL or a JSON array of objects with 'prompt')")
    enc = RowEncoder(tokenizer, opts, str(path))
    room = opts.ctx + 1 - getattr(opts, "max_completion_length", 0)

    def encode(row):
        ids = encode_prompt(enc, row)
        if not ids:
            raise RowError("the prompt gives no token")
        if len(ids) > room:
            raise RowError(f"the prompt has {len(ids)} tokens: with --max-completion-length "
                           f"{opts.max_completion_length} it needs --ctx {len(ids) + opts.max_completion_length - 1}"
                           f" (--ctx is {opts.ctx})")
        return np.asarray(ids, np.int32)
    encoded = list(encoded_rows(text, path, opts, encode))
    if not encoded:
        raise LlamatuneError(f"{path}: no prompt to train on")
    return PromptSamples(*concatenated([ids for _, ids in encoded]), [row for row, _ in encoded])
