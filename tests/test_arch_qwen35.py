"""qwen35 (Qwen3.5 dense, gated delta-net layers and gated full attention): the
declaration's config and tensors as llama.cpp's loader reads them, bad metadata in one
line, the delta-net mixer's and the output gate's gradients by float64 finite
differences, decoding through the recurrent state against the full forward; and (slow,
with the torch interpreter and llama.cpp's tools) a tiny HF-made model converted by
llama.cpp's converter: the float64 reference forward against HF's logits and against
llama-perplexity's figure, and the training loss and LoRA gradients against HF's float64
autograd."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TEXT
from fdcheck import fd_check
from hf_oracle import check_lora_gradients_against_hf
from llamatune.errors import LlamatuneError
from llamatune.models.config import ModelConfig
from llamatune.models.deltanet_mixer import (MixerGrads, MixerParams, MixerShape, RecurrentState, mixer_backward,
                                             mixer_decode, mixer_forward)
from llamatune.models.gated_attention import join_q_gate, output_gate_backward, output_gate_forward, split_q_gate
from llamatune.models.model import Model

QWEN35 = dict(n_vocab=400, n_ctx_train=64, n_embd=64, n_layer=4, n_ff=96, n_head=4, n_head_kv=2, head_dim=16,
              n_rot=8, norm_eps=1e-6, ssm_conv_kernel=4, ssm_state_size=16, ssm_group_count=2, ssm_time_step_rank=4,
              ssm_inner_size=64, recurrent_layers=(True, True, True, False), full_attention_interval=4,
              rope_sections=(2, 1, 1, 0))
# llama.cpp llama_model_qwen35::load_arch_tensors, per layer kind
RECURRENT = {"attn_norm.weight", "post_attention_norm.weight", "attn_qkv.weight", "attn_gate.weight",
             "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_beta.weight", "ssm_alpha.weight", "ssm_norm.weight",
             "ssm_out.weight", "ffn_gate.weight", "ffn_down.weight", "ffn_up.weight"}
ATTENTION = {"attn_norm.weight", "post_attention_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
             "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_gate.weight", "ffn_down.weight",
             "ffn_up.weight"}


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_vocab):
    from llamatune.models.writer import random_weights, write_model
    cfg = ModelConfig(arch="qwen35", **QWEN35)
    path = tmp_path_factory.mktemp("qwen35") / "qwen35.gguf"
    write_model(path, cfg, random_weights(cfg, 0), tiny_vocab)
    return cfg, path


def test_config_and_tensors_as_llama_cpp_loads_them(written):
    cfg, path = written
    model = Model(path)
    assert model.config == cfg
    md = model.file.metadata
    assert md["qwen35.ssm.inner_size"] == 64 and md["qwen35.ssm.group_count"] == 2
    assert md["qwen35.attention.recurrent_layers"] == [True, True, True, False]
    for i in range(4):
        names = {n.removeprefix(f"blk.{i}.") for n in model.file.tensors if n.startswith(f"blk.{i}.")}
        assert names == (ATTENTION if i == 3 else RECURRENT), i
    t = model.file.tensors
    assert t["blk.0.attn_qkv.weight"].shape == (128, 64) and t["blk.0.ssm_conv1d.weight"].shape == (128, 4)
    assert t["blk.0.ssm_out.weight"].shape == (64, 64) and t["blk.0.ssm_norm.weight"].shape == (16,)
    assert t["blk.3.attn_q.weight"].shape == (128, 64) and t["blk.3.attn_k.weight"].shape == (32, 64)
    layer = model.weights.layers[0]
    assert set(layer.vectors) == {"ssm_a", "ssm_dt.bias", "ssm_conv1d.weight"} and "ssm_norm" in layer.norms
    assert set(model.weights.layers[3].mats) == {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                 "ffn_up", "ffn_down"}


def test_interval_gives_the_layer_kinds_when_the_flags_are_absent(written, tmp_path):
    cfg, path = written
    md = dict(Model(path).file.metadata)
    del md["qwen35.attention.recurrent_layers"]
    md["qwen35.full_attention_interval"] = 2
    assert ModelConfig.from_metadata(md, "m.gguf").recurrent_layers == (True, False, True, False)


@pytest.mark.parametrize("change, message", [
    ({"qwen35.ssm.inner_size": 48},
     r"m\.gguf: ssm\.inner_size 48, time_step_rank 4, .* expected inner_size = time_step_rank x state_size"),
    ({"qwen35.attention.recurrent_layers": [True, False]},
     r"m\.gguf: metadata key 'qwen35\.attention\.recurrent_layers' must be a list of 4 booleans"),
    ({"qwen35.rope.dimension_sections": [1, 0, 1, 0]}, r"m\.gguf: rope\.dimension_sections \[1, 0, 1, 0\] leave"),
    ({"qwen35.ssm.state_size": None}, r"m\.gguf: missing required metadata key 'qwen35\.ssm\.state_size'"),
])
def test_bad_metadata_is_one_line_naming_the_file(written, change, message):
    md = dict(Model(written[1]).file.metadata)
    for k, v in change.items():
        md.pop(k) if v is None else md.__setitem__(k, v)
    with pytest.raises(LlamatuneError, match=message):
        ModelConfig.from_metadata(md, "m.gguf")


def test_runner_forward_and_decoding_match_the_float64_reference(written):
    from checks import qwen35_reference as ref
    from checks.arch_reference import model_weights
    from llamatune.models.infer import KVCache, Runner
    model = Model(written[1])
    tokens = np.random.default_rng(5).integers(0, model.config.n_vocab, (2, 9))
    W = model_weights(model)
    want = np.stack([ref.forward(model.config, W, row) for row in tokens])
    runner = Runner(model)
    np.testing.assert_allclose(runner.forward(tokens), want, rtol=2e-4, atol=2e-4)
    cache = KVCache.empty(model, 2, 9)
    steps = [runner.forward(tokens[:, :4], cache)] + [runner.forward(tokens[:, t:t + 1], cache) for t in range(4, 9)]
    np.testing.assert_allclose(np.concatenate(steps, 1), want, rtol=2e-4, atol=2e-4)


def test_group_decode_starts_every_row_from_the_prompts_recurrent_state(written):
    """GRPO's group decode on the hybrid model: the prompt's cache, delta-net states
    included, is copied to every row, so at a vanishing temperature each row is the greedy
    one-sequence decode; rows that draw a stop id leave the batch with their states."""
    from llamatune.models.infer import Runner
    from llamatune.models.sampling import generate_group, generate_ids
    runner = Runner(Model(written[1]))
    ids = [1, 17, 42, 99, 7]
    greedy = list(generate_ids(runner, ids, 8, temp=0.0, n_ctx=32))
    assert generate_group(runner, ids, 3, 8, np.random.default_rng(0), 1e-6, 1.0) == [greedy] * 3
    stop = set(range(0, runner.model.config.n_vocab, 5)) - {greedy[0]}
    rows = generate_group(runner, ids, 4, 8, np.random.default_rng(1), 1.0, 1.0, stop)
    assert any(len(r) < 8 for r in rows) and all(len(r) >= 1 for r in rows)


# --------------------------------------------------------------------------- the mixer

SHAPE = MixerShape(NK=2, NV=4, DK=8, DV=6, K=4, eps=1e-6)


def _mixer_inputs(B, T, seed=0):
    rng = np.random.default_rng(seed)
    s = SHAPE
    p = MixerParams(0.5 * rng.standard_normal((s.channels, s.K)), -np.exp(rng.standard_normal(s.NV)),
                    rng.standard_normal(s.NV), 1 + 0.3 * rng.standard_normal(s.DV))
    x = dict(mixed=rng.standard_normal((B, T, s.channels)), z=rng.standard_normal((B, T, s.inner)),
             alpha=rng.standard_normal((B, T, s.NV)), b=rng.standard_normal((B, T, s.NV)))
    return p, x, rng.standard_normal((B, T, s.inner))


@pytest.mark.parametrize("packed", [False, True])
def test_mixer_gradients_by_finite_differences(packed):
    B, T = 2, 70                      # a chunk of 64 and a partial one
    p, x, dy = _mixer_inputs(B, T)
    segments = np.array([[0] * 30 + [1] * 40, [0] * 70], np.int32) if packed else None
    small = dict(conv=p.conv, a=p.a, dt_bias=p.dt_bias, norm=p.norm)

    def loss(**arrays):
        y = np.empty((B, T, SHAPE.inner))
        mixer_forward(y, arrays["mixed"], arrays["z"], arrays["alpha"], arrays["b"], p, SHAPE, segments)
        return float((y * dy).sum())
    y = np.empty((B, T, SHAPE.inner))
    saved = mixer_forward(y, x["mixed"], x["z"], x["alpha"], x["b"], p, SHAPE, segments)
    grads = {k: np.empty_like(v) for k, v in x.items()}
    small_grads = MixerGrads(**{k: np.zeros_like(v) for k, v in small.items()})
    mixer_backward(grads["mixed"], grads["z"], grads["alpha"], grads["b"], dy, saved, p, SHAPE, small_grads)
    inputs = x | small
    analytic = grads | {k: getattr(small_grads, k) for k in small}
    assert fd_check(loss, inputs, analytic, eps=1e-6, rtol=1e-6, atol=1e-8, n_probe=10) < 1e-6


def test_decoding_through_the_recurrent_state_equals_the_full_forward():
    B, T = 2, 70
    p, x, _ = _mixer_inputs(B, T, seed=1)
    full = np.empty((B, T, SHAPE.inner))
    mixer_forward(full, x["mixed"], x["z"], x["alpha"], x["b"], p, SHAPE)
    state = RecurrentState.empty(SHAPE, B, np.float64)
    parts = []
    for lo, hi in ((0, 5), (5, 6), (6, 7), (7, 69), (69, 70)):      # a prefill, single steps, a long prefill
        y = np.empty((B, hi - lo, SHAPE.inner))
        mixer_decode(y, *(x[n][:, lo:hi] for n in ("mixed", "z", "alpha", "b")), p, SHAPE, state)
        parts.append(y)
    np.testing.assert_allclose(np.concatenate(parts, 1), full, rtol=1e-12, atol=1e-12)


def test_output_gate_and_q_gate_split_gradients():
    rng = np.random.default_rng(3)
    NH, HS, N = 3, 4, 5
    qg = rng.standard_normal((N, 2 * NH * HS))
    att, dout = rng.standard_normal((N, NH * HS)), rng.standard_normal((N, NH * HS))
    q, gate = split_q_gate(qg, NH, HS)
    np.testing.assert_array_equal(q.reshape(N, NH, HS), qg.reshape(N, NH, 2 * HS)[:, :, :HS])   # llama.cpp's views
    np.testing.assert_array_equal(gate.reshape(N, NH, HS), qg.reshape(N, NH, 2 * HS)[:, :, HS:])

    def loss(qg, att):
        _, g = split_q_gate(qg, NH, HS)
        out = np.empty_like(att)
        output_gate_forward(out, att, g)
        return float((out * dout).sum())
    datt, dgate, dqg = np.empty_like(att), np.empty_like(att), np.empty_like(qg)
    output_gate_backward(datt, dgate, dout, att, gate)
    join_q_gate(dqg, np.zeros_like(q), dgate, NH, HS)
    assert fd_check(loss, dict(qg=qg, att=att), dict(qg=dqg, att=datt), rtol=1e-7) < 1e-7


# --------------------------------------------------------------------------- HF and llama.cpp (slow)

TORCH_PY = Path(os.environ.get("LLAMATUNE_TORCH_PYTHON", "LLAMATUNE_TORCH_PYTHON-not-set"))
HERE = Path(__file__).resolve().parent


def _llama_cpp() -> tuple[Path, Path] | None:
    """(llama.cpp checkout, its bin folder) from LLAMA_BIN_DIR (build/bin inside the checkout)."""
    bins = os.environ.get("LLAMA_BIN_DIR")
    if not bins or not (Path(bins) / "llama-perplexity").exists():
        return None
    root = Path(bins).resolve().parents[1]
    return (root, Path(bins)) if (root / "convert_hf_to_gguf.py").exists() else None


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    if not TORCH_PY.exists():
        pytest.skip(f"no interpreter with torch and transformers at {TORCH_PY} (LLAMATUNE_TORCH_PYTHON)")
    if _llama_cpp() is None:
        pytest.skip("llama.cpp's tools and converter not found (LLAMA_BIN_DIR=<llama.cpp>/build/bin)")
    root, _ = _llama_cpp()
    d = tmp_path_factory.mktemp("qwen35hf")
    script = str(HERE.parent / "checks" / "qwen35_hf.py")
    text = d / "train.txt"
    text.write_text(TEXT * 20, encoding="utf-8")
    subprocess.run([str(TORCH_PY), script, "build", str(d / "hf"), "--steps", "40", "--text", str(text)], check=True,
                   capture_output=True)
    subprocess.run([str(TORCH_PY), script, "convert", str(d / "hf"), str(d / "f32.gguf"), "--outtype", "f32",
                    "--llama-cpp", str(root)], check=True, capture_output=True)
    return d


@pytest.mark.slow
def test_reference_forward_equals_hf_float64_logits(hf_model):
    from checks import qwen35_reference as ref
    from checks.arch_reference import model_weights
    model = Model(hf_model / "f32.gguf")
    tokens = np.random.default_rng(0).integers(0, model.config.n_vocab, (2, 150))     # 3 chunks of the rule
    np.save(hf_model / "tokens.npy", tokens)
    subprocess.run([str(TORCH_PY), str(HERE.parent / "checks" / "qwen35_hf.py"), "logits", str(hf_model / "hf"),
                    str(hf_model / "tokens.npy"), str(hf_model / "logits.npy")], check=True, capture_output=True)
    want = np.load(hf_model / "logits.npy")
    W = model_weights(model)
    got = np.stack([ref.forward(model.config, W, row) for row in tokens])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())   # float32 rope tables


@pytest.mark.slow
def test_reference_perplexity_equals_llama_perplexity(hf_model):
    from checks import qwen35_reference as ref
    _, bins = _llama_cpp()
    text = hf_model / "eval.txt"
    text.write_text(TEXT[:3000], encoding="utf-8")
    out = subprocess.run([str(bins / "llama-perplexity"), "-m", str(hf_model / "f32.gguf"), "-f", str(text), "-c", "64",
                          "-b", "64", "-nr", "-t", "2"], capture_output=True, text=True, check=True)
    want = float(re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr).group(1))
    model = Model(hf_model / "f32.gguf")
    got = ref.perplexity(model, model.tokenizer.encode(text.read_text(encoding="utf-8")), 64)
    assert abs(got - want) <= 2e-5 * want          # float64 here, float32 in llama.cpp


def test_lora_gradients_every_kind_by_finite_differences(written):
    from checks.arch_reference import all_ranks, check_lora_gradients
    model = Model(written[1])
    ranks = all_ranks(model.config, tied=False)
    assert {"attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out", "ssm_norm", "attn_q"} <= set(ranks)
    assert check_lora_gradients(model, ranks, "layer", n_probe=120) < 1e-5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_checkpointing_modes_identical(written, dtype):
    from checks.arch_reference import all_ranks, check_modes_identical
    model = Model(written[1])
    check_modes_identical(model, all_ranks(model.config, tied=False), dtype, packed=dtype == np.float64)


# GGUF kind -> HF module of a layer, and which axis carries value heads the converter reorders
HF_LINEARS = {"attn_qkv": ("linear_attn.in_proj_qkv", 0), "attn_gate": ("linear_attn.in_proj_z", 0),
              "ssm_alpha": ("linear_attn.in_proj_a", 0), "ssm_beta": ("linear_attn.in_proj_b", 0),
              "ssm_out": ("linear_attn.out_proj", 1), "attn_q": ("self_attn.q_proj", None),
              "attn_k": ("self_attn.k_proj", None), "attn_v": ("self_attn.v_proj", None),
              "attn_output": ("self_attn.o_proj", None), "ffn_gate": ("mlp.gate_proj", None),
              "ffn_up": ("mlp.up_proj", None), "ffn_down": ("mlp.down_proj", None)}


def _tiled(grad, kind, axis, cfg):
    """HF's grouped value heads in the converter's tiled order (conversion/qwen.py _reorder_v_heads)."""
    if axis is None:
        return grad
    NK, NV = cfg.ssm_group_count, cfg.ssm_time_step_rank
    head = 1 if kind in ("ssm_alpha", "ssm_beta") else cfg.ssm_inner_size // NV
    g = np.moveaxis(grad, axis, 0)
    lead = 2 * NK * cfg.ssm_state_size if kind == "attn_qkv" else 0
    v = g[lead:].reshape(NK, NV // NK, head, *g.shape[1:]).swapaxes(0, 1).reshape(g[lead:].shape)
    return np.moveaxis(np.concatenate([g[:lead], v]), 0, axis)


def _hf_weight_grad(hf, i: int, kind: str, cfg) -> np.ndarray:
    """HF's dL/dW of layer i's `kind` in the GGUF's layout (value heads tiled as the converter writes them)."""
    module, axis = HF_LINEARS[kind]
    return _tiled(hf[f"model.layers.{i}.{module}.weight"], kind, axis, cfg)


@pytest.mark.slow
def test_loss_and_lora_gradients_equal_hf_autograd(hf_model):
    """B = 0: the adapted model is HF's, dL/dB = s dL/dW A^T with HF's dL/dW (float64 autograd);
    70 tokens: a chunk of the rule and a partial one."""
    check_lora_gradients_against_hf(hf_model, "checks.qwen35_hf", {k: 4 for k in HF_LINEARS}, 70, False,
                                    _hf_weight_grad)


def test_delta_net_on_a_gpu_is_refused_in_one_line(written):
    from types import SimpleNamespace

    from llamatune.models.qwen35_parts import DeltaNet
    part = DeltaNet(written[0], 0)
    with pytest.raises(LlamatuneError, match=r"qwen35: its gated delta-net layers run on the CPU only .* --device cpu"):
        part.forward(SimpleNamespace(backend=SimpleNamespace(name="cuda")), None, None, None, None)


def test_finetune_resume_perplexity_generate_export_through_the_cli(written, tmp_path):
    from typer.testing import CliRunner

    from llamatune.cli.main import app
    from llamatune.formats.gguf_io import GGUFFile

    def run(*args):
        r = CliRunner().invoke(app, [str(a) for a in args])
        assert r.exit_code == 0, r.output
        return r.output
    model = written[1]
    (tmp_path / "t.txt").write_text(TEXT)
    train = ["finetune", "--model-base", model, "--train-data", tmp_path / "t.txt", "--ctx", 16, "--batch", 2,
             "--lora-r", 2, "--rank-ssm-alpha", 1, "--rank-ssm-beta", 1, "--warmup", 1, "--adam-alpha", 1e-2,
             "--save-every", 0, "--checkpoint-out", tmp_path / "chk-ITERATION.gguf",
             "--lora-out", tmp_path / "adapter-ITERATION.gguf"]
    run(*train, "--adam-iter", 2)
    run(*train, "--adam-iter", 3, "--checkpoint-in", tmp_path / "chk-LATEST.gguf")
    adapter = GGUFFile(tmp_path / "adapter-LATEST.gguf")
    kinds = {i: {n.split(".")[2] for n in adapter.tensors if n.startswith(f"blk.{i}.")} for i in (0, 3)}
    assert kinds[0] == {"attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out", "ffn_gate", "ffn_up", "ffn_down"}
    assert kinds[3] == {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
    lora = ["--lora", tmp_path / "adapter-LATEST.gguf"]
    base_ppl = run("perplexity", "-m", model, "-f", tmp_path / "t.txt", "-c", 16)
    assert "Final estimate: PPL = " in base_ppl and base_ppl != run("perplexity", "-m", model, "-f",
                                                                    tmp_path / "t.txt", "-c", 16, *lora)
    assert "First Citizen:" in run("generate", "-m", model, "-p", "First Citizen:", "-n", 4, "--temp", 0, *lora)
    run("export-lora", "-m", model, *lora, "-o", tmp_path / "merged.gguf")
    merged = GGUFFile(tmp_path / "merged.gguf")
    assert not np.array_equal(np.array(merged.tensors["blk.0.ssm_alpha.weight"].data),
                              np.array(GGUFFile(model).tensors["blk.0.ssm_alpha.weight"].data))


def test_peft_adapters_of_every_kind_both_ways(written, tmp_path):
    """A PEFT adapter on the delta-net projections (HF's grouped value heads) and the
    attention and FFN modules converts to a GGUF adapter whose s B A is HF's s B A in the
    converter's tiled order (`_tiled`, as the HF-autograd test checks it), and back to the
    same PEFT tensors; without a base model the reordered kinds are refused in one line."""
    import json

    from safetensors.numpy import load_file, save_file

    from llamatune.commands.convert import convert
    from llamatune.formats.adapter import read_adapter
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.models.arch import tensor_shape
    cfg, path = written
    rng, tensors, want = np.random.default_rng(5), {}, {}
    for i in range(cfg.n_layer):
        for kind in (k for k in HF_LINEARS if f"blk.{i}.{k}.weight" in GGUFFile(path).tensors):
            module, axis = HF_LINEARS[kind]
            n_out, n_in = tensor_shape(cfg, kind)
            a, b = rng.normal(0, 0.3, (3, n_in)).astype(np.float32), rng.normal(0, 0.3, (n_out, 3)).astype(np.float32)
            key = f"base_model.model.model.layers.{i}.{module}"
            tensors[key + ".lora_A.weight"], tensors[key + ".lora_B.weight"] = a, b
            want[f"blk.{i}.{kind}.weight"] = _tiled(2.0 * (b @ a), kind, axis, cfg)
    peft = tmp_path / "peft"
    peft.mkdir()
    save_file(tensors, str(peft / "adapter_model.safetensors"), metadata={"format": "pt"})
    (peft / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 3, "lora_alpha": 6.0}))
    convert(peft, tmp_path / "a.gguf", model_base=path)
    got = read_adapter(tmp_path / "a.gguf", GGUFFile(path))
    assert {n.split(".")[2] for n in want} >= {"attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out", "attn_q"}
    assert got.pairs.keys() == want.keys()
    for name, (a, b) in got.pairs.items():
        np.testing.assert_allclose(got.scale(name) * (b @ a), want[name], rtol=1e-5, atol=1e-6)
    convert(tmp_path / "a.gguf", tmp_path / "back", "peft", model_base=path)
    back = load_file(str(tmp_path / "back" / "adapter_model.safetensors"))
    assert back.keys() == tensors.keys()
    for k in tensors:
        np.testing.assert_array_equal(back[k], tensors[k])
    with pytest.raises(LlamatuneError, match=r"--model-base is required: qwen35's \w+ adapters are reordered"):
        convert(tmp_path / "a.gguf", tmp_path / "nobase", "peft")


@pytest.mark.parametrize("T", [64, 256])
def test_estimate_covers_the_delta_net_backwards_scratch(written, monkeypatch, T):
    """The numpy scratch a delta-net layer's backward allocates (tracemalloc's peak above
    what was allocated on entry: the mixer recomputed, its gradients, the rule's work
    items; a second step, after the first call's one-time allocations) is within the
    estimate's term for it, which Planner's temporaries count, and at most twice it
    (the rule's items pad to chunks of 64 steps: the margin at these tiny widths)."""
    import tracemalloc
    from llamatune.train.lora import init_lora, lora_specs, lora_targets
    from llamatune.train.step import StepExecutor
    from llamatune.train.memory import temporaries_bytes
    from llamatune.train.params import ParamBuffer
    from llamatune.train.parts import DeltaNetBackward
    from llamatune.models.weights import FrozenBase
    model = Model(written[1])
    cfg = model.config
    ts = lora_targets(cfg, {k: 2 for k in ("attn_qkv", "attn_gate", "ssm_out", "ffn_up")}, 4.0, tied=False)
    params = ParamBuffer(lora_specs(ts))
    init_lora(params, ts, np.random.default_rng(0))
    g = StepExecutor(cfg, FrozenBase(model), params, ts, 1, T, "layer")
    peaks, backward = [], DeltaNetBackward.backward

    def traced(self, *args):
        tracemalloc.start()
        entry = tracemalloc.get_traced_memory()[0]
        try:
            backward(self, *args)
        finally:
            peaks.append(tracemalloc.get_traced_memory()[1] - entry)
            tracemalloc.stop()
    monkeypatch.setattr(DeltaNetBackward, "backward", traced)
    rng = np.random.default_rng(1)
    batch = rng.integers(0, cfg.n_vocab, (1, T)), rng.integers(0, cfg.n_vocab, (1, T)), np.full((1, T), 1 / T)
    g.step(*batch)
    peaks.clear()
    g.step(*batch)
    est = 4 * DeltaNetBackward.scratch_floats(cfg, 1, T)
    assert len(peaks) == sum(cfg.recurrent_layers) and max(peaks) <= est <= 2 * max(peaks), (peaks, est)
    assert temporaries_bytes(cfg, 1, T, 0.0) == est
