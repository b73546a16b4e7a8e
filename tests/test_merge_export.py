"""export-lora's compensated merge: no harm (a zero adapter keeps the base's bytes),
closer to the adapter than round to nearest, input statistics (collector, passes,
llama.cpp's imatrix GGUF), the Ollama Modelfile and the option errors."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from conftest import write_tiny_model
from llamatune.commands.export import export_lora
from llamatune.errors import LlamatuneError
from llamatune.formats.adapter import load_runtime_adapters
from llamatune.formats.gguf_io import GGUFFile
from llamatune.formats.imatrix import check_against, read_imatrix, write_imatrix
from llamatune.formats.ollama import modelfile_text
from llamatune.kernels.compensate import DAMP, quantize_compensated
from llamatune.kernels.dequant import dequantize
from llamatune.models.calibration import Calibration, InputStats, calibration_windows
from llamatune.models.infer import Runner
from llamatune.models.model import Model
from llamatune.options import MergeOptions
from test_export import KCFG, MATS, exact_merge, make_adapter, saved

TEXT = " ".join(f"the {w} of the {v} is {n} and {w} and {v} went to the {n} again."
                for w, v, n in zip(["king", "queen", "night", "sword", "crown", "field"] * 12,
                                   ["sea", "land", "wind", "rose", "house", "horse"] * 12,
                                   ["one", "two", "three", "four", "five", "six", "seven", "eight"] * 9))
CAL = dict(calibration_ctx=32, calibration_chunks=6)


def zero_adapter(base, names):
    adapter = make_adapter(base, names)
    for n, (a, b) in adapter.pairs.items():
        adapter.pairs[n] = (a, np.zeros_like(b))
    return adapter


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q5_1, QType.Q8_0, QType.Q3_K, QType.Q4_K, QType.Q6_K],
                         ids=lambda q: q.name)
def test_zero_adapter_gives_back_the_base_bytes(tmp_path, tiny_vocab, qtype):
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab, outtype=qtype, **KCFG)
    path = saved(tmp_path, zero_adapter(base, MATS + ["output.weight", "token_embd.weight"]))
    runs = [MergeOptions()] + ([MergeOptions(calibration_data=_text(tmp_path), **CAL)] if qtype == QType.Q4_K else [])
    for i, opts in enumerate(runs):
        report = export_lora(base, [(path, 1.0)], tmp_path / f"m{i}.gguf", merge=opts)
        assert len(report.merged) == len(MATS) + 2
        b, m = GGUFFile(base), GGUFFile(tmp_path / f"m{i}.gguf")
        for name, t in b.tensors.items():
            assert m.tensors[name].raw_rows().tobytes() == t.raw_rows().tobytes(), (name, opts)


def _text(tmp_path):
    p = tmp_path / "cal.txt"
    p.write_text(TEXT, encoding="utf-8")
    return p


def _logit_error(model_path, reference, tokens):
    return float(np.sum((Runner(Model(model_path)).forward(tokens) - reference) ** 2))


def test_compensated_merge_is_closer_to_the_adapter(tmp_path, tiny_vocab):
    """On text like the calibration text, the compensated merge's logits are closer to
    the run-time adapter's than round to nearest's, and the imatrix route lies between."""
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab, outtype=QType.Q4_0, **KCFG)
    adapter = make_adapter(base, MATS, rank=8, alpha=16.0, seed=3)
    for a, b in adapter.pairs.values():
        b *= 0.3
    path = saved(tmp_path, adapter)
    model = Model(base)
    tokens = calibration_windows(model.tokenizer, TEXT[::-1] + TEXT, 32, 4, "text")[-2:]
    reference = Runner(model, load_runtime_adapters(model, [(str(path), 1.0)])).forward(tokens)
    cal = tmp_path / "cal.txt"
    cal.write_text(TEXT, encoding="utf-8")
    plain = MergeOptions(merge_method="plain")
    comp = MergeOptions(calibration_data=cal, imatrix_out=tmp_path / "im.gguf", **CAL)
    report = export_lora(base, [(path, 1.0)], tmp_path / "comp.gguf", merge=comp)
    assert report.statistics == "calibration" and report.n_calibration_passes == 1
    export_lora(base, [(path, 1.0)], tmp_path / "plain.gguf", merge=plain)
    export_lora(base, [(path, 1.0)], tmp_path / "imat.gguf", merge=MergeOptions(imatrix=tmp_path / "im.gguf"))
    err = {k: _logit_error(tmp_path / f"{k}.gguf", reference, tokens) for k in ("plain", "imat", "comp")}
    assert err["comp"] < 0.7 * err["plain"], err
    assert err["imat"] < err["plain"], err

    # the imatrix route is quantize_compensated with diag(H)^-1/2 and the file's importances
    im, name = read_imatrix(tmp_path / "im.gguf"), "blk.0.ffn_down.weight"
    t = GGUFFile(base).tensors[name]
    qw = im.importance(name)
    u = 1 / np.sqrt(qw.astype(np.float64) + DAMP * float(qw.mean()))
    want = quantize_compensated(exact_merge(t, [(*adapter.pairs[name], 2.0)]), QType.Q4_0, u, qw, t.raw_rows())
    np.testing.assert_array_equal(GGUFFile(tmp_path / "imat.gguf").tensors[name].raw_rows(), want)


def test_input_stats_and_imatrix_file(tmp_path, tiny_vocab):
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab, **KCFG)
    model = Model(base)
    seen: dict[str, list[np.ndarray]] = {}
    stats = InputStats(lambda n: n.startswith("blk.0.attn"))

    def observe(name, x):
        seen.setdefault(name, []).append(np.array(x))
        stats(name, x)
    runner = Runner(model)
    runner.observer = observe
    tokens = np.array([[1, 17, 42, 399, 5, 300, 7, 8], [3, 4, 5, 6, 7, 8, 9, 10]])
    runner.forward(tokens[:1])
    runner.forward(tokens[1:])
    assert stats.key["blk.0.attn_k.weight"] == stats.key["blk.0.attn_v.weight"] == "blk.0.attn_q.weight"
    assert stats.key["blk.0.ffn_up.weight"] == "blk.0.ffn_gate.weight"
    assert stats.key["blk.0.attn_output.weight"] == "blk.0.attn_output.weight"
    for name, xs in seen.items():
        x = np.concatenate(xs).astype(np.float64)
        key = stats.key[name]
        np.testing.assert_allclose(stats.sum_sq[key], (x * x).sum(0), rtol=1e-6)
        assert stats.count[key] == 16
        found = stats.hessian(name)
        if name.startswith("blk.0.attn"):
            np.testing.assert_allclose(found[1], x.T @ x / 16, rtol=1e-4, atol=1e-6)
        else:
            assert found is None
    im = stats.imatrix(["cal.txt"], 2, 8)
    write_imatrix(tmp_path / "im.gguf", im, "llama")
    f = GGUFFile(tmp_path / "im.gguf")
    assert f.get("general.type") == "imatrix" and f.get("imatrix.chunk_count") == 2
    assert f.tensors["blk.0.ffn_up.weight.in_sum2"].shape == (1, 256)
    back = read_imatrix(tmp_path / "im.gguf")
    assert back.datasets == ["cal.txt"] and back.chunk_size == 8 and set(back.sums) == set(seen)
    for name in seen:
        np.testing.assert_array_equal(back.sums[name], im.sums[name].astype(np.float32))
        assert back.counts[name] == 16
        np.testing.assert_allclose(back.importance(name), im.sums[name] / 16, rtol=1e-6)


def test_input_stats_bf16_second_moments():
    """The bf16 product of x^T x (f32 accumulation) over two calls, against float64,
    within the rounding of its factors: |error| <= 2^-7 |x|^T |x| entry by entry."""
    from llamatune.kernels import bf16
    if not bf16.available():
        pytest.skip(f"no oneDNN: {bf16.unavailable_reason()}")
    rng = np.random.default_rng(3)
    for n_in in (96, 1030):                                  # 1030: the upper blocks, mirrored
        xs = [rng.standard_normal((n, n_in)).astype(np.float32) * rng.uniform(0.1, 4, n_in).astype(np.float32)
              for n in (40, 17)]
        stats = InputStats(lambda n: True, bf16=True)
        for x in xs:
            stats("blk.0.ffn_down.weight", x)
        x = np.concatenate(xs).astype(np.float64)
        key, got = stats.hessian("blk.0.ffn_down.weight")
        assert key == "blk.0.ffn_down.weight" and got.shape == (n_in, n_in)
        k = n_in // 2
        if n_in >= 1024:
            assert np.array_equal(got[k:, :k], got[:k, k:].T)      # the mirrored block
        bound = 2.0 ** -7 * (np.abs(x).T @ np.abs(x)) / 57
        assert np.all(np.abs(got - x.T @ x / 57) <= bound)
        assert not np.array_equal(got, x.T @ x / 57)          # the rounding is real


def test_input_stats_block_diagonal():
    """With `block`, an input wider than the block keeps only the diagonal blocks of
    x^T x (the last one narrower), equal to those of the whole matrix; narrower inputs
    keep the whole matrix."""
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((n, 600)).astype(np.float32) for n in (30, 21)]
    whole, blocks = InputStats(lambda n: True), InputStats(lambda n: True, block=256)
    for x in xs:
        for stats in (whole, blocks):
            stats("blk.0.ffn_down.weight", x)
            stats("blk.0.attn_output.weight", x[:, :200])
    _, h = whole.hessian("blk.0.ffn_down.weight")
    _, got = blocks.hessian("blk.0.ffn_down.weight")
    assert [b.shape for b in got] == [(256, 256), (256, 256), (88, 88)]
    for b, (lo, hi) in zip(got, ((0, 256), (256, 512), (512, 600))):
        np.testing.assert_allclose(b, h[lo:hi, lo:hi], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(blocks.hessian("blk.0.attn_output.weight")[1],
                                  whole.hessian("blk.0.attn_output.weight")[1])
    assert blocks.hessian_bytes == 4 * (2 * 256 ** 2 + 88 ** 2 + 200 ** 2)


def test_export_with_calibration_blocks(tmp_path, tiny_vocab):
    """--calibration-block 256: ffn_down (512 inputs) is quantized with the factors of
    its two 256-column blocks, exactly as quantize_compensated does with them; the
    blocks are the whole second moment's diagonal blocks."""
    from llamatune.commands.export import _calibrate, _load_adapters
    from llamatune.kernels.compensate import inverse_cholesky
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab, outtype=QType.Q4_0, **KCFG)
    adapter = make_adapter(base, MATS, rank=8, alpha=16.0, seed=3)
    path = saved(tmp_path, adapter)
    opts = MergeOptions(calibration_data=_text(tmp_path), calibration_block=256, **CAL)
    export_lora(base, [(path, 1.0)], tmp_path / "blocks.gguf", merge=opts)
    f = GGUFFile(base)
    loaded = _load_adapters(f, [(path, 1.0)], tmp_path / "x.gguf")
    cal = _calibrate(f, loaded, opts, MATS, None)
    whole = _calibrate(f, loaded, MergeOptions(calibration_data=opts.calibration_data, calibration_block=0, **CAL),
                       MATS, None)
    name = "blk.0.ffn_down.weight"
    _, hb = cal.hessian(name)
    _, h = whole.hessian(name)
    assert len(hb) == 2
    for i, b in enumerate(hb):
        np.testing.assert_allclose(b, h[256 * i:256 * (i + 1), 256 * i:256 * (i + 1)], rtol=1e-6, atol=1e-9)
    t = f.tensors[name]
    want = quantize_compensated(exact_merge(t, [(*adapter.pairs[name], 2.0)]), QType.Q4_0,
                                inverse_cholesky(hb, dtype=np.float32), cal.imatrix("t").importance(name), t.raw_rows())
    np.testing.assert_array_equal(GGUFFile(tmp_path / "blocks.gguf").tensors[name].raw_rows(), want)


def test_calibration_in_several_passes_gives_the_same_moments(tmp_path, tiny_vocab):
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab, **KCFG)
    model = Model(base)
    windows = calibration_windows(model.tokenizer, TEXT, 32, 3, "text")
    ordered = MATS + ["output.weight"]
    one = Calibration(Runner(model), windows, ordered, budget=1 << 30)
    few = Calibration(Runner(model), windows, ordered, budget=4 * 512 * 512)      # ffn_down's alone
    for name in ordered:
        np.testing.assert_allclose(few.hessian(name)[1], one.hessian(name)[1], rtol=1e-5, atol=1e-7)
    assert one.n_passes == 1 and few.n_passes == 4           # (q k v o), (gate up), (down), (output)
    assert one.imatrix("t").counts == few.imatrix("t").counts


def test_later_passes_start_at_their_layer(tmp_path, tiny_vocab):
    """Passes of one layer each (3 layers) resume from the residual stream kept at the
    layer where the previous pass stopped: the same second moments, bit for bit, as one
    pass, and each layer's forward runs once per pass that needs it, not from layer 0."""
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab, **dict(KCFG, n_layer=3))
    model = Model(base)
    windows = calibration_windows(model.tokenizer, TEXT, 32, 3, "text")
    ordered = [m.replace("blk.0", f"blk.{i}") for i in range(3) for m in MATS]
    one = Calibration(Runner(model), windows, ordered, budget=1 << 30, batch=2)
    runner = Runner(model)
    ran = []
    layer_forward = runner.layer_forward
    runner.layer_forward = lambda i, a, x: (ran.append(i), layer_forward(i, a, x))
    few = Calibration(runner, windows, ordered, budget=4 * (6 * 256 * 256 + 512 * 512), batch=2)   # a layer
    ran.clear()                                                # the first (diagonal) pass ran all layers
    for name in ordered:
        np.testing.assert_array_equal(few.hessian(name)[1], one.hessian(name)[1])
    assert few.n_passes == 3                                   # layer 0 with the diagonal pass, 1, 2
    assert ran == [1, 1, 2, 2], ran                            # 2 batches of windows per pass


def test_imatrix_errors(tmp_path, tiny_vocab):
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab, **KCFG)
    with pytest.raises(LlamatuneError, match=r"base.gguf: not an importance matrix \(no '\*.in_sum2' tensors"):
        read_imatrix(base)
    stats = InputStats()
    stats("blk.0.ffn_down.weight", np.ones((4, 96), np.float32))
    write_imatrix(tmp_path / "im.gguf", stats.imatrix(), "llama")
    with pytest.raises(LlamatuneError, match=r"im.gguf: importance matrix of another model: "
                                             r"'blk.0.ffn_down.weight' has 96 columns, the model's 512"):
        check_against(read_imatrix(tmp_path / "im.gguf"), tmp_path / "im.gguf", {"blk.0.ffn_down.weight": 512})
    adapter = saved(tmp_path, make_adapter(base, ["blk.0.ffn_down.weight"]))
    with pytest.raises(LlamatuneError, match="importance matrix of another model"):
        export_lora(base, [(adapter, 1.0)], tmp_path / "m.gguf", merge=MergeOptions(imatrix=tmp_path / "im.gguf"))
    assert not (tmp_path / "m.gguf").exists()


CHATML = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"


def test_ollama_modelfile(tmp_path, tiny_vocab):
    text = modelfile_text(tmp_path / "out" / "m.gguf", tmp_path / "out", CHATML)
    lines = text.splitlines()
    assert lines[1] == "FROM ./m.gguf"
    assert 'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}' in text
    assert [l for l in lines if l.startswith("PARAMETER")] == ['PARAMETER stop "<|im_end|>"',
                                                              'PARAMETER stop "<|im_start|>"']
    other = modelfile_text(tmp_path / "m.gguf", tmp_path / "ollama", "{{ messages }}")
    assert f"FROM {(tmp_path / 'm.gguf').resolve()}" in other and 'TEMPLATE """' not in other
    assert "left to Ollama's detection" in other
    assert "no chat template" in modelfile_text(tmp_path / "m.gguf", tmp_path, None)

    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab)
    adapter = saved(tmp_path, make_adapter(base, ["blk.0.attn_q.weight"]))
    report = export_lora(base, [(adapter, 1.0)], tmp_path / "m.gguf", merge=MergeOptions(ollama=tmp_path / "oll"))
    assert report.modelfile == tmp_path / "oll" / "Modelfile"
    assert report.modelfile.read_text().splitlines()[1] == f"FROM {(tmp_path / 'm.gguf').resolve()}"


@pytest.mark.parametrize("opts, pattern", [
    (dict(merge_method="gptq"), "--merge-method 'gptq': choose compensated or plain"),
    (dict(calibration_ctx=0), "--calibration-ctx 0: must be at least 1"),
    (dict(calibration_memory=0), "--calibration-memory 0: must be at least 1"),
    (dict(calibration_block=100), r"--calibration-block 100: must be 0 or a multiple of 256 \(the K-quants' block\)"),
    (dict(imatrix_out="x.gguf"), "--imatrix-out needs --calibration-data"),
    (dict(merge_method="plain", imatrix="im.gguf"), "--merge-method plain uses no statistics"),
    (dict(imatrix="missing.gguf"), "--imatrix missing.gguf: file not found"),
    (dict(calibration_data="empty.txt"), "empty.txt: calibration text is empty"),
    (dict(calibration_data="short.txt"), "short.txt: .* tokens, fewer than one calibration window of 512"),
    (dict(calibration_data="latin1.txt"), "latin1.txt: calibration text is not UTF-8"),
])
def test_merge_option_errors(tmp_path, tiny_vocab, monkeypatch, opts, pattern):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "short.txt").write_text("a few words")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 10)
    (tmp_path / "im.gguf").write_bytes(b"")
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab, outtype=QType.Q8_0)
    adapter = saved(tmp_path, make_adapter(base, ["blk.0.attn_q.weight"]))
    with pytest.raises(LlamatuneError, match=pattern):
        export_lora(base, [(adapter, 1.0)], tmp_path / "m.gguf", merge=MergeOptions(**opts))
    assert not (tmp_path / "m.gguf").exists()


def test_cli_reaches_every_merge_option(tmp_path, tiny_vocab):
    from dataclasses import fields

    from typer.testing import CliRunner

    from llamatune.cli.main import app
    runner = CliRunner()
    help_text = runner.invoke(app, ["export-lora", "--help"], terminal_width=200).output
    for f in fields(MergeOptions):
        assert "--" + f.name.replace("_", "-") in help_text, f.name
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab, outtype=QType.Q8_0)
    adapter = saved(tmp_path, make_adapter(base, ["blk.0.attn_q.weight"]))
    r = runner.invoke(app, ["export-lora", "-m", str(base), "--lora", str(adapter), "-o", str(tmp_path / "m.gguf"),
                            "--merge-method", "gptq"])
    assert r.exit_code == 2 and r.output == "error: --merge-method 'gptq': choose compensated or plain\n"
    r = runner.invoke(app, ["export-lora", "-m", str(base), "--lora", str(adapter), "-o", str(tmp_path / "m.gguf"),
                            "--ollama", str(tmp_path / "oll")])
    assert r.exit_code == 0, r.output
    assert f"Ollama: ollama create NAME -f {tmp_path / 'oll' / 'Modelfile'}" in r.output
