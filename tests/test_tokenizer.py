"""Tokenizer vs llama.cpp: the shared ggml-vocab-*.gguf files with their .inp/.out
reference cases (made by llama.cpp's test-tokenizer-0 with no special tokens added or
parsed), plus special-token, decoding and bad-metadata checks."""
from __future__ import annotations

import functools
import re
from pathlib import Path

import gguf
import pytest

from llamatune.errors import LlamatuneError
from llamatune.formats.gguf_io import GGUFFile
from llamatune.models.tokenizer import Tokenizer

VOCAB_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "vocab"
SEP = "\n__ggml_vocab_test__\n"


def _vocab_names() -> list[str]:
    if not VOCAB_DIR.is_dir():
        return []
    return sorted(p.name[len("ggml-vocab-"):-len(".gguf")] for p in VOCAB_DIR.glob("ggml-vocab-*.gguf"))


VOCABS = _vocab_names()
NO_VOCAB = pytest.mark.skip(reason=f"needed ggml-vocab-*.gguf file(s) not found in {VOCAB_DIR}")


def _path(name: str) -> Path:
    return VOCAB_DIR / f"ggml-vocab-{name}.gguf"


@functools.lru_cache(maxsize=None)
def cases(name: str) -> list[tuple[str, list[int]]]:
    """The .inp file is `text + SEP` per case (so it ends with SEP); the .out file is one
    line of space-separated ids per case, each line ending with a newline."""
    inp = _path(name).with_suffix(".gguf.inp").read_bytes().decode("utf-8")
    out = _path(name).with_suffix(".gguf.out").read_bytes().decode("utf-8")
    assert inp.endswith(SEP) and out.endswith("\n")
    texts = inp.split(SEP)[:-1]
    ids = [[int(x) for x in line.split()] for line in out.split("\n")[:-1]]
    assert len(texts) == len(ids), f"{name}: {len(texts)} inputs but {len(ids)} outputs"
    return list(zip(texts, ids))


@functools.lru_cache(maxsize=None)
def tok(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(_path(name)))


def _case_params():
    params = [pytest.param(n, i, id=f"{n}-{i}") for n in VOCABS for i in range(len(cases(n)))]
    return params or [pytest.param(None, None, marks=NO_VOCAB)]


def _vocab_params(*only: str):
    params = [pytest.param(n, id=n) for n in VOCABS if not only or n in only]
    return params or [pytest.param(None, marks=NO_VOCAB)]


def llama_cpp_clean_spaces(s: str) -> str:
    """Literal port of the three clean_spaces passes of llama_vocab::impl::detokenize."""
    t = list(s)
    out = t[:1]                                   # pass 1: " ?", " !", " .", " ," lose the space
    for i in range(1, len(t)):
        if t[i - 1] == " " and t[i] in "?!.,":
            out.pop()
        out.append(t[i])
    t, out, i = out, out[:1], 1                   # pass 2: " ' " -> "'"
    while i < len(t):
        if t[i] == "'" and i + 1 < len(t) and t[i - 1] == " " and t[i + 1] == " ":
            out.pop()
            t[i + 1] = "\0"
            out.append(t[i])
            i += 2
            continue
        out.append(t[i])
        i += 1
    t, out = out, out[:1]                         # pass 3: " 's", " 'm", " 're", " 've" lose the space
    for i in range(1, len(t)):
        if t[i - 1] == " " and t[i] == "'" and i + 1 < len(t):
            x1, x2 = t[i + 1], t[i + 2] if i + 2 < len(t) else ""
            if x1 in "sm" or (x1 + x2) in ("re", "ve"):
                out.pop()
        out.append(t[i])
    return "".join(out)


@pytest.mark.parametrize("name,idx", _case_params())
def test_encode_matches_llama_cpp(name, idx):
    text, expected = cases(name)[idx]
    assert tok(name).encode(text, add_special=False) == expected


@pytest.mark.parametrize("name,idx", _case_params())
def test_decode_round_trip(name, idx):
    """decode(encode(text)) == text, except where llama.cpp's detokenize changes it:
    BPE vocabularies with clean_spaces (gpt-2, llama-bpe: llama.cpp keeps the flag for
    those pre-tokenizers) drop the space in " ?", " !", " .", " ,", " ' ", " 's", " 'm",
    " 're", " 've" -- e.g. the case "How are you 😁 ?" decodes to "How are you 😁?"."""
    t = tok(name)
    text, _ = cases(name)[idx]
    expected = llama_cpp_clean_spaces(text) if t._clean_spaces else text
    assert t.decode(t.encode(text, add_special=False)) == expected


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
    with pytest.raises(LlamatuneError, match=r"cannot encode 'é': the vocabulary has no byte token <0xC3>"):
        Tokenizer.from_gguf(f).encode("aé")


def test_missing_pre_warns_and_uses_default(tmp_path):
    f = _write(tmp_path, {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": BPE_TOKENS,
                          "tokenizer.ggml.merges": ["a b"]})
    with pytest.warns(UserWarning, match="no 'tokenizer.ggml.pre'"):
        t = Tokenizer.from_gguf(f)
    assert t.encode("ab ab") == [2, 3, 2]
