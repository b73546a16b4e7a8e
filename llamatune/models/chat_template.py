"""Chat templates: conversations rendered to token ids and loss-target masks.

Rendering mirrors HF transformers' `apply_chat_template`
(transformers/utils/chat_template_utils.py `_compile_jinja_template`,
`render_jinja_template`): the template's Jinja source from GGUF metadata
(`tokenizer.chat_template`) runs in jinja2's ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks and the loopcontrols extension; `raise_exception`,
`strftime_now`, `dict`, `namespace` and HF's `tojson` filter (no HTML escaping,
ensure_ascii=False) are defined; `{% generation %}` blocks render their body;
`bos_token`, `eos_token`, `unk_token`, `pad_token` are the vocabulary's texts.

Token ids are those of tokenizing the rendered text in one piece with special-token
parsing (HF's `apply_chat_template(tokenize=True)`), except that message content is
never parsed for special tokens: a message that itself contains special-token text
(say "<|im_end|>") keeps it as plain text here, where HF would emit the special id.

Loss targets are derived from the template itself: for assistant message k, the
text between the rendering of messages[:k] with the generation prompt and the
rendering of messages[:k+1] (each compared with the whole conversation) is that
turn; its targets run from the message content through the first control token
after it (the end-of-turn token: <|im_end|>, <|eot_id|>, <end_of_turn>, ...).
A token overlapping the answer counts as part of it (as HF's assistant masks).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from ..errors import LlamatuneError

# Built-in templates for base models without one: the official templates of each family.
BUILTIN = {
    # ChatML (Qwen2 / Qwen2.5 without the default system prompt)
    "chatml": (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    # Meta-Llama-3-8B-Instruct
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
        "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
        "{{ content }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    # google/gemma-2-2b-it
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
        "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"),
    # microsoft/Phi-3-mini-4k-instruct
    "phi3": (
        "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
        "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
        "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}"
        "{% endif %}"),
    # mistralai/Mistral-7B-Instruct-v0.1 (also Llama-2-chat's [INST] layout, no system prompt)
    "mistral": (
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}"
        "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"),
}


def _environment():
    """HF's sandboxed Jinja environment (chat_template_utils._cached_compile_jinja_template)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (HF's AssistantTracker tag)."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """Namespaces reject underscore-prefixed attributes (as HF's TemplateNamespace)."""
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = dict
    env.globals["namespace"] = Namespace
    return env


@dataclass
class Encoded:
    tokens: np.ndarray   # (n,) int32 token ids of the rendered conversation
    mask: np.ndarray     # (n,) int8: 1 where the token is a loss target
    text: str            # the rendered text


class ChatTemplate:
    """One compiled template bound to a tokenizer."""

    def __init__(self, source: str, tokenizer, name: str = "chat template"):
        import jinja2
        self.source, self.tokenizer, self.name = source, tokenizer, name
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise LlamatuneError(f"{name}: not a valid Jinja template ({e})") from None
        tok = tokenizer
        special = {"bos_token": tok.bos_id, "eos_token": tok.eos_id, "unk_token": getattr(tok, "unk_id", None),
                   "pad_token": getattr(tok, "pad_id", None)}
        self._specials = {k: tok.token_text(i) for k, i in special.items() if i is not None}

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        import jinja2
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self._specials)
        except jinja2.TemplateError as e:
            raise LlamatuneError(f"{self.name}: {e}") from None
        except Exception as e:  # noqa: BLE001 - a template's own runtime error is a data problem
            raise LlamatuneError(f"{self.name}: rendering failed ({type(e).__name__}: {e})") from None

    def stop_text(self) -> str | None:
        """The text that ends an assistant turn when a model writes it as ordinary
        tokens (a base model finetuned on a template whose markers are not control
        tokens of its vocabulary): the first line of what the template puts between
        an answer and the next user message, whitespace stripped (ChatML
        "<|im_end|>", Phi-3 "<|end|>", an Alpaca-style "### Instruction:"). None
        where that is only whitespace or a two-turn conversation does not render."""
        answer, question = "LLAMATUNE-ANSWER", "LLAMATUNE-QUESTION"
        try:
            text = self.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": answer},
                                {"role": "user", "content": question}])
        except LlamatuneError:
            return None
        i, j = text.find(answer), text.find(question)
        if i < 0 or j < i:
            return None
        between = text[i + len(answer):j].strip()
        return between.splitlines()[0].strip() if between else None

    def prompt_tokens(self, messages: list[dict]) -> list[int]:
        """Ids of the conversation followed by the generation prompt (for `chat`)."""
        text = self.render(messages, add_generation_prompt=True)
        return self.tokenizer.encode_parts(_parts(text, messages, self.tokenizer))

    def encode(self, messages: list[dict], trained: set[int] | None = None,
               train_on_prompt: bool = False) -> Encoded:
        """Ids and target mask of a conversation. `trained`: indices of the assistant
        messages whose turns are targets (default: every assistant message)."""
        tok = self.tokenizer
        text = self.render(messages)
        ids = tok.encode_parts(_parts(text, messages, tok))
        mask = np.zeros(len(ids), np.int8)
        if train_on_prompt:
            mask[1:] = 1
            return Encoded(np.asarray(ids, np.int32), mask, text)
        starts = np.asarray(tok.token_offsets(ids, text), np.int64)
        ends = np.maximum(np.append(starts[1:], len(text.encode("utf-8"))), starts + 1)  # SPM "▁": 1 wide
        raw = text.encode("utf-8")
        for k, m in enumerate(messages):
            if m["role"] != "assistant" or (trained is not None and k not in trained):
                continue
            a = _common_prefix(raw, self.render(messages[:k], add_generation_prompt=True).encode("utf-8"))
            b = _common_prefix(raw, self.render(messages[:k + 1]).encode("utf-8"))
            content = str(m["content"]).encode("utf-8")
            at = raw.find(content, a, b) if content else -1
            if at < 0 and content.strip():       # templates may trim the content
                content = content.strip()
                at = raw.find(content, a, b)
            a = at if at >= 0 else a
            for j in np.flatnonzero((ends > a) & (starts < b)):       # tokens overlapping the turn
                mask[j] = 1
                if tok.is_control(ids[j]) and starts[j] >= a + len(content):   # its end-of-turn token
                    break
        mask[0] = 0                       # the first token is predicted from nothing
        return Encoded(np.asarray(ids, np.int32), mask, text)


def _common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n                      # binary search on the first difference
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _parts(text: str, messages: list[dict], tok) -> list[tuple[str, bool]]:
    """Split rendered text into (text, parse_special) parts: message contents that hold
    special-token text are located in order and protected from special parsing."""
    parts, at = [], 0
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str) or not content or not tok.has_special_text(content):
            continue
        i = text.find(content, at)
        if i < 0:
            continue
        parts += [(text[at:i], True), (content, False)]
        at = i + len(content)
    parts.append((text[at:], True))
    return parts


def load_template(tokenizer, override: str | None, source: str = "the model") -> ChatTemplate | None:
    """The template to use: --chat-template (a built-in name or a file), else the model's
    `tokenizer.chat_template` (kept by Tokenizer.from_gguf), else None."""
    if override:
        if override in BUILTIN:
            return ChatTemplate(BUILTIN[override], tokenizer, f"built-in chat template {override!r}")
        path = Path(override)
        if not path.is_file():
            raise LlamatuneError(f"--chat-template {override!r}: neither a file nor a built-in name "
                                 f"({', '.join(BUILTIN)})")
        try:
            return ChatTemplate(path.read_text(encoding="utf-8"), tokenizer, str(path))
        except UnicodeDecodeError:
            raise LlamatuneError(f"{path}: chat template is not UTF-8 text") from None
    source_text = getattr(tokenizer, "chat_template", None)
    if source_text:
        return ChatTemplate(source_text, tokenizer, f"{source}: tokenizer.chat_template")
    return None
