"""The fuzz suite (checks/fuzz.py) in the default run: a few hundred seeded mutants of models,
adapters and checkpoints through every library reader and a sample through the CLI; plus one
test per kind of bad input the readers must name (each `raise` reached by a pytest.raises)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType as VType

from llamatune.train import checkpoint as ckpt
from llamatune.formats.adapter import read_adapter
from llamatune.models.config import ModelConfig
from llamatune.errors import LlamatuneError
from llamatune.formats.gguf_io import GGUFFile, KV, kv, tensor_out, write_gguf
from llamatune.models.model import Model
from llamatune.formats.tensors import NonFiniteError

from checks import fuzz
from checks import fuzz_mutate as fm
from conftest import TEXT, write_tiny_model


def test_fuzz_campaign(tmp_path):
    """300 library cases and 3 command-line cases: every case loads or fails with one clean line."""
    results = fuzz.campaign(300, seed=12345, timeout=30, n_cli=3, workdir=tmp_path)
    bad = [r for r in results if r["outcome"] not in ("loaded", "clean") or r.get("modified")]
    assert not bad, fuzz.table(results) + "\n" + "\n".join(json.dumps(r)[:400] for r in bad[:5])
    readers = {r["reader"] for r in results}
    assert readers == set(fuzz.READERS) | {"cli"}
    clean = sum(r["outcome"] == "clean" for r in results)
    assert 0.3 * len(results) < clean < len(results)      # the mutants are neither all harmless nor all broken


def test_mutations_are_seeded(tmp_path):
    corpus = fm.make_corpus(tmp_path)
    lay = fm.Layout(corpus["adapter"])
    seed = corpus["adapter"].read_bytes()
    a = fm.mutate(seed, lay, np.random.default_rng([7, 3]))
    b = fm.mutate(seed, lay, np.random.default_rng([7, 3]))
    c = fm.mutate(seed, lay, np.random.default_rng([7, 4]))
    assert a == b and a != c


# --------------------------------------------------------------------------- byte-level problems

def _patch(path: Path, out: Path, offset: int, blob: bytes) -> Path:
    data = bytearray(path.read_bytes())
    data[offset:offset + len(blob)] = blob
    out.write_bytes(bytes(data))
    return out


def _tinfo(path: Path, name: str):
    lay = fm.Layout(path)
    return next(t for t in lay.tinfos if t[0] == name), lay


def _tensor_field(path: Path, name: str, field: str, value: int) -> tuple[int, bytes]:
    """(offset, bytes) that set one field of a tensor info: offset (u64), n_dims (u32) or dim0 (u64)."""
    (_, _, _, n_dims_off, _, off_off), _ = _tinfo(path, name)
    if field == "offset+":
        old = int.from_bytes(path.read_bytes()[off_off:off_off + 8], "little")
        return off_off, (old + value).to_bytes(8, "little")
    if field == "offset":
        return off_off, value.to_bytes(8, "little")
    if field == "n_dims":
        return n_dims_off, value.to_bytes(4, "little")
    return n_dims_off + 4, value.to_bytes(8, "little")


def _kv_field(path: Path, key: str, at: int, value: int) -> tuple[int, bytes]:
    """(offset, bytes) that set the u64 at `at` bytes into a metadata value (string or array length)."""
    *_, vstart = next(k for k in fm.Layout(path).kvs if k[0] == key)
    return vstart + at, value.to_bytes(8, "little")


@pytest.mark.parametrize("locate,match", [
    (lambda p: _tensor_field(p, "blk.0.attn_q.weight", "offset+", 4),
     r"tensor 'blk.0.attn_q.weight' data offset \d+ is not a multiple of the alignment 32"),
    (lambda p: _tensor_field(p, "blk.0.attn_k.weight", "offset", 0), r"tensors '.*' and '.*' overlap in the file"),
    (lambda p: _tensor_field(p, "blk.0.attn_k.weight", "offset", 2**40), r"data ends at byte \d+ but the file has"),
    (lambda p: _tensor_field(p, "output_norm.weight", "n_dims", 5),
     r"tensor 'output_norm.weight' has 5 dimensions, expected 1 to 4"),
    (lambda p: _tensor_field(p, "output_norm.weight", "dim0", 0),
     r"tensor 'output_norm.weight' has dimensions \[0\]"),
    (lambda p: (16, (2**40).to_bytes(8, "little")), r"claims 1099511627776 metadata keys, more than the file"),
    (lambda p: (8, (2**62).to_bytes(8, "little")), r"claims 4611686018427387904 tensors, more than the file can hold"),
    (lambda p: _kv_field(p, "general.name", 0, 2**50), r"string at byte \d+ claims 1125899906842624 bytes"),
    (lambda p: _kv_field(p, "tokenizer.ggml.scores", 4, 2**33), r"array at byte \d+ claims 8589934592 elements"),
    (lambda p: (4, (3 << 24).to_bytes(4, "little")), r"GGUF version 50331648 \(a big-endian file\?"),
    (lambda p: (4, (9).to_bytes(4, "little")), r"GGUF version 9; versions 2 and 3 are supported"),
], ids=["misaligned", "overlap", "past-end", "n_dims", "zero-dim", "kv-count", "tensor-count", "string-length",
        "array-length", "big-endian", "version"])
def test_bad_bytes(tmp_path, tiny_model, locate, match):
    offset, blob = locate(tiny_model)
    p = _patch(tiny_model, tmp_path / "bad.gguf", offset, blob)
    with pytest.raises(LlamatuneError, match=r"bad\.gguf: .*" + match):
        GGUFFile(p)


def test_control_characters_in_names(tmp_path, tiny_model):
    (_, start, _, _, _, _), _ = _tinfo(tiny_model, "output_norm.weight")
    p = _patch(tiny_model, tmp_path / "n.gguf", start + 8, b"out\nut")
    with pytest.raises(LlamatuneError, match=r"n\.gguf: tensor name 'out\\nut_norm.weight' is not a name"):
        GGUFFile(p)
    lay = fm.Layout(tiny_model)
    _, start, *_ = next(k for k in lay.kvs if k[0] == "general.name")
    p = _patch(tiny_model, tmp_path / "k.gguf", start + 8, b"gen\rral")
    with pytest.raises(LlamatuneError, match=r"k\.gguf: metadata key 'gen\\rral.name' holds control characters"):
        GGUFFile(p)


@pytest.mark.parametrize("kind,name,match", [
    ("kv", "general.name", r"metadata key 'general.name' appears twice"),
    ("tensor", "output_norm.weight", r"duplicate tensor name output_norm.weight"),
])
def test_duplicate_key_and_tensor(tmp_path, tiny_model, kind, name, match):
    lay = fm.Layout(tiny_model)
    seed = tiny_model.read_bytes()
    start, end = next(r[1:3] for r in (lay.kvs if kind == "kv" else lay.tinfos) if r[0] == name)
    p = tmp_path / "dup.gguf"
    p.write_bytes(bytes(fm.add_record(bytearray(seed), lay, kind, seed[start:end])))
    with pytest.raises(LlamatuneError, match=r"dup\.gguf: .*" + match):
        GGUFFile(p)


# --------------------------------------------------------------------------- metadata types and ranges

def _rewrite(src: Path, dst: Path, change: dict, drop=()) -> Path:
    f = GGUFFile(src)
    kvs = [change.get(k, v) for k, v in f.kvs.items() if k not in drop] + [v for k, v in change.items()
                                                                          if k not in f.kvs]
    write_gguf(dst, f.arch, kvs, [tensor_out(n, np.array(t.data), t.qtype) if t.qtype == QType.F32 else
                                  tensor_out(n, np.array(t.raw_rows()), t.qtype) for n, t in f.tensors.items()])
    return dst


@pytest.mark.parametrize("key,value,match", [
    ("llama.block_count", KV("llama.block_count", "two", VType.STRING),
     r"'llama.block_count' is a string 'two', expected an integer"),
    ("llama.block_count", KV("llama.block_count", -2, VType.INT32), r"'llama.block_count' is -2, expected 1 to"),
    ("llama.context_length", KV("llama.context_length", 0, VType.UINT32), r"'llama.context_length' is 0, expected 1"),
    ("llama.embedding_length", KV("llama.embedding_length", 2**40, VType.UINT64), r"is 1099511627776, expected 1 to"),
    ("llama.attention.head_count", KV("llama.attention.head_count", 3, VType.UINT32),
     r"head_count 3 is not a multiple of head_count_kv 2"),
    ("llama.attention.layer_norm_rms_epsilon", KV("llama.attention.layer_norm_rms_epsilon", float("nan"),
                                                  VType.FLOAT32), r"is nan, expected a finite float32 number"),
    ("llama.rope.freq_base", KV("llama.rope.freq_base", 1e300, VType.FLOAT64), r"is 1e\+300, expected a finite float32"),
    ("llama.rope.scaling.type", KV("llama.rope.scaling.type", 7, VType.UINT32),
     r"'llama.rope.scaling.type' is int 7, expected a string"),
])
def test_metadata_types_and_ranges(tmp_path, tiny_model, key, value, match):
    p = _rewrite(tiny_model, tmp_path / "md.gguf", {key: value})
    with pytest.raises(LlamatuneError, match=r"md\.gguf: .*" + match):
        Model(p)


def test_architecture_must_be_a_string(tiny_model):
    md = dict(GGUFFile(tiny_model).metadata, **{"general.architecture": [1, 2]})
    with pytest.raises(LlamatuneError, match=r"x: metadata key 'general.architecture' is a list of 2, expected a string"):
        ModelConfig.from_metadata(md, "x")


def test_heads_must_divide_embedding_without_key_length(tmp_path, tiny_model):
    md = dict(GGUFFile(tiny_model).metadata)
    del md["llama.attention.key_length"]
    md["llama.attention.head_count"], md["llama.attention.head_count_kv"] = 6, 6
    with pytest.raises(LlamatuneError, match=r"x: embedding_length 64 is not a multiple of head_count 6"):
        ModelConfig.from_metadata(md, "x")


def test_alignment_key_type_and_value(tmp_path, tiny_model):
    lay = fm.Layout(tiny_model)
    for vtype, blob, match in [(4, (24).to_bytes(4, "little"), "is 24, expected a power of 2"),
                               (8, (1).to_bytes(8, "little") + b"x", "has type STRING, expected UINT32")]:
        key = b"general.alignment"
        p = tmp_path / "al.gguf"
        p.write_bytes(bytes(fm.add_record(bytearray(tiny_model.read_bytes()), lay, "kv", len(key).to_bytes(8, "little")
                                          + key + vtype.to_bytes(4, "little") + blob)))
        with pytest.raises(LlamatuneError, match=r"al\.gguf: metadata key 'general.alignment' " + match):
            GGUFFile(p)


# --------------------------------------------------------------------------- types and non-finite values

def _with_tensor(src: Path, dst: Path, name: str, make) -> Path:
    f = GGUFFile(src)
    tensors = []
    for n, t in f.tensors.items():
        arr = np.array(t.data) if t.qtype == QType.F32 else np.array(t.raw_rows())
        tensors.append(make(n, arr) if n == name else tensor_out(n, arr, t.qtype))
    write_gguf(dst, f.arch, f.kvs.values(), tensors)
    return dst


def test_norm_vector_of_a_type_that_cannot_be_dequantized(tmp_path, tiny_model):
    p = _with_tensor(tiny_model, tmp_path / "i.gguf", "blk.1.ffn_norm.weight",
                     lambda n, a: tensor_out(n, np.zeros(64 * 8, np.uint8), QType.I64))
    with pytest.raises(LlamatuneError, match=r"i\.gguf: tensor 'blk.1.ffn_norm.weight' has type I64, which cannot be"):
        Model(p)


@pytest.mark.parametrize("qtype", [QType.F32, QType.Q8_0])
def test_nonfinite_model_weights(tmp_path, tiny_vocab, qtype):
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab, qtype)

    def poison(n, a):
        a = a.copy()
        if qtype == QType.F32:
            a[3, 5] = np.inf
        else:
            a[3, 34:36] = np.array([np.nan], np.float16).view(np.uint8)   # the second block's scale
        return tensor_out(n, a, qtype)
    p = _with_tensor(base, tmp_path / "nan.gguf", "blk.1.ffn_up.weight", poison)
    with pytest.raises(NonFiniteError, match=r"nan\.gguf: tensor 'blk.1.ffn_up.weight' holds non-finite values "
                                             r"\(inf or nan\) in 1 of 96 rows, first row 3"):
        Model(p)
    m = Model(p, allow_nonfinite=True)
    assert m.weights.layers[1].mats["ffn_up"].qtype == qtype


def test_perplexity_cli_nonfinite(tmp_path, tiny_model):
    p = _with_tensor(tiny_model, tmp_path / "inf.gguf", "output_norm.weight",
                     lambda n, a: tensor_out(n, np.where(np.arange(64) == 7, np.float32(np.inf), a)))
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    cmd = [sys.executable, "-m", "llamatune.cli.main", "perplexity", "-m", str(p), "-f", str(text), "-c", "16"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"error: {p}: tensor 'output_norm.weight' holds non-finite values (inf or nan) in 1 of 1 rows, first row 0 "
        "(--allow-nonfinite runs anyway)")
    r = subprocess.run(cmd + ["--allow-nonfinite"], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "nan" not in r.stdout.lower(), r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == [
        ln for ln in r.stderr.splitlines() if "perplexity is nan from window 1 on" in ln]


def test_huge_norm_weights_give_an_error_not_overflow(tmp_path, tiny_model):
    from llamatune.models.infer import Runner
    from llamatune.commands.perplexity import perplexity
    p = _with_tensor(tiny_model, tmp_path / "big.gguf", "output_norm.weight",
                     lambda n, a: tensor_out(n, np.full(64, 3e38, np.float32)))
    with pytest.raises(LlamatuneError, match=r"perplexity is (inf|nan) from window 1 on .*big\.gguf"):
        perplexity(Runner(Model(p)), TEXT, 16, 64)


def _adapter(tmp_path, tiny_model, name, change):
    from llamatune.formats.adapter import LoraAdapter, write_adapter
    rng = np.random.default_rng(0)
    a = LoraAdapter("llama", 2.0, {"blk.0.attn_q.weight": (rng.standard_normal((2, 64)).astype(np.float32),
                                                          rng.standard_normal((64, 2)).astype(np.float32))})
    p = tmp_path / "ad.gguf"
    write_adapter(p, a)
    return _with_tensor(p, tmp_path / name, "blk.0.attn_q.weight.lora_b", change)


def test_adapter_nonfinite_and_type(tmp_path, tiny_model):
    base = GGUFFile(tiny_model)
    p = _adapter(tmp_path, tiny_model, "nan.gguf", lambda n, a: tensor_out(n, np.where(a > 1, np.nan, a)))
    with pytest.raises(NonFiniteError, match=r"nan\.gguf: tensor 'blk.0.attn_q.weight.lora_b' holds non-finite"):
        read_adapter(p, base)
    assert read_adapter(p, base, allow_nonfinite=True).rank("blk.0.attn_q.weight") == 2
    p = _adapter(tmp_path, tiny_model, "i8.gguf", lambda n, a: tensor_out(n, np.zeros((64, 2), np.uint8), QType.I8))
    with pytest.raises(LlamatuneError, match=r"i8\.gguf: tensor 'blk.0.attn_q.weight.lora_b' has type I8, which "
                                             "cannot be dequantized"):
        read_adapter(p, base)


def test_adapter_alpha_must_be_a_finite_number(tmp_path, tiny_model):
    p = _adapter(tmp_path, tiny_model, "ok.gguf", lambda n, a: tensor_out(n, a))
    q = _rewrite(p, tmp_path / "alpha.gguf", {"adapter.lora.alpha": KV("adapter.lora.alpha", "8", VType.STRING)})
    with pytest.raises(LlamatuneError, match=r"alpha\.gguf: metadata key 'adapter.lora.alpha' is a string '8', "
                                             "expected a number"):
        read_adapter(q, GGUFFile(tiny_model))


# --------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return fm.make_corpus(tmp_path_factory.mktemp("corpus"))


def _params():
    from llamatune.train.lora import lora_specs, lora_targets
    from llamatune.options import FinetuneOptions
    from llamatune.train.params import ParamBuffer
    cfg = ModelConfig("llama", 300, 64, 64, 2, 96, 4, 2, 16, 16, 1e-5)
    return ParamBuffer(lora_specs(lora_targets(cfg, FinetuneOptions(**fm.CKPT_OPTIONS).ranks(), 4.0, False)))


def test_checkpoint_loads_into_its_run(corpus):
    c = ckpt.load(corpus["checkpoint"])
    params = _params()
    c.load_into(params)
    np.testing.assert_array_equal(params.m, GGUFFile(corpus["checkpoint"]).tensor("optimizer.adam.first_moments").data)


def test_checkpoint_tensor_type_and_values(tmp_path, corpus):
    name = "blk.0.attn_q.weight.lora_a"
    p = _with_tensor(corpus["checkpoint"], tmp_path / "f16.gguf", name,
                     lambda n, a: tensor_out(n, a.astype(np.float16)))
    with pytest.raises(LlamatuneError, match=rf"f16\.gguf: tensor '{name}' has type F16, expected F32"):
        ckpt.load(p).load_into(_params())
    p = _with_tensor(corpus["checkpoint"], tmp_path / "v.gguf", "optimizer.adam.second_moments",
                     lambda n, a: tensor_out(n, np.where(np.arange(a.size) == 9, np.nan, a).astype(np.float32)))
    with pytest.raises(NonFiniteError, match=r"v\.gguf: tensor 'optimizer.adam.second_moments' holds non-finite"):
        ckpt.load(p).load_into(_params())


def test_checkpoint_rank_must_match_recorded_rank(tmp_path, corpus):
    p = _rewrite(corpus["checkpoint"], tmp_path / "r.gguf",
                 {"training.lora.rank.attn_q": kv("training.lora.rank.attn_q", 3)})
    with pytest.raises(LlamatuneError, match=r"r\.gguf: tensor 'blk.0.attn_q.weight.lora_b' has rank 2 but the "
                                             r"checkpoint records training.lora.rank.attn_q = 3"):
        ckpt.load(p)


@pytest.mark.parametrize("key,value,match", [
    ("llamatune.options", kv("llamatune.options", "[1, 2]"),
     r"'llamatune.options' holds list JSON, expected an object"),
    ("llamatune.options", kv("llamatune.options", "{bad"), r"'llamatune.options' is not valid JSON"),
    ("training.iteration_count", KV("training.iteration_count", -1, VType.INT64),
     r"'training.iteration_count' is -1, expected 0 to"),
    ("llamatune.checkpoint.kind", kv("llamatune.checkpoint.kind", "other"),
     r"'llamatune.checkpoint.kind' is 'other', expected 'finetune_lora'"),
    ("training.loss_ema", kv("training.loss_ema", "x"), r"'training.loss_ema' is a string 'x', expected a number"),
    ("training.loss_ema", KV("training.loss_ema", 1e300, VType.FLOAT64),
     r"'training.loss_ema' is 1e\+300, expected a finite float32 number"),
    ("training.lora.alpha", KV("training.lora.alpha", 1e300, VType.FLOAT64),
     r"'training.lora.alpha' is 1e\+300, expected a finite float32 number"),
])
def test_checkpoint_metadata(tmp_path, corpus, key, value, match):
    """Loading for a resume, and converting to an adapter (which reads the alpha)."""
    from llamatune.commands.convert import convert
    p = _rewrite(corpus["checkpoint"], tmp_path / "c.gguf", {key: value})
    with pytest.raises(LlamatuneError, match=r"c\.gguf: metadata key " + match):
        ckpt.load(p)
        convert(p, tmp_path / "a.gguf", "gguf-adapter")
    assert not (tmp_path / "a.gguf").exists()


def test_sampling_refuses_nonfinite_logits():
    from llamatune.models.sampling import sample
    rng = np.random.default_rng(0)
    assert sample(np.array([0.0, 2.0, 1.0], np.float32), rng, 0.8, 40, 0.95) in (0, 1, 2)
    with pytest.raises(LlamatuneError, match=r"cannot sample: the model's logits are not finite"):
        sample(np.array([0.0, np.nan, 1.0], np.float32), rng, 0.8, 40, 0.95)
