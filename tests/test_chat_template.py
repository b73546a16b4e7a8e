"""Chat templates against HF transformers: rendered text, token ids and assistant-target masks
(tests/fixtures/chat_golden.json, made once by tests/fixtures/make_chat_golden.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import VOCAB, need
from numpy.testing import assert_array_equal

from llamatune.models.chat_template import BUILTIN, ChatTemplate, load_template
from llamatune.errors import LlamatuneError
from llamatune.formats.gguf_io import GGUFFile
from llamatune.models.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = json.loads((FIXTURES / "chat_golden.json").read_text(encoding="utf-8"))


_tokenizers: dict[str, Tokenizer] = {}


def tokenizer(name: str, qwen_vocab: Path) -> Tokenizer:
    vocab = GOLDEN[name]["vocab"]
    if vocab not in _tokenizers:
        path = qwen_vocab if vocab == "qwen2.5-vocab.gguf" else need(VOCAB / vocab)
        _tokenizers[vocab] = Tokenizer.from_gguf(GGUFFile(path))
    return _tokenizers[vocab]


CASES = [(name, k) for name, g in GOLDEN.items() if g["vocab"] for k in range(len(g["conversations"]))]


@pytest.mark.parametrize("name,k", CASES, ids=[f"{n}-{GOLDEN[n]['conversations'][k]['name']}" for n, k in CASES])
def test_ids_and_masks_match_hf(name, k, qwen_vocab):
    g = GOLDEN[name]
    tok = tokenizer(name, qwen_vocab)
    assert (tok.token_text(tok.bos_id), tok.token_text(tok.eos_id)) == (g["bos_token"], g["eos_token"])
    conv = g["conversations"][k]
    enc = ChatTemplate(g["template"], tok, name).encode(conv["messages"])
    assert enc.text == conv["text"]
    assert_array_equal(enc.tokens, conv["ids"])
    assert_array_equal(enc.mask, conv["mask"])


def test_model_template_is_used(qwen_vocab):
    tok = tokenizer("qwen", qwen_vocab)
    assert load_template(tok, None).source == GOLDEN["qwen"]["template"]
    assert load_template(tok, "llama3").source == BUILTIN["llama3"]


@pytest.mark.parametrize("k", range(len(GOLDEN["gemma"]["conversations"])))
def test_gemma_text_matches_hf(k):
    class Tok:                                   # only the special-token texts matter for rendering
        bos_id, eos_id = 0, 1

        def token_text(self, i):
            return ["<bos>", "<eos>"][i]
    conv = GOLDEN["gemma"]["conversations"][k]
    assert ChatTemplate(BUILTIN["gemma"], Tok()).render(conv["messages"]) == conv["text"]


class _TextTok:                                  # rendering needs only the special-token texts
    bos_id, eos_id = 0, 1

    def token_text(self, i):
        return ["<s>", "</s>"][i]


@pytest.mark.parametrize("name,want", [("chatml", "<|im_end|>"), ("phi3", "<|end|>"),
                                       ("gemma", "<end_of_turn>"),
                                       ("llama3", "<|eot_id|><|start_header_id|>user<|end_header_id|>"),
                                       ("mistral", "</s>[INST]")])
def test_stop_text_is_the_first_line_between_an_answer_and_the_next_question(name, want):
    assert ChatTemplate(BUILTIN[name], _TextTok()).stop_text() == want


def test_stop_text_of_plain_text_templates():
    alpaca = ("{% for m in messages %}{% if m['role'] == 'user' %}### Instruction:\n{{ m['content'] }}\n\n"
              "{% else %}### Response:\n{{ m['content'] }}\n\n{% endif %}{% endfor %}")
    assert ChatTemplate(alpaca, _TextTok()).stop_text() == "### Instruction:"
    blank = "{% for m in messages %}{{ m['content'] }}\n\n{% endfor %}"          # turns apart by blank lines
    assert ChatTemplate(blank, _TextTok()).stop_text() is None
    strict = "{% if messages|length > 2 %}{{ raise_exception('one turn only') }}{% endif %}x"
    assert ChatTemplate(strict, _TextTok()).stop_text() is None
