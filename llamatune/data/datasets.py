"""Training and validation data files: format detection, rows, templates, loss masks.

`load_dataset` reads --train-data / --val-data and returns `samples.Samples`:
  * raw text: `samples.load_samples`, exactly as before (windows over the text);
  * JSONL, or a .json array, of rows, one sample per row:
      {"messages": [{"role", "content"}, ...]}            OpenAI / HF chat
      {"conversations": [{"from", "value"}, ...]}          ShareGPT (human/gpt/system)
      {"prompt", "completion"}     strings: plain text; lists of messages: a conversation
      {"instruction", "input"?, "output", "system"?}       Alpaca, as a user/assistant turn
      {"text"}                                            plain text, every token trained
Preference pairs (--method dpo / orpo, TRL's preference rows) become two samples each,
chosen then rejected, sharing the prompt's tokens (`load_pairs`):
      {"prompt", "chosen", "rejected"}   strings: BOS + prompt + answer + EOS, as completion rows;
                                         lists of messages: conversations, answers trained
                                         (an optional "system" string leads the prompt);
                                         no prompt: lists share their common first messages,
                                         strings are trained whole
Conversations are rendered with the chat template (chat_template.py); the mask marks
assistant answers (or, for prompt/completion, the completion and EOS). A sample's
first token is never a target; a sample of n tokens fills n - 1 positions, so it
holds at most --ctx + 1 tokens. Mirrors the dataset handling of HF TRL's SFTTrainer
(conversational and prompt-completion rows, completion-only loss) on llama.cpp ids.
"""
from __future__ import annotations

import json

import numpy as np
from rich.markup import escape as _esc

from ..console import notice
from ..errors import LlamatuneError
from .samples import Samples, load_samples, read_text

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
                  "system": "system", "tool": "tool", "function": "tool", "observation": "tool"}
CHAT_KINDS, COMPLETION_KINDS = ("messages", "conversations"), ("prompt", "instruction", "text")


class RowError(Exception):
    """A problem with one row; becomes `FILE:LINE: problem` (or is counted with --skip-bad-rows)."""


def detect_format(text: str, requested: str, path=None) -> str:
    """'text' or 'rows'. auto: rows when the file is named .jsonl or .json (a row that does
    not parse is then an error naming its line, not a reason to train on the JSON as text),
    or when it is a JSON array or its first line a JSON object."""
    if requested == "text":
        return "text"
    if requested != "auto" or str(path).lower().endswith((".jsonl", ".json")):
        return "rows"
    head = text.lstrip()
    if head.startswith("["):
        try:
            return "rows" if isinstance(json.loads(text), list) else "text"
        except json.JSONDecodeError:
            return "text"
    if head.startswith("{"):
        try:
            return "rows" if isinstance(json.loads(head.split("\n", 1)[0]), dict) else "text"
        except json.JSONDecodeError:
            return "text"
    return "text"


def read_rows(text: str, path) -> list[tuple[int, object]]:
    """(line number, parsed value) of each row of a JSONL file or each element of a JSON array."""
    dec = json.JSONDecoder()
    line_of = lambda i: text.count("\n", 0, i) + 1  # noqa: E731
    head = text.lstrip()
    if head.startswith("["):
        i, rows = text.index("[") + 1, []
        while True:
            while i < len(text) and text[i] in " \t\r\n,":
                i += 1
            if i >= len(text) or text[i] == "]":
                break
            try:
                value, end = dec.raw_decode(text, i)
            except json.JSONDecodeError as e:
                raise LlamatuneError(f"{path}:{line_of(e.pos)}: not valid JSON ({e.msg})") from None
            rows.append((line_of(i), value))
            i = end
        return rows
    rows = []
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                rows.append((n, RowError(f"not valid JSON ({e.msg} at column {e.colno})")))
    return rows


def _text(value, what: str) -> str:
    if not isinstance(value, str):
        raise RowError(f"{what} must be a string, got {type(value).__name__}")
    return value


def _messages(value, what: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RowError(f"'{what}' must be a non-empty list of messages")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise RowError(f"{what}[{k}] must be an object with 'role' and 'content'")
        out.append({**m, "role": _text(m["role"], f"{what}[{k}].role"),
                    "content": _text(m["content"], f"{what}[{k}].content")})
    return out


def _sharegpt(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RowError("'conversations' must be a non-empty list of turns")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or "from" not in m or "value" not in m:
            raise RowError(f"conversations[{k}] must be an object with 'from' and 'value'")
        role = SHAREGPT_ROLES.get(str(m["from"]).lower())
        if role is None:
            raise RowError(f"conversations[{k}].from {m['from']!r} is not one of {', '.join(SHAREGPT_ROLES)}")
        out.append({"role": role, "content": _text(m["value"], f"conversations[{k}].value")})
    return out


def row_kind(row: dict, data_format: str) -> str:
    if "chosen" in row or "rejected" in row:
        raise RowError("a preference pair (chosen/rejected): train on pairs with --method dpo or orpo")
    kind = next((k for k in (*CHAT_KINDS, *COMPLETION_KINDS) if k in row), None)
    if kind is None:
        raise RowError(f"no known fields (expected messages, conversations, prompt/completion, "
                       f"instruction/output or text); found {', '.join(sorted(row)) or 'none'}")
    if data_format == "chat" and kind not in CHAT_KINDS:
        raise RowError(f"--data-format chat expects 'messages' or 'conversations', found '{kind}'")
    if data_format == "completion" and kind not in COMPLETION_KINDS:
        raise RowError(f"--data-format completion expects prompt/completion, instruction/output or text, "
                       f"found '{kind}'")
    return kind


class RowEncoder:
    """Turns one parsed row into (tokens, mask); the template is loaded on first need."""

    def __init__(self, tokenizer, opts, source: str):
        self.tok, self.opts, self.source = tokenizer, opts, source
        self._template = None

    @property
    def template(self):
        if self._template is None:
            from ..models.chat_template import BUILTIN, load_template
            self._template = load_template(self.tok, self.opts.chat_template or None)
            if self._template is None:
                raise LlamatuneError(f"{self.source}: conversations need a chat template and the model has none: "
                                     f"pass --chat-template with a file or one of {', '.join(BUILTIN)}")
        return self._template

    def encode(self, row) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(row, RowError):
            raise row
        if not isinstance(row, dict):
            raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
        kind = row_kind(row, self.opts.data_format)
        if kind == "messages":
            return self._chat(_messages(row["messages"], "messages"))
        if kind == "conversations":
            return self._chat(_sharegpt(row["conversations"]))
        if kind == "instruction":
            if "output" not in row:
                raise RowError("an instruction row needs 'output'")
            user = _text(row["instruction"], "instruction")
            extra = _text(row.get("input") or "", "input")
            msgs = [{"role": "system", "content": _text(row["system"], "system")}] if row.get("system") else []
            msgs += [{"role": "user", "content": user + ("\n\n" + extra if extra else "")},
                     {"role": "assistant", "content": _text(row["output"], "output")}]
            return self._chat(msgs)
        if kind == "text":
            return self._plain("", _text(row["text"], "text"), everything=True)
        if "completion" not in row:
            raise RowError("a prompt row needs 'completion'")
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, list) or isinstance(completion, list):
            head = _messages(prompt, "prompt") if isinstance(prompt, list) else []
            if isinstance(prompt, str):
                raise RowError("prompt and completion must both be strings or both lists of messages")
            tail = _messages(completion, "completion")
            return self._chat(head + tail, trained=set(range(len(head), len(head) + len(tail))))
        return self._plain(_text(prompt, "prompt"), _text(completion, "completion"))

    def encode_pair(self, row) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """(tokens, mask) of a preference row's chosen and of its rejected answer, each
        after the same prompt tokens (TRL's standard and conversational preference rows)."""
        if isinstance(row, RowError):
            raise row
        if not isinstance(row, dict):
            raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
        for key in ("chosen", "rejected"):
            if key not in row:
                raise RowError(f"a preference row needs '{key}'"
                               + ("" if "chosen" in row or "rejected" in row else
                                  f" (found {', '.join(sorted(row)) or 'no fields'})"))
            if row[key] in ("", []):
                raise RowError(f"'{key}' is empty")
        chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
        if chosen == rejected:
            raise RowError("chosen and rejected are the same")
        conversational = isinstance(chosen, list) or isinstance(rejected, list) or isinstance(prompt, list)
        if not conversational:
            if row.get("system"):
                raise RowError("'system' goes with conversational rows (lists of messages)")
            head = "" if prompt is None else _text(prompt, "prompt")
            pair = (self._plain(head, _text(chosen, "chosen")), self._plain(head, _text(rejected, "rejected")))
        else:
            if not all(isinstance(v, list) for v in (chosen, rejected) + (() if prompt is None else (prompt,))):
                raise RowError("prompt, chosen and rejected must all be strings or all lists of messages")
            c, r = _messages(chosen, "chosen"), _messages(rejected, "rejected")
            if prompt is None:                         # implicit prompt: the messages both begin with
                k = 0
                while k < min(len(c), len(r)) - 1 and c[k] == r[k]:
                    k += 1
                head, c, r = c[:k], c[k:], r[k:]
            else:
                head = _messages(prompt, "prompt")
            if row.get("system"):
                head = [{"role": "system", "content": _text(row["system"], "system")}] + head
            pair = tuple(self._chat(head + tail, trained=set(range(len(head), len(head) + len(tail))))
                         for tail in (c, r))
        (ct, cm), (rt, rm) = pair
        if len(ct) == len(rt) and np.array_equal(ct, rt):
            raise RowError("chosen and rejected give the same tokens")
        return pair

    def _chat(self, messages: list[dict], trained: set[int] | None = None):
        train_all = self.opts.train_on_prompt
        if not train_all and not any(m["role"] == "assistant" for k, m in enumerate(messages)
                                     if trained is None or k in trained):
            raise RowError("no assistant message to train on (or use --train-on-prompt)")
        e = self.template.encode(messages, trained, train_all)
        return e.tokens, e.mask

    def _plain(self, prompt: str, completion: str, everything: bool = False):
        """Plain text: prompt (with the model's BOS) + completion + EOS; targets: the completion
        and EOS (everything with --train-on-prompt or for text rows)."""
        tok = self.tok
        head = tok.encode(prompt, add_special=True)
        if tok.add_eos and head and head[-1] == tok.eos_id:
            head = head[:-1]
        tail = tok.encode(completion, add_special=False) + [tok.eos_id]
        tokens = np.asarray(head + tail, np.int32)
        mask = np.zeros(len(tokens), np.int8)
        mask[0 if everything or self.opts.train_on_prompt else len(head):] = 1
        mask[0] = 0
        return tokens, mask


def load_dataset(path, tokenizer, opts, role: str = "training") -> Samples:
    """Samples of a training or validation file, in any supported format (see the module doc)."""
    if path is None:
        raise LlamatuneError(f"--{'train' if role == 'training' else 'val'}-data is required")
    text = read_text(path, f"{role} data")
    if detect_format(text, opts.data_format, path) == "text":
        return load_samples(text, tokenizer, opts, str(path))
    enc = RowEncoder(tokenizer, opts, str(path))

    def encode(row):
        tokens, mask = enc.encode(row)
        if len(tokens) < 2:
            raise RowError(f"yields {len(tokens)} token; at least 2 are needed")
        return tokens, mask
    encoded = [out for _, out in encoded_rows(text, path, opts, encode)]
    return _fit([t for t, _ in encoded], [m for _, m in encoded], opts, str(path))


def encoded_rows(text: str, path, opts, encode):
    """(row, encode(row)) for each row of a rows file. A row whose encode raises RowError
    stops the run with `FILE:LINE: problem`, or with --skip-bad-rows is skipped and
    counted: one notice once the rows are read."""
    bad, first_bad = 0, ""
    for line, row in read_rows(text, path):
        try:
            out = encode(row)
        except RowError as e:
            if not opts.skip_bad_rows:
                raise LlamatuneError(f"{path}:{line}: {e}") from None
            bad += 1
            first_bad = first_bad or f"line {line}: {e}"
            continue
        yield row, out
    if bad:
        notice(_esc(f"{path}: skipped {bad} malformed row(s) (first: {first_bad})"))


def concatenated(pieces: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pieces end to end, with each one's start and length (Samples' tokens, begins, sizes)."""
    sizes = np.array([len(p) for p in pieces], np.int64)
    return np.concatenate(pieces), np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes


def rows_text(path, opts, role: str, rows: str) -> str:
    """The text of a training or validation file (`role`) that must hold `rows` (what the
    method reads, for the error), refused when missing or raw text."""
    if path is None:
        raise LlamatuneError(f"--{'train' if role == 'training' else 'val'}-data is required")
    text = read_text(path, f"{role} data")
    if detect_format(text, opts.data_format, path) == "text" or opts.data_format == "text":
        raise LlamatuneError(f"{path}: --method {opts.method} trains on {rows}, not on raw text")
    return text


def load_pairs(path, tokenizer, opts, role: str = "training") -> Samples:
    """Preference pairs of a training or validation file: sample 2i is pair i's chosen
    answer, 2i + 1 its rejected one (both with the prompt; the mask marks the answer and
    EOS). Bad rows: `FILE:LINE: problem`, or skipped and counted with --skip-bad-rows."""
    text = rows_text(path, opts, role, "preference rows (JSONL or a JSON array of objects with prompt, chosen and "
                     "rejected)")
    enc = RowEncoder(tokenizer, opts, str(path))
    return _fit_pairs([pair for _, pair in encoded_rows(text, path, opts, enc.encode_pair)], opts, str(path))


def _fit_pairs(pairs: list, opts, source: str) -> Samples:
    """Pairs whose answers are longer than ctx + 1 tokens are truncated (with --drop-long,
    dropped) together; a pair left without a target in either answer, or with two equal
    answers, is dropped."""
    limit = opts.ctx + 1
    long = sum(1 for pair in pairs if any(len(t) > limit for t, _ in pair))
    if long:
        action = "dropped (--drop-long)" if opts.drop_long else "truncated to --ctx (use --drop-long to drop them)"
        notice(_esc(f"{source}: {long} of {len(pairs)} pair(s) longer than --ctx {opts.ctx}: {action}"))
    pieces, masks, empty = [], [], 0
    for (ct, cm), (rt, rm) in pairs:
        if opts.drop_long and max(len(ct), len(rt)) > limit:
            continue
        ct, cm, rt, rm = ct[:limit], cm[:limit], rt[:limit], rm[:limit]
        if not (cm.any() and rm.any()) or (len(ct) == len(rt) and np.array_equal(ct, rt)):
            empty += 1
            continue
        pieces += [ct, rt]
        masks += [cm, rm]
    if empty:
        notice(_esc(f"{source}: dropped {empty} pair(s) left without an answer, or with equal answers, "
                    f"within --ctx {opts.ctx}"))
    if not pieces:
        raise LlamatuneError(f"{source}: no preference pair with answers to score")
    return Samples(*concatenated(pieces), np.concatenate(masks))


def _fit(pieces: list[np.ndarray], masks: list[np.ndarray], opts, source: str) -> Samples:
    """Truncate (or with --drop-long drop) samples longer than ctx + 1 tokens; drop samples
    left without targets; concatenate."""
    limit = opts.ctx + 1
    long = [i for i, p in enumerate(pieces) if len(p) > limit]
    if long:
        action = "dropped (--drop-long)" if opts.drop_long else "truncated to --ctx (use --drop-long to drop them)"
        notice(_esc(f"{source}: {len(long)} of {len(pieces)} sample(s) longer than --ctx {opts.ctx}: {action}"))
    keep_t, keep_m, empty = [], [], 0
    for p, m in zip(pieces, masks):
        if len(p) > limit:
            if opts.drop_long:
                continue
            p, m = p[:limit], m[:limit]
        if not m.any():
            empty += 1
            continue
        keep_t.append(p)
        keep_m.append(m)
    if empty:
        notice(_esc(f"{source}: dropped {empty} sample(s) with no loss target within --ctx {opts.ctx}"))
    if not keep_t:
        raise LlamatuneError(f"{source}: no sample with a loss target")
    return Samples(*concatenated(keep_t), np.concatenate(keep_m))


def preview(samples: Samples, bos_id: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first n samples as the trainer sees them: (tokens, targets) with targets[i] = 1
    when token i is a loss target predicted from the tokens before it. Raw-text samples
    are preceded by BOS, as the batcher feeds them."""
    out = []
    for i in range(min(n, len(samples))):
        b, s = int(samples.begins[i]), int(samples.sizes[i])
        tokens = samples.tokens[b:b + s]
        if samples.mask is None:
            out.append((np.concatenate([[bos_id], tokens]).astype(np.int64),
                        np.concatenate([[0], np.ones(s, np.int8)]).astype(np.int8)))
        else:
            out.append((tokens.astype(np.int64), samples.mask[b:b + s].astype(np.int8)))
    return out
