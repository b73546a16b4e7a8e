"""Tokenizer vs llama.cpp: the vocabularies of llama.cpp's vocab suites and a Gemma-style
SentencePiece vocabulary (tests/fixtures/vocab, made by make_vocab_fixtures.py), each with
the ids and detokenized texts llama.cpp's own library gave, plus special-token, decoding
and bad-metadata checks."""
from __future__ import annotations

import functools
import json
import lzma
import re
import tempfile
import warnings
from pathlib import Path

import gguf
import pytest

from llamatune.errors import LlamatuneError
from llamatune.formats.gguf_io import GGUFFile
from llamatune.models.pretokenizers import PRE_TOKENIZERS
from llamatune.models.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vocab"
# llama.cpp's suites: NAME.json + NAME.gguf.xz (gemma-spm and the pre-tokenizer cases have their own tests)
VOCABS = sorted(p.name[:-len(".json")] for p in FIXTURES.glob("*.json")
                if p.name not in ("gemma-spm.json", "pre-tokenizers.json"))


@functools.cache
def _unpacked() -> Path:
    return Path(tempfile.mkdtemp(prefix="llamatune-vocab-"))


@functools.cache
def vocab_file(name: str) -> GGUFFile:
    """The fixture vocabulary NAME (decompressed once per session); skips when it is missing."""
    packed = FIXTURES / f"{name}.gguf.xz"
    if not packed.exists():
        pytest.skip(f"vocabulary fixture {packed} is missing (tests/fixtures/make_vocab_fixtures.py writes it)")
    path = _unpacked() / f"{name}.gguf"
    path.write_bytes(lzma.decompress(packed.read_bytes()))
    return GGUFFile(path)


@functools.cache
def tok(name: str) -> Tokenizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # aquila has no tokenizer.ggml.pre, as llama.cpp warns
        return Tokenizer.from_gguf(vocab_file(name))


@functools.cache
def cases(name: str) -> list:
    """[text, ids, decoded] per case: ids from llama.cpp's suite (no special tokens added or
    parsed), decoded = llama_detokenize(ids, remove_special=false, unparse_special=false)."""
    return json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))["cases"]


def _vocab_params(*only: str):
    params = [pytest.param(n, id=n) for n in VOCABS if not only or n in only]
    return params or [pytest.param(None, marks=pytest.mark.skip(reason=f"no vocabulary fixtures in {FIXTURES}"))]


@pytest.mark.parametrize("name", _vocab_params())
def test_encode_matches_llama_cpp(name):
    t = tok(name)
    wrong = [(text, ids) for text, ids, _ in cases(name) if t.encode(text, add_special=False) != ids]
    assert wrong == [], f"{len(wrong)} of {len(cases(name))} texts tokenize differently, first: {wrong[0]!r}"


@pytest.mark.parametrize("name", _vocab_params())
def test_decode_matches_llama_cpp(name):
    """decode(ids) is llama.cpp's detokenize: e.g. clean_spaces vocabularies (gpt-2,
    llama-bpe, gemma-4) drop the space in " ?", " 's", ...; SentencePiece drops the
    dummy-prefix space of the first piece."""
    t = tok(name)
    wrong = [(ids, dec) for _, ids, dec in cases(name) if t.decode(ids) != dec]
    assert wrong == [], f"{len(wrong)} of {len(cases(name))} id lists decode differently, first: {wrong[0]!r}"


def test_suite_fixtures_cover_every_code_path():
    """SPM, byte-level BPE with each kind of pre-tokenizer, and gemma4's BPE are all there."""
    if not VOCABS:
        pytest.skip(f"no vocabulary fixtures in {FIXTURES}")
    kinds = {"spm" if tok(n)._spm else "spm-style bpe" if tok(n)._spm_style else "byte-level bpe" for n in VOCABS}
    assert kinds == {"spm", "spm-style bpe", "byte-level bpe"}
    assert {"qwen35", "gemma-4", "llama-bpe", "deepseek-llm", "aquila"} <= set(VOCABS)


# ---- every pre-tokenizer of the table, on qwen35's and gemma-4's vocabularies ----
@functools.cache
def pre_cases() -> dict:
    path = FIXTURES / "pre-tokenizers.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {"texts": [], "ids": {}}


class _WithPre:
    """A vocabulary file read as if its tokenizer.ggml.pre were `pre`."""

    def __init__(self, f: GGUFFile, pre: str):
        self.path, self._f, self._pre = f.path, f, pre

    def get(self, key, default=None):
        return self._pre if key == "tokenizer.ggml.pre" else self._f.get(key, default)


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_pre_tokenizer_matches_llama_cpp(pre):
    """llama.cpp's ids for suite texts plus digit, CJK and Hangul texts under each
    `tokenizer.ggml.pre` name (make_vocab_fixtures.py: pre_tokenizer_fixture)."""
    if pre not in pre_cases()["ids"]:
        pytest.fail(f"no llama.cpp ids recorded for pre-tokenizer {pre!r}: run tests/fixtures/make_vocab_fixtures.py")
    base = "pre-spm-style" if PRE_TOKENIZERS[pre].spm_style else "pre-bpe"
    t = Tokenizer.from_gguf(_WithPre(vocab_file(base), pre))
    got = [t.encode(text, add_special=False) for text in pre_cases()["texts"]]
    wrong = [text for text, ids, want in zip(pre_cases()["texts"], got, pre_cases()["ids"][pre]) if ids != want]
    assert wrong == [], f"{len(wrong)} texts tokenize differently, first: {wrong[0]!r}"


def test_pre_tokenizer_fixture_lists_the_table():
    if not pre_cases()["ids"]:
        pytest.skip(f"{FIXTURES / 'pre-tokenizers.json'} is missing")
    assert sorted(pre_cases()["ids"]) == sorted(PRE_TOKENIZERS)


# ---- Gemma 1/2/3: SentencePiece without the dummy prefix, user-defined whitespace runs ----
@functools.cache
def gemma_cases() -> list[dict]:
    return json.loads((FIXTURES / "gemma-spm.json").read_text(encoding="utf-8"))["cases"]


def test_gemma_spm_matches_llama_cpp():
    """Every text with each add_special / parse_special combination: llama.cpp's ids, its
    detokenized text, and with special pieces shown (as llama-tokenize prints them)."""
    t = tok("gemma-spm")
    assert (t.add_bos, t.add_eos, t._add_space_prefix, t.bos_id, t.eos_id) == (True, False, False, 2, 1)
    assert t.token_text(11) == "<end_of_turn>" and 11 in t.eog_ids
    wrong = []
    for c in gemma_cases():
        ids = t.encode(c["text"], add_special=c["add_special"], parse_special=c["parse_special"])
        shown = b"".join(t.token_to_bytes(i, special=True) for i in c["ids"]).decode("utf-8", errors="replace")
        if (ids, t.decode(c["ids"]), shown) != (c["ids"], c["decoded"], c["decoded_special"]):
            wrong.append(c)
    assert wrong == [], f"{len(wrong)} of {len(gemma_cases())} cases differ, first: {wrong[0]!r}"


def test_gemma_spm_special_tokens():
    t = tok("gemma-spm")
    turn = "<start_of_turn>user\nHi<end_of_turn>\n"
    ids = t.encode(turn, add_special=False, parse_special=True)
    # no " " prefix after a control token (add_space_prefix is false); "\n" is a user-defined token
    assert ids == [10] + t.encode("user", False) + [12] + t.encode("Hi", False) + [11, 12]
    assert t.decode(ids) == "user\nHi\n"
    plain = t.encode(turn, add_special=False)           # control texts stay text without parse_special
    assert not {10, 11} & set(plain) and t.decode(plain) == turn
    # runs of spaces and newlines are user-defined tokens split out before SentencePiece
    assert t.encode("a   b", False) == t.encode("a", False) + [t._ids["   "]] + t.encode("b", False)
    assert t.encode("\n\n\n", False) == [t._ids["\n\n\n"]]


@pytest.mark.parametrize("name", _vocab_params())
def test_add_special(name):
    t = tok(name)
    ids = t.encode("Hello world", add_special=False)
    with_special = t.encode("Hello world")
    bos = [t.bos_id] if t.add_bos else []
    eos = [t.eos_id] if t.add_eos else []
    assert with_special == bos + ids + eos
    assert t.encode("", add_special=False) == []
    assert t.encode("") == bos + eos
    # BOS/EOS are control tokens: decode skips them
    assert t.decode([t.bos_id] + ids + [t.eos_id]).strip() == "Hello world"


@pytest.mark.parametrize("name", _vocab_params("llama-spm", "phi-3"))
def test_spm_bos_and_leading_space(name):
    t = tok(name)
    assert t.add_bos and t.bos_id == 1 and not t.add_eos
    ids = t.encode("Hello world")
    assert ids[0] == 1 and ids[1:] == t.encode("Hello world", add_special=False)
    # llama.cpp strips the dummy-prefix space from the first token's piece only,
    # so after a (skipped) BOS the space stays
    assert t.decode(ids[1:]) == "Hello world"
    assert t.decode(ids) == " Hello world"


@pytest.mark.parametrize("name", _vocab_params("gpt-2", "llama-bpe"))
def test_bpe_add_bos_defaults(name):
    t = tok(name)
    # no add_bos_token key in either file: llama.cpp's default is false for gpt-2 and
    # true for the llama3 pre-tokenizer ("llama-bpe")
    assert t.add_bos == (name == "llama-bpe") and not t.add_eos


@pytest.mark.parametrize("name", _vocab_params("llama-bpe"))
def test_parse_special_llama3(name):
    t = tok(name)
    text = "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    ids = t.encode(text, add_special=False, parse_special=True)
    assert ids == [128006] + t.encode("user", False) + [128007] + t.encode("\n\nHi", False) + [128009]
    # without parse_special the control-token texts are ordinary text
    plain = t.encode(text, add_special=False)
    assert not {128006, 128007, 128009} & set(plain)
    assert t.decode(plain) == text
    assert t.decode(ids) == "user\n\nHi"   # control tokens are skipped


@pytest.mark.parametrize("name", _vocab_params("phi-3"))
def test_phi3_special_tokens(name):
    t = tok(name)
    # "Phi3" in general.name: llama.cpp strips whitespace after special tokens (rstrip),
    # and the text after a special token gets the SPM space prefix again
    ids = t.encode("<|user|>\nHi<|end|>\n", add_special=False, parse_special=True)
    assert ids == [32010] + t.encode("Hi", False) + [32007]
    # "</s>" is user-defined in the GGUF but llama.cpp marks it control (EOG text),
    # so it is only split out with parse_special
    assert 2 not in t.encode("a</s>b", add_special=False)
    assert t.encode("a</s>b", False, parse_special=True) == t.encode("a", False) + [2] + t.encode("b", False)


@pytest.mark.parametrize("name", _vocab_params())
def test_token_to_piece(name):
    t = tok(name)
    hello = t.encode(" Hello", add_special=False)
    assert "".join(t.token_to_piece(i) for i in hello) in (" Hello", "  Hello")  # SPM adds its prefix
    assert t.token_to_piece(t.eos_id) == ""
    nl = t.encode("\n", add_special=False)[-1]
    assert t.token_to_piece(nl) == "\n"
    with pytest.raises(LlamatuneError, match="out of range"):
        t.token_to_piece(t.n_vocab)


# ---- bad metadata: tiny GGUF files ----
def _write(tmp_path: Path, kvs: dict) -> GGUFFile:
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(path, arch="llama")
    for key, value in kvs.items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


BPE_TOKENS = ["a", "b", "ab", "Ġ"]


@pytest.mark.parametrize("kvs,message", [
    ({}, "no tokenizer metadata"),
    ({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}, "unsupported tokenizer model 'bert'"),
    ({"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": ["a a"]},
     "tokenizer.ggml.add_bos_token is true but there is no bos token id"),   # gemma4 always adds BOS
    ({"tokenizer.ggml.model": "llama"}, "missing tokenizer metadata key 'tokenizer.ggml.tokens'"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": BPE_TOKENS},
     "missing tokenizer metadata key 'tokenizer.ggml.merges'"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre", "tokenizer.ggml.tokens": BPE_TOKENS,
      "tokenizer.ggml.merges": ["a b"]}, "unknown pre-tokenizer 'no-such-pre'"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a", "a"]},
     "duplicate token 'a' in vocabulary (ids 1 and 2)"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>"]},   # default BOS id 1 out of range
     "tokenizer.ggml.add_bos_token is true but there is no bos token id"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": "abc"}, "'tokenizer.ggml.tokens' must be"),
])
def test_bad_metadata(tmp_path, kvs, message):
    f = _write(tmp_path, kvs)
    with pytest.raises(LlamatuneError, match=re.escape(message)) as e:
        Tokenizer.from_gguf(f)
    assert str(f.path) in str(e.value)


def test_tiny_bpe_vocab(tmp_path):
    f = _write(tmp_path, {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                          "tokenizer.ggml.tokens": BPE_TOKENS, "tokenizer.ggml.merges": ["a b"]})
    t = Tokenizer.from_gguf(f)
    assert (t.n_vocab, t.add_bos, t.bos_id) == (4, False, None)  # llama.cpp's default BOS 11 is out of range
    assert t.encode("abab ab") == [2, 2, 3, 2]
    assert t.decode([2, 2, 3, 2]) == "abab ab"


def test_tiny_spm_vocab(tmp_path):
    tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "▁ab"] + [f"<0x{i:02X}>" for i in range(256)]
    f = _write(tmp_path, {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                          "tokenizer.ggml.scores": [0.0] * 3 + [-1.0, -1.0, -1.0, -2.0, -3.0, -0.5] + [0.0] * 256,
                          "tokenizer.ggml.token_type": [2, 3, 3] + [1] * 6 + [6] * 256})
    t = Tokenizer.from_gguf(f)
    newline = 9 + 0x0A                                    # byte token <0x0A>
    assert t.encode("ab") == [1, 8]                       # "▁a" merges first, then "▁ab"
    assert t.encode("b\n", add_special=False) == [3, 5, newline]   # "▁", "b", byte fallback
    assert t.decode([8, newline]) == "ab\n"
    # characters that are no token and have no byte token: llama.cpp aborts, we raise
    f = _write(tmp_path, {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens[:9]})
    with pytest.raises(LlamatuneError, match=r"cannot encode 'é' \(U\+00E9\) in 'é': the vocabulary has no byte token <0xC3>"):
        Tokenizer.from_gguf(f).encode("aé")
    # a long text that sentencepiece returns as one unknown piece: the line names the character
    # and a short excerpt around it, never the whole text
    long_text = "é" * 5000 + "ü" + "é" * 5000
    with pytest.raises(LlamatuneError) as err:
        Tokenizer.from_gguf(f).encode("a" + long_text)
    line = str(err.value)
    assert line.endswith(": cannot encode 'é' (U+00E9) in '" + "é" * 21 + "'...: the vocabulary has no byte token <0xC3>")
    assert line.startswith(str(tmp_path)) and len(line) < len(str(tmp_path)) + 120


def test_missing_pre_warns_and_uses_default(tmp_path):
    f = _write(tmp_path, {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": BPE_TOKENS,
                          "tokenizer.ggml.merges": ["a b"]})
    with pytest.warns(UserWarning, match="no 'tokenizer.ggml.pre'"):
        t = Tokenizer.from_gguf(f)
    assert t.encode("ab ab") == [2, 3, 2]


GEMMA4_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "\n", "\n\n", "a", "b", "▁", "▁a", "ab", "▁ab", ","]
GEMMA4_VOCAB = {"tokenizer.ggml.tokens": GEMMA4_TOKENS + [f"<0x{i:02X}>" for i in range(256)],
                "tokenizer.ggml.token_type": [3, 3, 3, 2] + [1] * 9 + [6] * 256,
                "tokenizer.ggml.merges": ["▁ a", "a b", "▁a b"],
                "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1}
BYTE0 = len(GEMMA4_TOKENS)


def test_tiny_gemma4_vocab(tmp_path):
    """llama.cpp's gemma4 BPE: spaces become U+2581 and merges run on raw UTF-8 by rank,
    a run of newlines that is a token stays whole, characters that are no token fall back
    to <0xXX> tokens, BOS is added even when the GGUF says not to."""
    f = _write(tmp_path, {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.add_bos_token": False, **GEMMA4_VOCAB})
    t = Tokenizer.from_gguf(f)
    assert (t.add_bos, t.bos_id, t.eos_id) == (True, 2, 1)
    # "ab▁ab": "▁ a" (rank 0), then "a b" (rank 1), then "▁a b" (rank 2)
    assert t.encode("ab ab") == [2, 10, 11]
    assert t.encode("\n\n", add_special=False) == [5]         # no "\n \n" merge: the run is one token
    assert t.encode("é", add_special=False) == [BYTE0 + 0xC3, BYTE0 + 0xA9]
    assert t.decode([2, 10, 11, 4, BYTE0 + 0xC3, BYTE0 + 0xA9]) == "ab ab\né"
    assert t.decode([6, 8, 12]) == "a,"                         # clean_spaces: " ," loses its space
    assert t.token_to_piece(11) == " ab" and t.token_to_piece(BYTE0 + 0x41) == "A"


def test_sarvam_moe_is_gemma4_without_its_extras(tmp_path):
    """sarvam-moe (a "gpt2" model with that pre-tokenizer): the same SentencePiece-style BPE,
    but newline runs merge like any text, BOS follows the GGUF and spaces are kept on decode."""
    f = _write(tmp_path, {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "sarvam-moe", **GEMMA4_VOCAB})
    t = Tokenizer.from_gguf(f)
    assert not t.add_bos
    assert t.encode("ab ab") == [10, 11]
    assert t.encode("\n\n") == [4, 4]
    assert t.decode([6, 8, 12]) == "a ,"


def test_every_pre_tokenizer_regex_splits():
    """Each regex of the table compiles in the `tokenizers` library and splits a mixed text
    into pieces that cover it exactly (a typo in a character class would fail here)."""
    from tokenizers import Regex, pre_tokenizers
    text = "Hello World's 12345 naïve ÀB cd\t\n\n  x<sentinel:3> 日本語 한국어 …！ e\u0301 -- ok"
    for name, setting in PRE_TOKENIZERS.items():
        split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated")
                                         for r in setting.regexes])
        pieces = [p for p, _ in split.pre_tokenize_str(text)]
        assert "".join(pieces) == text and len(pieces) > 1, name
