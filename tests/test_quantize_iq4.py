"""Tests of kernels/quantize_iq4.py, the IQ4_NL and IQ4_XS quantizers: byte for byte
llama.cpp's (through libggml-base's ggml_quantize_chunk where the library is found:
LLAMA_BIN_DIR, or the folder of llama-perplexity on PATH; golden digests of its output
otherwise), the numpy reference equal to the kernel, the round trip through our
dequantizer, and the dispatch from quantize / quantize_weighted."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from llamatune.kernels.dequant import dequantize
from llamatune.kernels.quantize import QUANTIZABLE, quantize
from llamatune.kernels.quantize_iq4 import KVALUES_IQ4NL, quantize_iq4, quantize_iq4_ref
from llamatune.kernels.quantize_weighted import WEIGHTED, quantize_weighted
from test_merge_quant import weights
from test_op_quantize import rt_data

TYPES = [T.IQ4_NL, T.IQ4_XS]
KV = KVALUES_IQ4NL.astype(np.float32)

# sha256[:16] of ggml_quantize_chunk(type, rt_data(), ..., imatrix) from libggml-base
# (llama.cpp's build, ggml-quants.c without FMA contraction): no imatrix / weights()
GOLDEN_SHA256 = {(T.IQ4_NL, False): "498ee061ea12fd81", (T.IQ4_NL, True): "c04add30ee7b95d5",
                 (T.IQ4_XS, False): "4372139c4b55637d", (T.IQ4_XS, True): "fa34a60df199f83c"}


def llama_bin_dir() -> Path | None:
    if os.environ.get("LLAMA_BIN_DIR"):
        return Path(os.environ["LLAMA_BIN_DIR"])
    tool = shutil.which("llama-perplexity")
    return Path(tool).parent if tool else None


def libggml():
    d = llama_bin_dir()
    lib = d / "libggml-base.so" if d else None
    if lib is None or not lib.exists():
        pytest.skip("llama.cpp's libggml-base.so not found (set LLAMA_BIN_DIR to its build/bin)")
    c = ctypes.CDLL(str(lib))
    c.ggml_quantize_chunk.restype = ctypes.c_size_t
    c.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    c.quantize_row_iq4_nl_ref.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return c


def ggml_quantize(lib, x, qtype, qw=None):
    x = np.ascontiguousarray(x, np.float32)
    block, size = GGML_QUANT_SIZES[qtype]
    out = np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8)
    n = lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1],
                                None if qw is None else qw.ctypes.data)
    assert n == out.size
    return out


def hard_data(n_cols=1024):
    """Rows of every kind: heavy tails at scales 1e-8 .. 1e4, integers (ties between
    codes), one non-zero value per row, constants, exact table values, zero blocks,
    a whole zero row and values below ggml's 1e-15 zero threshold."""
    rng = np.random.default_rng(0)
    one = np.zeros((16, n_cols))
    one[np.arange(16), rng.integers(0, n_cols, 16)] = rng.standard_normal(16)
    parts = [rng.standard_t(3, (32, n_cols)) * 0.02,
             rng.standard_normal((32, n_cols)) * np.exp(rng.uniform(-18, 9, (32, 1))),
             np.round(rng.standard_normal((32, n_cols)) * 20), one,
             np.full((4, n_cols), 0.37), np.full((4, n_cols), -2.0 ** -10),
             KV[rng.integers(0, 16, (16, n_cols))] * 0.001]
    x = np.concatenate(parts).astype(np.float32)
    x[0, :256] = 0
    x[1, 32:64] = 0
    x[2] = 0
    x[3, 64:96] = 1e-20
    return x


def block_bytes(q, qtype):
    return q.reshape(-1, GGML_QUANT_SIZES[qtype][1])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matches_libggml(qtype):
    """ggml_quantize_chunk with and without an importance matrix (one with a zero and
    one of all ones): every block of hard_data() the same bytes."""
    lib = libggml()
    x = hard_data()
    qw = weights(1024)
    for w in (None, qw, np.ones(1024, np.float32)):
        want = ggml_quantize(lib, x, qtype, w)
        got = quantize_iq4(x, qtype, w)
        same = (block_bytes(got, qtype) == block_bytes(want, qtype)).all(1)
        assert same.all(), f"{qtype.name} weights={w is not None}: {np.flatnonzero(~same)[:8]} differ"
    for w in (None, weights()):
        digest = hashlib.sha256(ggml_quantize(lib, rt_data(), qtype, w).tobytes()).hexdigest()[:16]
        assert digest == GOLDEN_SHA256[qtype, w is not None]


def test_nl_ref_matches_libggml():
    """quantize_row_iq4_nl_ref (no scale search) on rows without an all-zero block (where
    the C code reads stale codes)."""
    lib = libggml()
    x = hard_data()[:120]
    x = x[np.all(np.abs(x.reshape(x.shape[0], -1, 32)).max(2) >= 1e-15, axis=1)]
    want = np.zeros((x.shape[0], 1024 // 32 * 18), np.uint8)
    for i in range(x.shape[0]):
        lib.quantize_row_iq4_nl_ref(x[i].ctypes.data, want[i].ctypes.data, 1024)
    np.testing.assert_array_equal(quantize_iq4(x, T.IQ4_NL, ntry=-1), want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("weighted", [False, True])
def test_golden_digests(qtype, weighted):
    q = quantize_iq4(rt_data(), qtype, weights() if weighted else None)
    assert hashlib.sha256(q.tobytes()).hexdigest()[:16] == GOLDEN_SHA256[qtype, weighted]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_reference_equals_kernel(qtype):
    x = hard_data()
    for w, ntry in ((None, 7), (weights(1024), 7), (None, -1), (weights(1024), -1)):
        np.testing.assert_array_equal(quantize_iq4(x, qtype, w, ntry), quantize_iq4_ref(x, qtype, w, ntry))


def _scales(q, qtype):
    """Per-value scale of the stored blocks (n_values,): d, or d * (ls - 32) for IQ4_XS."""
    b = block_bytes(q, qtype)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    if qtype == T.IQ4_NL:
        return np.repeat(d, 32)
    h = b[:, 2:4].copy().view("<u2")[:, 0].astype(np.int64)
    ls = np.stack([((b[:, 4 + k // 2] >> (4 * (k % 2))) & 15) | (((h >> (2 * k)) & 3) << 4)
                   for k in range(8)], 1).astype(np.int64)
    return np.repeat(d[:, None] * (ls - 32).astype(np.float32), 32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_round_trip_takes_the_nearest_code(qtype):
    """Through our dequantizer: blocks made of table values times powers of two come
    back exactly; on random blocks every value's error is the least over the 16 codes
    at its block's stored scale (up to the f16 rounding of that scale: ggml picks the
    codes with the unrounded one)."""
    rng = np.random.default_rng(7)
    n = GGML_QUANT_SIZES[qtype][0]
    codes = rng.integers(0, 16, (64, 2 * n))
    codes[:, ::32] = 0                                    # -127: the largest |x| of each 32
    sub = 2.0 ** -rng.integers(3, 12, (64, 2 * n // 32))  # a power of two per 32 values
    if qtype == T.IQ4_XS:                                 # XS: of 2^-8 * l, l in -32..16
        sub = np.clip(sub, 2.0 ** -8, 2.0 ** -4) * np.where(rng.random(sub.shape) < 0.5, -1.0, 1.0)
        sub[:, ::8] = -2.0 ** -3                          # the largest: l = -32, d = 2^-8
    exact = (KV[codes] * np.repeat(sub, 32, axis=1)).astype(np.float32)
    np.testing.assert_array_equal(dequantize(quantize_iq4(exact, qtype), qtype, 2 * n), exact)
    x = (rng.standard_t(4, (64, 2 * n)) * 0.05).astype(np.float32)
    q = quantize_iq4(x, qtype)
    err = np.abs(dequantize(q, qtype, 2 * n) - x).reshape(-1)
    s = _scales(q, qtype)
    best = np.abs(s[:, None] * KV[None, :] - x.reshape(-1, 1)).min(1)
    assert np.all(err <= best + np.abs(s) * 128 * 2.0 ** -10)
    assert np.mean(err == best) > 0.99


def test_dispatch_and_errors():
    """quantize and quantize_weighted run these kernels (export-lora, full finetunes and
    the compensated merge keep the types); bad arguments are refused by name."""
    x, qw = rt_data(), weights()
    assert {T.IQ4_NL, T.IQ4_XS} <= QUANTIZABLE and {T.IQ4_NL, T.IQ4_XS} <= WEIGHTED
    for qtype in TYPES:
        np.testing.assert_array_equal(quantize(x, qtype), quantize_iq4(x, qtype))
        np.testing.assert_array_equal(quantize(x, qtype.name), quantize_iq4(x, qtype))
        np.testing.assert_array_equal(quantize_weighted(x, qtype, qw), quantize_iq4(x, qtype, qw))
        np.testing.assert_array_equal(quantize_weighted(x, qtype, None), quantize_iq4(x, qtype))
    with pytest.raises(ValueError, match="IQ4_XS: row length 288 is not a multiple of 256"):
        quantize(x[:, :288], T.IQ4_XS)
    with pytest.raises(ValueError, match=r"IQ4_XS: expected \(n_rows, n_cols\) with n_cols a multiple of 256"):
        quantize_iq4(x[:, :288], T.IQ4_XS)
    with pytest.raises(ValueError, match="IQ4_NL: importance weights of shape"):
        quantize_iq4(x, T.IQ4_NL, weights(256))
    with pytest.raises(ValueError, match="is not IQ4_NL or IQ4_XS"):
        quantize_iq4(x, T.Q4_0)
    assert quantize_iq4(np.zeros((0, 256), np.float32), T.IQ4_XS).shape == (0, 136)


@pytest.fixture(scope="module")
def iq4_xs_model(tmp_path_factory, tiny_vocab):
    """(IQ4_XS model quantized here, a seeded adapter on its matrices, text): llama's
    layer at rows of 256."""
    from conftest import TEXT, write_tiny_model
    from llamatune.formats.adapter import LoraAdapter, expected_shapes, write_adapter
    from llamatune.formats.gguf_io import GGUFFile, tensor_out, write_gguf
    tmp = tmp_path_factory.mktemp("iq4xs")
    f = GGUFFile(write_tiny_model(tmp / "f32.gguf", tiny_vocab, n_embd=256, n_ff=512, head_dim=64, n_rot=64,
                                  n_head=4, n_head_kv=2, n_layer=1))
    tensors = []
    for n, t in f.tensors.items():
        w = np.array(t.data, np.float32).reshape(t.shape)
        typed = n.startswith("blk.") and w.ndim == 2
        tensors.append(tensor_out(n, quantize_iq4(w, T.IQ4_XS), T.IQ4_XS) if typed else tensor_out(n, w))
    write_gguf(tmp / "xs.gguf", f.arch, f.kvs.values(), tensors)
    rng = np.random.default_rng(1)
    adapter = LoraAdapter(f.arch, 8.0)
    for n, t in GGUFFile(tmp / "xs.gguf").tensors.items():
        if t.qtype == T.IQ4_XS:
            a_shape, b_shape = expected_shapes(n, t.shape, 4)
            adapter.pairs[n] = (rng.normal(0, 0.1, a_shape).astype(np.float32),
                                rng.normal(0, 0.1, b_shape).astype(np.float32))
    write_adapter(tmp / "a.gguf", adapter)
    (tmp / "text.txt").write_text(TEXT)
    return tmp / "xs.gguf", tmp / "a.gguf", tmp / "text.txt"


def _llama_perplexity(model: Path, text: Path) -> float | None:
    """llama-perplexity's figure at -c 32 (--no-repack: IQ4_XS files crash its CPU repacking
    otherwise), None where the tool is absent."""
    import re
    import subprocess
    d = llama_bin_dir()
    if d is None or not (d / "llama-perplexity").exists():
        return None
    r = subprocess.run([str(d / "llama-perplexity"), "--no-repack", "-m", str(model), "-f", str(text),
                        "-c", "32", "-b", "32", "-t", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return float(re.findall(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)[-1])


@pytest.mark.parametrize("merge_method", ["plain", pytest.param("calibrated", marks=pytest.mark.slow)])
def test_export_lora_keeps_iq4_xs(iq4_xs_model, tmp_path, merge_method):
    """export-lora into an IQ4_XS model writes its merged matrices as IQ4_XS, with no note;
    the merged model's perplexity is the run-time adapter's within 5 % (random adapter:
    850 -> 1084; plain merge 1063, calibrated 1035), and llama-perplexity loads the file
    and scores it as llamatune does, within 1 % (measured 0.3 %, 0.04 %)."""
    from llamatune.commands.export import export_lora
    from llamatune.commands.perplexity import perplexity
    from llamatune.formats.adapter import load_runtime_adapters
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.models.infer import Runner
    from llamatune.models.model import Model
    from llamatune.options import MergeOptions
    from conftest import TEXT
    base, adapter, text = iq4_xs_model
    merge = MergeOptions(merge_method="plain") if merge_method == "plain" else \
        MergeOptions(calibration_data=text, calibration_ctx=32)
    report = export_lora(base, [(adapter, 1.0)], tmp_path / "m.gguf", merge=merge)
    assert report.merged and set(report.merged.values()) == {"IQ4_XS"}
    assert not any("cannot be re-quantized" in n for n in report.notes)
    merged = GGUFFile(tmp_path / "m.gguf")
    assert all(merged.tensors[n].qtype == T.IQ4_XS for n in report.merged)
    model = Model(base)
    runtime = perplexity(Runner(model, load_runtime_adapters(model, [(str(adapter), 1.0)])), TEXT, 32, 32).ppl
    ppl = perplexity(Runner(Model(tmp_path / "m.gguf")), TEXT, 32, 32).ppl
    assert ppl == pytest.approx(runtime, rel=0.05)
    cpp = _llama_perplexity(tmp_path / "m.gguf", text)
    if cpp is not None:
        assert cpp == pytest.approx(ppl, rel=0.01)
