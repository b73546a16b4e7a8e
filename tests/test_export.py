"""export-lora: exact f32 merges, re-quantized merges in every base type, flipped
token_embd and norm adapters, explicit output types, and validation that writes
nothing. Oracles are whole-tensor numpy computations in the same f32 order."""
from __future__ import annotations

import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from conftest import MODELS, need, write_tiny_model
from llamatune.formats.adapter import LoraAdapter, expected_shapes, load_runtime_adapters, write_adapter
from llamatune.errors import LlamatuneError
from llamatune.commands.export import export_lora
from llamatune.formats.gguf_io import GGUFFile, TensorOut, kv, tensor_out, write_gguf
from llamatune.models.infer import Runner
from llamatune.kernels.dequant import dequantize
from llamatune.kernels.quantize import quantize
from llamatune.models.model import Model
from llamatune.options import MergeOptions

PLAIN = MergeOptions(merge_method="plain")    # round to nearest, the oracle these tests compute

# K-quants need every row length to be a multiple of 256
KCFG = dict(n_embd=256, n_ff=512, head_dim=64, n_rot=64, n_head=4, n_head_kv=2, n_layer=1)
MATS = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight",
        "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"]
# Relative RMS error bound of deq(quantize(W + delta)) vs the f32 merge, per type
# (one re-quantization of Gaussian weights: measured 0.00021, 0.0017, 0.0054, 0.086, 0.038, 0.28,
# 0.15, 0.071, 0.036, 0.018 in this order, plus about 40 % margin).
REL_RMS_BOUND = {QType.F16: 0.0004, QType.BF16: 0.003, QType.Q8_0: 0.008, QType.Q4_0: 0.12, QType.Q5_1: 0.055, QType.Q2_K: 0.4,
                 QType.Q3_K: 0.21, QType.Q4_K: 0.1, QType.Q5_K: 0.05, QType.Q6_K: 0.025}


def make_adapter(base, names, rank=4, alpha=8.0, seed=1, arch=None) -> LoraAdapter:
    """Random A and nonzero B of the right shapes for `names` of the base model."""
    f = GGUFFile(base)
    rng = np.random.default_rng(seed)
    adapter = LoraAdapter(arch or f.arch, alpha)
    for n in names:
        a_shape, b_shape = expected_shapes(n, f.tensors[n].shape, rank)
        adapter.pairs[n] = (rng.normal(0, 0.1, a_shape).astype(np.float32),
                            rng.normal(0, 0.1, b_shape).astype(np.float32))
    return adapter


def saved(tmp_path, adapter, name="a.gguf"):
    write_adapter(tmp_path / name, adapter)
    return tmp_path / name


def f32(t) -> np.ndarray:
    return dequantize(t.raw_rows(), t.qtype, t.n_cols)


def exact_merge(base_t, terms) -> np.ndarray:
    """deq(W) + sum s·delta, in the order export_lora uses; terms [(A, B, s)]."""
    w = f32(base_t)
    for a, b, s in terms:
        w = w + np.float32(s) * (a @ b.T if base_t.name == "token_embd.weight" else b @ a)
    return w


def meta(f: GGUFFile, drop=()):
    return {k: (v.value, v.vtype, v.sub_type) for k, v in f.kvs.items() if k not in drop}


def test_f32_merge_exact_and_equals_runtime_adapter(tmp_path, tiny_vocab):
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab)
    names = ["token_embd.weight", "output.weight"] + MATS       # blk.1 and norms stay unmerged
    adapter = make_adapter(base, names)
    path = saved(tmp_path, adapter)
    report = export_lora(base, [(path, 1.0)], tmp_path / "merged.gguf")

    b, m = GGUFFile(base), GGUFFile(tmp_path / "merged.gguf")
    assert report.merged == {n: "F32" for n in names}
    assert report.n_copied == len(b.tensors) - len(names) and report.path == tmp_path / "merged.gguf"
    assert meta(m) == meta(b)
    assert [(t.name, t.qtype, t.shape) for t in m.tensors.values()] == \
           [(t.name, t.qtype, t.shape) for t in b.tensors.values()]
    for name, t in b.tensors.items():
        if name in names:
            a_, b_ = adapter.pairs[name]
            np.testing.assert_array_equal(f32(m.tensors[name]), exact_merge(t, [(a_, b_, 2.0)]))
        else:
            assert m.tensors[name].raw_rows().tobytes() == t.raw_rows().tobytes(), name

    tokens = np.array([[1, 17, 42, 399, 5, 300, 7, 8]])
    merged_logits = Runner(Model(tmp_path / "merged.gguf")).forward(tokens)
    model = Model(base)
    runtime_logits = Runner(model, load_runtime_adapters(model, [(str(path), 1.0)])).forward(tokens)
    np.testing.assert_allclose(merged_logits, runtime_logits, rtol=1e-5, atol=1e-5)
    assert np.abs(merged_logits - Runner(model).forward(tokens)).max() > 1e-2   # the adapter does something


@pytest.mark.parametrize("qtype", list(REL_RMS_BOUND), ids=lambda q: q.name)
def test_quantized_merge_keeps_type(tmp_path, tiny_vocab, qtype):
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab, outtype=qtype, **KCFG)
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "output.weight"]
    adapter = make_adapter(base, names, rank=8, alpha=16.0)
    report = export_lora(base, [(saved(tmp_path, adapter), 0.5)], tmp_path / "m.gguf", merge=PLAIN)
    b, m = GGUFFile(base), GGUFFile(tmp_path / "m.gguf")
    assert report.merged == {n: qtype.name for n in names}
    assert meta(m) == meta(b)
    for name, t in b.tensors.items():
        mt = m.tensors[name]
        assert mt.qtype == t.qtype
        if name not in names:
            assert mt.raw_rows().tobytes() == t.raw_rows().tobytes(), name
            continue
        a_, b_ = adapter.pairs[name]
        exact = exact_merge(t, [(a_, b_, 0.5 * 16.0 / 8)])
        np.testing.assert_array_equal(mt.raw_rows(), quantize(exact, qtype))
        rel = np.sqrt(np.mean((f32(mt) - exact) ** 2) / np.mean(exact ** 2))
        assert rel < REL_RMS_BOUND[qtype], (name, rel)


def test_llama_cpp_q4_k_m_model_keeps_mixed_types(tmp_path):
    base = need(MODELS / "tiny-Q4_K_M.gguf")                   # Q4_K, Q6_K and F32 tensors, made by llama.cpp
    names = ["blk.0.attn_q.weight", "output.weight", "blk.1.ffn_norm.weight"]
    adapter = make_adapter(base, names, rank=8, alpha=8.0)
    report = export_lora(base, [(saved(tmp_path, adapter), 1.0)], tmp_path / "m.gguf", merge=PLAIN)
    assert report.merged == {"blk.0.attn_q.weight": "Q4_K", "output.weight": "Q6_K", "blk.1.ffn_norm.weight": "F32"}
    b, m = GGUFFile(base), GGUFFile(tmp_path / "m.gguf")
    assert meta(m) == meta(b)
    for name, t in b.tensors.items():
        if name in names:
            want = exact_merge(t, [(*adapter.pairs[name], 1.0)])
            np.testing.assert_array_equal(m.tensors[name].raw_rows(), quantize(want, t.qtype))
        else:
            assert m.tensors[name].raw_rows().tobytes() == t.raw_rows().tobytes(), name


def test_tied_token_embd_adapter_is_noted(tmp_path, tiny_vocab):
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab, tied=True, n_layer=1)
    adapter = make_adapter(base, ["token_embd.weight"])
    report = export_lora(base, [(saved(tmp_path, adapter), 1.0)], tmp_path / "m.gguf")
    assert any("ties output to token_embd" in n for n in report.notes)


def test_multiple_adapters_norms_and_flipped_token_embd(tmp_path, tiny_vocab):
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab)
    a1 = make_adapter(base, ["blk.0.attn_q.weight", "blk.0.attn_norm.weight", "token_embd.weight"], seed=1)
    a2 = make_adapter(base, ["blk.0.attn_q.weight", "blk.1.ffn_up.weight", "output_norm.weight"],
                      rank=2, alpha=0.0, seed=2)
    p1, p2 = saved(tmp_path, a1, "a1.gguf"), saved(tmp_path, a2, "a2.gguf")
    report = export_lora(base, [(p1, 0.5), (p2, -1.5)], tmp_path / "m.gguf")
    assert len(report.notes) == 2 and "does not adapt 2 tensor(s)" in report.notes[0]
    b, m = GGUFFile(base), GGUFFile(tmp_path / "m.gguf")
    s1, s2 = 0.5 * 8.0 / 4, -1.5                                  # alpha 0: user scale alone
    terms = {n: [(*a1.pairs[n], s1)] for n in a1.pairs}
    for n in a2.pairs:
        terms.setdefault(n, []).append((*a2.pairs[n], s2))
    assert set(report.merged) == set(terms)
    for name, ts in terms.items():
        np.testing.assert_array_equal(f32(m.tensors[name]), exact_merge(b.tensors[name], ts))
    # the norm and token_embd formulas spelled out
    w, (a, bb) = np.array(b.tensors["output_norm.weight"].data), a2.pairs["output_norm.weight"]
    np.testing.assert_array_equal(m.tensors["output_norm.weight"].data, w + np.float32(s2) * (bb @ a)[0])
    (a, bb), tok = a1.pairs["token_embd.weight"], 17
    row = b.tensors["token_embd.weight"].data[tok] + np.float32(s1) * (a[tok] @ bb.T)
    np.testing.assert_allclose(m.tensors["token_embd.weight"].data[tok], row, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("outtype, qtype", [("f16", QType.F16), ("q8_0", QType.Q8_0)])
def test_explicit_outtype_converts_every_matrix(tmp_path, tiny_vocab, outtype, qtype):
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab)
    adapter = make_adapter(base, ["blk.1.ffn_down.weight", "blk.0.ffn_norm.weight"])
    report = export_lora(base, [(saved(tmp_path, adapter), 1.0)], tmp_path / "m.gguf", outtype=outtype)
    b, m = GGUFFile(base), GGUFFile(tmp_path / "m.gguf")
    assert report.merged == {"blk.1.ffn_down.weight": qtype.name, "blk.0.ffn_norm.weight": "F32"}
    assert m.get("general.file_type") == {"f16": 1, "q8_0": 7}[outtype]
    assert meta(m, drop={"general.file_type"}) == meta(b, drop={"general.file_type"})
    assert m.kvs["general.file_type"].vtype == b.kvs["general.file_type"].vtype
    n_mats = sum(len(t.shape) == 2 for t in b.tensors.values())
    assert report.n_converted == n_mats - 1 and report.n_copied == len(b.tensors) - n_mats - 1
    for name, t in b.tensors.items():
        want = exact_merge(t, [(*adapter.pairs[name], 2.0)]) if name in adapter.pairs else f32(t)
        got = m.tensors[name]
        if len(t.shape) == 1:
            assert got.qtype == QType.F32
            np.testing.assert_array_equal(f32(got), want)
        else:
            assert got.qtype == qtype
            np.testing.assert_array_equal(got.raw_rows(), quantize(want, qtype))


def test_outtype_fallback_and_same_type_copy(tmp_path, tiny_vocab):
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab, outtype=QType.Q8_0)   # 64/96 columns
    adapter = make_adapter(base, ["blk.0.attn_v.weight"])
    report = export_lora(base, [(saved(tmp_path, adapter), 1.0)], tmp_path / "m.gguf", outtype="q4_k")
    m = GGUFFile(tmp_path / "m.gguf")
    assert report.merged == {"blk.0.attn_v.weight": "Q8_0"} and report.n_converted == 0
    assert m.get("general.file_type") == 15 and any("do not fit Q4_K" in n for n in report.notes)
    assert {t.qtype for t in m.tensors.values() if len(t.shape) == 2} == {QType.Q8_0}


def test_merge_into_undequantizable_tensor_is_an_error(tmp_path, tiny_vocab):
    base_f = GGUFFile(write_tiny_model(tmp_path / "b0.gguf", tiny_vocab))
    odd = TensorOut("odd.weight", (2, 256), QType.Q8_K, lambda: np.zeros((2, 292), np.uint8))
    tensors = [tensor_out(n, np.array(t.data)) for n, t in base_f.tensors.items()] + [odd]
    write_gguf(tmp_path / "base.gguf", base_f.arch, base_f.kvs.values(), tensors)
    adapter = make_adapter(tmp_path / "base.gguf", ["odd.weight"])
    with pytest.raises(LlamatuneError, match="'odd.weight' has type Q8_K, which cannot be dequantized"):
        export_lora(tmp_path / "base.gguf", [(saved(tmp_path, adapter), 1.0)], tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()
    # unmerged, it is copied as is even with an explicit outtype
    ok = make_adapter(tmp_path / "base.gguf", ["blk.0.attn_q.weight"])
    report = export_lora(tmp_path / "base.gguf", [(saved(tmp_path, ok), 1.0)], tmp_path / "m.gguf", "f16")
    assert GGUFFile(tmp_path / "m.gguf").tensors["odd.weight"].qtype == QType.Q8_K
    assert any("odd.weight: type Q8_K cannot be converted" in n for n in report.notes)


def test_all_adapter_problems_in_one_error_and_nothing_written(tmp_path, tiny_vocab):
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab)
    other_arch = saved(tmp_path, make_adapter(base, ["blk.0.attn_q.weight"], arch="qwen2"), "arch.gguf")
    bad = make_adapter(base, ["blk.0.attn_k.weight"])
    bad.pairs["blk.0.attn_k.weight"] = (np.zeros((4, 63), np.float32), bad.pairs["blk.0.attn_k.weight"][1])
    wrong_shape = saved(tmp_path, bad, "shape.gguf")
    half = tmp_path / "half.gguf"
    write_gguf(half, "llama", [kv("general.type", "adapter"), kv("adapter.type", "lora")],
               [tensor_out("blk.0.attn_v.weight.lora_a", np.zeros((4, 64), np.float32))])
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n")
    specs = [(other_arch, 1.0), (wrong_shape, 1.0), (half, 1.0), (tmp_path / "missing.gguf", 1.0),
             (base, 1.0), (text, 1.0), (saved(tmp_path, make_adapter(base, ["output.weight"]), "ok.gguf"), 1.0)]
    cases = {"architecture 'qwen2' differs": specs[0], r"lora_a \(4, 63\) / lora_b": specs[1],
             "'blk.0.attn_v.weight' has no .lora_b": specs[2], "missing.gguf: file not found": specs[3],
             "base.gguf: not a LoRA adapter": specs[4], "notes.txt: not a GGUF file": specs[5]}
    for pattern, spec in cases.items():                          # each alone
        with pytest.raises(LlamatuneError, match=pattern):
            export_lora(base, [spec], tmp_path / "out.gguf")
    with pytest.raises(LlamatuneError, match=r"6 problem\(s\), nothing written") as err:   # all at once
        export_lora(base, specs, tmp_path / "out.gguf")
    for pattern in cases:
        assert len(re.findall(pattern, str(err.value))) == 1, pattern
    assert sorted(p.name for p in tmp_path.iterdir() if "out" in p.name) == []


def test_an_adapter_of_another_model_gets_a_short_line(tmp_path, tiny_vocab):
    """Every tensor of an adapter made for a wider model misfits: the error names the
    first three problems and counts the rest."""
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab)
    wide = write_tiny_model(tmp_path / "wide.gguf", tiny_vocab, n_embd=128)
    names = [n for n in GGUFFile(wide).tensors if n.endswith(("attn_q.weight", "attn_k.weight", "ffn_up.weight"))]
    adapter = saved(tmp_path, make_adapter(wide, names), "wide-adapter.gguf")
    with pytest.raises(LlamatuneError) as err:
        export_lora(base, [(adapter, 1.0)], tmp_path / "out.gguf")
    problems = [f"'{n}': lora_a" for n in names]
    message = str(err.value)
    assert [p in message for p in problems] == [True] * 3 + [False] * (len(names) - 3)
    assert message.endswith(f"; and {len(names) - 3} more") and len(names) > 4
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize("call, pattern", [
    (lambda d: export_lora(d / "base.gguf", [(d / "a.gguf", 1.0)], d / "out.gguf", outtype="q9"),
     "unknown output type 'q9'"),
    (lambda d: export_lora(d / "base.gguf", [], d / "out.gguf"), "no adapters given"),
    (lambda d: export_lora(d / "a.gguf", [(d / "a.gguf", 1.0)], d / "out.gguf"), "is a LoRA adapter, not a model"),
    (lambda d: export_lora(d / "base.gguf", [(d / "a.gguf", 1.0)], d / "base.gguf"),
     "would overwrite the input --model-base"),
    (lambda d: export_lora(d / "base.gguf", [(d / "a.gguf", 1.0)], d / "a.gguf"), "would overwrite the input --lora"),
    (lambda d: export_lora(d / "base.gguf", [(d / "a.gguf", float("nan"))], d / "out.gguf"), "not a finite"),
    (lambda d: export_lora(d / "nope.gguf", [(d / "a.gguf", 1.0)], d / "out.gguf"), "nope.gguf: file not found"),
])
def test_argument_errors(tmp_path, tiny_vocab, call, pattern):
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab, n_layer=1)
    saved(tmp_path, make_adapter(base, ["blk.0.attn_q.weight"]))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(LlamatuneError, match=pattern):
        call(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
