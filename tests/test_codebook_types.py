"""Base models whose matrices are MXFP4, IQ4_NL or IQ4_XS (the types of people's
mixture-of-experts files): they load through the numba kernels (no fallback notice),
infer and LoRA-train (f32 and bf16 products) exactly as the same model with those
matrices dequantized by the gguf package and stored as F32, and export-lora merges into
them in their own types: MXFP4 through the gguf package's quantizer, IQ4_NL and IQ4_XS
through kernels/quantize_iq4.py (both llama.cpp's byte for byte)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from conftest import TEXT, write_tiny_model
from llamatune.commands.export import export_lora
from llamatune.formats.adapter import LoraAdapter, expected_shapes, write_adapter
from llamatune.formats.gguf_io import GGUFFile, tensor_out, write_gguf
from llamatune.kernels.quantize import quantize
from llamatune.models.infer import Runner
from llamatune.models.model import Model
from llamatune.options import MergeOptions

TYPES = [QType.MXFP4, QType.IQ4_NL, QType.IQ4_XS]
KCFG = dict(n_embd=256, n_ff=512, head_dim=64, n_rot=64, n_head=4, n_head_kv=2, n_layer=1)  # rows of 256s
KV_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _nearest_codes(x, d):
    """4-bit codes (n, 32) of IQ4_NL's table nearest x / d, packed as ggml packs them:
    value j in the low nibble of byte j, value j + 16 in its high nibble."""
    q = np.abs(x[:, :, None] - d[:, None, None] * KV_IQ4NL).argmin(-1).astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def iq4_blocks(w: np.ndarray, qtype: QType) -> np.ndarray:
    """A simple round-to-nearest encoding of f32 rows in IQ4_NL or IQ4_XS blocks (test
    data only: one scale from the block's largest value, the nearest code per value)."""
    n_rows = w.shape[0]
    x = w.reshape(-1, 32).astype(np.float32)
    amax = np.abs(x).max(1)
    if qtype == QType.IQ4_NL:
        d = (amax / 127).astype(np.float16)
        blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), _nearest_codes(x, d.astype(np.float32))], 1)
        return blocks.reshape(n_rows, -1)
    d = (amax.reshape(-1, 8).max(1) / (127 * 31)).astype(np.float16)                  # per 256
    ls = np.clip(np.round(amax.reshape(-1, 8) / (127 * d.astype(np.float32)[:, None])), 0, 31).astype(np.int64) + 32
    dl = d.astype(np.float32)[:, None] * (ls - 32).astype(np.float32)
    qs = _nearest_codes(x, dl.reshape(-1)).reshape(-1, 128)
    scales_h = sum(((ls[:, k] >> 4) & 3) << (2 * k) for k in range(8)).astype("<u2")
    scales_l = ((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)).astype(np.uint8)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), scales_h.view(np.uint8).reshape(-1, 2), scales_l, qs], 1)
    return blocks.reshape(n_rows, -1)


def encode(w: np.ndarray, qtype: QType) -> np.ndarray:
    if qtype == QType.MXFP4:
        return gguf.quants.quantize(w, qtype)
    return iq4_blocks(w, qtype)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_vocab):
    """{qtype: (model with the layer's matrices in qtype, its F32 twin)}."""
    tmp = tmp_path_factory.mktemp("codebook")
    f = GGUFFile(write_tiny_model(tmp / "base.gguf", tiny_vocab, **KCFG))
    out = {}
    for qtype in TYPES:
        typed, twin = [], []
        for n, t in f.tensors.items():
            w = np.array(t.data, np.float32).reshape(t.shape)
            if n.startswith("blk.") and w.ndim == 2:
                raw = encode(w, qtype)
                typed.append(tensor_out(n, raw, qtype))
                twin.append(tensor_out(n, gguf.quants.dequantize(raw, qtype).reshape(w.shape)))
            else:
                typed.append(tensor_out(n, w))
                twin.append(tensor_out(n, w))
        paths = tmp / f"{qtype.name}.gguf", tmp / f"{qtype.name}-f32.gguf"
        for p, tensors in zip(paths, (typed, twin)):
            write_gguf(p, f.arch, f.kvs.values(), tensors)
        out[qtype] = paths
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_model_infers_as_its_dequantized_twin(models, qtype, capsys):
    path, twin = models[qtype]
    model = Model(path)
    assert "no fast kernel" not in capsys.readouterr().err
    assert model.weights.layers[0].mats["ffn_down"].qtype == qtype
    tokens = np.array([[1, 17, 42, 399, 5, 300, 7, 8]])
    logits = Runner(model).forward(tokens)
    want = Runner(Model(twin)).forward(tokens)
    assert np.isfinite(logits).all()
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)


def _adapter(base: GGUFFile, names, path):
    rng = np.random.default_rng(1)
    adapter = LoraAdapter(base.arch, 8.0)
    for n in names:
        a_shape, b_shape = expected_shapes(n, base.tensors[n].shape, 4)
        adapter.pairs[n] = (rng.normal(0, 0.1, a_shape).astype(np.float32), rng.normal(0, 0.1, b_shape).astype(np.float32))
    write_adapter(path, adapter)
    return adapter


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_export_merges_into_the_type(models, tmp_path, qtype):
    """The plain merge re-quantizes to the base's type: MXFP4 (the gguf package's quantizer,
    ggml's quantize_row_mxfp4_ref), IQ4_NL and IQ4_XS (ggml's quantize_iq4_nl / _xs), no
    note. Unmerged tensors keep their bytes."""
    path, twin = models[qtype]
    base = GGUFFile(path)
    names = ["blk.0.attn_q.weight", "blk.0.ffn_down.weight"]
    adapter = _adapter(base, names, tmp_path / "a.gguf")
    report = export_lora(path, [(tmp_path / "a.gguf", 1.0)], tmp_path / "m.gguf",
                         merge=MergeOptions(merge_method="plain"))
    assert report.merged == {n: qtype.name for n in names}
    assert not any("cannot be re-quantized" in note for note in report.notes)
    merged, f32 = GGUFFile(tmp_path / "m.gguf"), GGUFFile(twin)
    for n, t in merged.tensors.items():
        if n in names:
            a, b = adapter.pairs[n]
            want = np.array(f32.tensors[n].data).reshape(t.shape) + np.float32(2.0) * (b @ a)
            assert t.qtype == qtype
            np.testing.assert_array_equal(t.raw_rows(), quantize(want, qtype))
        else:
            assert t.qtype == base.tensors[n].qtype
            assert t.raw_rows().tobytes() == base.tensors[n].raw_rows().tobytes(), n


def test_export_compensated_merge_into_mxfp4(models, tmp_path):
    """The default (compensated) merge into MXFP4, here without statistics: the type kept,
    per block the base's code or a new one, whichever is closer, so nearer the merged
    weights than the base; a zero adapter gives back the base's bytes."""
    path, twin = models[QType.MXFP4]
    base, f32 = GGUFFile(path), GGUFFile(twin)
    name = "blk.0.ffn_down.weight"
    adapter = _adapter(base, [name], tmp_path / "a.gguf")
    export_lora(path, [(tmp_path / "a.gguf", 1.0)], tmp_path / "m.gguf")
    t = GGUFFile(tmp_path / "m.gguf").tensors[name]
    assert t.qtype == QType.MXFP4
    a, b = adapter.pairs[name]
    want = np.array(f32.tensors[name].data).reshape(t.shape) + np.float32(2.0) * (b @ a)
    got = gguf.quants.dequantize(t.raw_rows(), QType.MXFP4).reshape(t.shape)
    old = np.array(f32.tensors[name].data).reshape(t.shape)
    assert np.square(got - want).sum() < np.square(old - want).sum()
    code = gguf.quants.dequantize(base.tensors[name].raw_rows(), QType.MXFP4).reshape(t.shape)
    e_new, e_base = (np.square(x - want).reshape(-1, 32).sum(1) for x in (got, code))   # per 32-weight block
    assert np.all(e_new <= e_base) and np.any(e_new < e_base)
    export_lora(path, [(tmp_path / "a.gguf", 0.0)], tmp_path / "z.gguf")
    assert GGUFFile(tmp_path / "z.gguf").tensors[name].raw_rows().tobytes() == base.tensors[name].raw_rows().tobytes()


@pytest.mark.parametrize("qtype,dtype", [(QType.MXFP4, "bf16")] + [    # 10-20 s each on two busy cores
    pytest.param(q, d, marks=pytest.mark.slow) for q, d in [(QType.MXFP4, "f32"), (QType.IQ4_XS, "f32"),
                                                            (QType.IQ4_XS, "bf16")]], ids=lambda v: getattr(v, "name", v))
def test_lora_training_equals_its_dequantized_twin(models, tmp_path, qtype, dtype):
    """Three LoRA steps on the model and on its F32 twin give the same losses, bit for
    bit: in f32 the weights are the same floats; in bf16 the kernels' rounding on the
    way out of the dequantization equals the twin's rounding of its floats."""
    from llamatune.commands.finetune import finetune
    from llamatune.kernels import bf16
    from llamatune.options import FinetuneOptions
    if dtype == "bf16" and bf16.unavailable_reason() is not None:
        pytest.skip(f"bf16 products: {bf16.unavailable_reason()}")
    (tmp_path / "train.txt").write_text(TEXT)
    losses = []
    for model in models[qtype]:
        out = tmp_path / model.stem
        out.mkdir(exist_ok=True)
        res = finetune(FinetuneOptions(model_base=model, train_data=tmp_path / "train.txt", ctx=16, batch=2, lora_r=2,
                                       adam_iter=3, save_every=0, warmup=1, lora_dropout=0.0, compute_dtype=dtype,
                                       checkpoint_out=out / "chk-ITERATION.gguf",
                                       lora_out=out / "adapter-ITERATION.gguf"), quiet=True)
        losses.append(res.losses)
    assert np.isfinite(losses[0]).all() and len(losses[0]) == 3
    np.testing.assert_array_equal(losses[0], losses[1])


def test_full_finetune_writes_mxfp4_back_as_mxfp4(models, tmp_path):
    """A full finetune of an MXFP4 base writes every tensor in the base's type (its trained
    MXFP4 matrices re-quantized, changed by the step), and the model it writes runs."""
    from llamatune.commands.finetune import finetune
    from llamatune.options import FinetuneOptions
    path, _ = models[QType.MXFP4]
    (tmp_path / "train.txt").write_text(TEXT)
    finetune(FinetuneOptions(model_base=path, train_data=tmp_path / "train.txt", ctx=16, batch=2, adam_iter=1,
                             save_every=0, warmup=1, fine_tune_type="full", adam_alpha=1e-3,
                             checkpoint_out=tmp_path / "chk-ITERATION.gguf",
                             model_out=tmp_path / "model-ITERATION.gguf"), quiet=True)
    out = GGUFFile(next(tmp_path.glob("model-*.gguf")))
    base = GGUFFile(path)
    for n, t in base.tensors.items():
        assert out.tensors[n].qtype == t.qtype, n
    assert out.tensors["blk.0.ffn_down.weight"].raw_rows().tobytes() != base.tensors["blk.0.ffn_down.weight"].raw_rows().tobytes()
    assert np.isfinite(Runner(Model(out.path)).forward(np.array([[1, 17, 42, 7]]))).all()
