"""gpt-oss: the declaration and metadata as llama.cpp reads them, the decode path against
the full forward (sliding window, sinks and YaRN through the KV cache), and every LoRA
gradient (attention, router, per-expert adapters) through sinks, the clamped SwiGLU, the
experts' biases and the router by float64 finite differences, on tiny models written by
llamatune's writer with seeded random weights.

The Hugging Face oracle is `slow` and needs the torch Python and llama.cpp's tools: a
GptOssForCausalLM trained by transformers (checks/gptoss_hf.py), converted by llama.cpp's
convert_hf_to_gguf.py to F32 and Q8_0 and by llama-quantize to MXFP4_MOE. Measured (300
HF steps; 2 layers of 64, window 16 on the first, 8 experts of 32 with 2 active;
shakespeare-eval.txt, 12000 characters, -c 128), perplexity llamatune / llama-perplexity
(-nr) / HF (float64, llama-perplexity's windows and scoring):
    F32    54.96175 / 54.9618 / 54.96175
    Q8_0   54.97662 / 54.9765
    MXFP4  54.98756 / 54.9848
LoRA (rank 4, alpha 8) on q/k/v/o and the three expert tensors of both layers, float64 loss
9.226994028 (HF 9.226994060) and the worst gradient's difference 5.9e-7 of its tensor's
largest (q and k, through the float32 YaRN tables; the experts' 1e-8 to 2e-7).
40-step rank-8 LoRA (attention and experts) on the MXFP4_MOE file, perplexity base ->
tuned 54.988 -> 53.032 (llama-perplexity --lora 53.028); export-lora into the file (the
experts stay MXFP4, compensated): 53.174 (llama-perplexity 53.171), 93 % of the gain.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from checks.arch_reference import all_ranks, check_lora_gradients, check_modes_identical, write_arch_model
from conftest import REPO, need, tiny_config
from llamatune.errors import LlamatuneError
from llamatune.models.arch import NEOX
from llamatune.models.config import ModelConfig
from llamatune.models.model import Model

TORCH_PYTHON = os.environ.get("LLAMATUNE_TORCH_PYTHON", "LLAMATUNE_TORCH_PYTHON-not-set")
SHAPE = dict(n_ff=16, n_expert=8, n_expert_used=2, n_ff_exp=16, sliding_window=4, swa_pattern=2,
             rope_freq_base=150000.0, rope_freq_scale=1 / 32, n_ctx_orig=4096, rope_ext_factor=1.0)
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, tiny_vocab):
    cfg = tiny_config("gpt-oss", **SHAPE)
    return Model(write_arch_model(tmp_path_factory.mktemp("gpt-oss") / "gpt-oss.gguf", cfg, tiny_vocab, seed=4))


def test_declaration_tensors_and_metadata_as_llama_cpp(gpt_oss):
    cfg, spec = gpt_oss.config, gpt_oss.config.spec
    assert cfg.arch == "gpt-oss" and spec.rope_mode == NEOX and spec.moe and spec.expert_norm and not spec.scratch
    assert cfg.part_kinds(0) == ("attention_sinks", "moe_post")
    names = {n.removeprefix("blk.0.") for n in gpt_oss.file.tensors if n.startswith("blk.0.")}
    assert names == {   # llama.cpp llama_model_openai_moe::load_arch_tensors
        "attn_norm.weight", "post_attention_norm.weight", "attn_q.weight", "attn_q.bias", "attn_k.weight",
        "attn_k.bias", "attn_v.weight", "attn_v.bias", "attn_output.weight", "attn_output.bias",
        "attn_sinks.weight", "ffn_gate_inp.weight", "ffn_gate_inp.bias"} | {
        f"{k}.{s}" for k in EXPERTS for s in ("weight", "bias")}
    t = gpt_oss.file.tensors
    assert t["blk.0.attn_sinks.weight"].shape == (4,)
    assert t["blk.0.ffn_gate_exps.bias"].shape == t["blk.0.ffn_up_exps.bias"].shape == (8, 16)
    assert t["blk.0.ffn_down_exps.bias"].shape == (8, 64)
    assert [cfg.window(i) for i in range(2)] == [4, 0]                   # load_swa_pattern(2): even layers slide
    md = gpt_oss.file.metadata
    assert md["gpt-oss.rope.scaling.type"] == "yarn" and md["gpt-oss.rope.scaling.original_context_length"] == 4096
    assert ModelConfig.from_metadata(md, "m") == cfg


def test_yarn_sliding_pattern_and_refusals_from_metadata(gpt_oss):
    md = dict(gpt_oss.file.metadata)
    assert ModelConfig.from_metadata(md | {"gpt-oss.attention.sliding_window_pattern": 3}, "m").window(1) == 4
    plain = {k: v for k, v in md.items() if not k.startswith("gpt-oss.rope.scaling")}
    cfg = ModelConfig.from_metadata(plain, "m")
    assert cfg.rope_ext_factor == 0 and cfg.rope_freq_scale == 1.0
    with pytest.raises(LlamatuneError, match=r"^m: missing required metadata key 'gpt-oss.attention.sliding_window'$"):
        ModelConfig.from_metadata({k: v for k, v in md.items() if k != "gpt-oss.attention.sliding_window"}, "m")
    with pytest.raises(LlamatuneError, match=r"^m: rope scaling type 'longrope' is not supported \(only linear and yarn\)$"):
        ModelConfig.from_metadata(md | {"gpt-oss.rope.scaling.type": "longrope"}, "m")


@pytest.mark.parametrize("name,shape,match", [
    ("blk.1.attn_sinks.weight", None, r"missing tensor 'blk.1.attn_sinks.weight'$"),
    ("blk.0.ffn_down_exps.bias", (8, 16), r"tensor 'blk.0.ffn_down_exps.bias' has shape \(8, 16\), expected \(8, 64\)$")],
    ids=["missing-sinks", "expert-bias-shape"])
def test_a_missing_or_misshapen_tensor_is_named(gpt_oss, tmp_path, name, shape, match):
    from llamatune.formats.gguf_io import tensor_out, write_gguf
    f = gpt_oss.file
    tensors = [tensor_out(n, np.zeros(shape, np.float32) if n == name else np.array(t.data))
               for n, t in f.tensors.items() if n != name or shape is not None]
    write_gguf(tmp_path / "bad.gguf", f.arch, f.kvs.values(), tensors)
    with pytest.raises(LlamatuneError, match=r"bad.gguf: .*" + match):
        Model(tmp_path / "bad.gguf")


def test_decoding_through_the_cache_equals_the_full_forward(gpt_oss):
    """Token by token through the KV cache (past the window of 4, the sinks and the YaRN
    tables at each position) gives the full forward's logits."""
    from llamatune.models.infer import KVCache, Runner
    ids = np.random.default_rng(0).integers(0, 400, (2, 9))
    runner = Runner(gpt_oss)
    full = runner.forward(ids)
    cache = KVCache.empty(gpt_oss, 2, 9)
    steps = np.concatenate([runner.forward(ids[:, t:t + 1], cache) for t in range(9)], 1)
    np.testing.assert_allclose(steps, full, rtol=0, atol=2e-6 * np.abs(full).max())


def test_lora_gradients_through_sinks_experts_and_router(gpt_oss):
    """Rank 2 on every layer matrix, norm and the head (the router's adapter included):
    the gradient goes through the sinks, the window, the experts' biases and clamped gate
    and the router's top-k softmax, by finite differences in float64."""
    assert check_lora_gradients(gpt_oss, all_ranks(gpt_oss.config, tied=False), "selective", n_probe=150) < 1e-5


def test_expert_lora_gradients(gpt_oss):
    ranks = {"ffn_gate_exps": 2, "ffn_up_exps": 3, "ffn_down_exps": 2, "attn_k": 2}
    assert check_lora_gradients(gpt_oss, ranks, "layer", n_probe=150) < 1e-5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_checkpointing_modes_identical(gpt_oss, dtype):
    ranks = all_ranks(gpt_oss.config, tied=False) | {k: 2 for k in EXPERTS}
    check_modes_identical(gpt_oss, ranks, dtype, packed=dtype == np.float64)


# --------------------------------------------------------------------------- the Hugging Face oracle
N_CTX, EVAL_CHARS = 128, 12000


def _bins() -> Path:
    bins = os.environ.get("LLAMA_BIN_DIR")
    if not bins or not (Path(bins) / "llama-perplexity").exists():
        pytest.skip("needs LLAMA_BIN_DIR (llama.cpp's build/bin)")
    return Path(bins)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """checks/gptoss_hf.py's model (300 HF steps), its F32, Q8_0 and MXFP4_MOE files."""
    from checks.gptoss_hf import make
    if not Path(TORCH_PYTHON).exists():
        pytest.skip(f"no Python with torch and transformers at {TORCH_PYTHON} (LLAMATUNE_TORCH_PYTHON)")
    work = Path(os.environ["LLAMATUNE_HF_WORK"]) / "gpt-oss" if os.environ.get("LLAMATUNE_HF_WORK") \
        else tmp_path_factory.mktemp("gpt-oss-hf")
    return make(work, TORCH_PYTHON, steps=300, llama_bin=_bins()) | {"work": work}


def eval_text(tmp: Path) -> Path:
    path = tmp / "eval.txt"
    text = need(REPO.parent / "shared" / "data" / "shakespeare-eval.txt").read_text(encoding="utf-8")
    path.write_text(text[:EVAL_CHARS], encoding="utf-8")
    return path


def cpp_ppl(model: Path, text: Path, *extra) -> float:
    args = [_bins() / "llama-perplexity", "-m", model, "-f", text, "-c", N_CTX, "-b", N_CTX, "-t", 2, "-nr", *extra]
    out = subprocess.run([str(a) for a in args], capture_output=True, text=True, check=True)
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr).group(1))


def lt_ppl(model: Path, text: Path, adapter: Path | None = None) -> float:
    from llamatune.commands.perplexity import perplexity
    from llamatune.formats.adapter import load_runtime_adapters
    from llamatune.models.infer import Runner
    m = Model(model)
    adapters = load_runtime_adapters(m, [(str(adapter), 1.0)]) if adapter else None
    return perplexity(Runner(m, adapters), text.read_text(encoding="utf-8"), N_CTX, N_CTX).ppl


def hf_ppl(hf_model, text: Path) -> float:
    """HF's float64 logits of llama-perplexity's windows, scored as it scores them."""
    from checks.gptoss_hf import hf_logits
    from llamatune.commands.perplexity import make_windows
    tok = Model(hf_model["f32"]).tokenizer
    windows = make_windows(tok.encode(text.read_text(encoding="utf-8"), add_special=True), N_CTX, tok.bos_id,
                           tok.add_bos, "eval")
    z = hf_logits(TORCH_PYTHON, hf_model["hf"], windows, text.parent)[:, N_CTX // 2:N_CTX - 1]
    targets = windows[:, N_CTX // 2 + 1:]
    m = z.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
    return math.exp((lse - np.take_along_axis(z, targets[..., None], -1)[..., 0]).mean())


@pytest.mark.slow
def test_hf_oracle_perplexity(hf_model, tmp_path):
    """llamatune's perplexity within 0.1 % of llama-perplexity's (F32 without activation
    rounding, Q8_0 and MXFP4_MOE) and of HF's float64 one."""
    text = eval_text(tmp_path)
    ours = lt_ppl(hf_model["f32"], text)
    figures = dict(llamatune=ours, llama_cpp=cpp_ppl(hf_model["f32"], text, "-fa", "off", "-ctk", "f32", "-ctv", "f32"),
                   hf=hf_ppl(hf_model, text))
    for q in ("q8_0", "mxfp4"):
        figures |= {f"llamatune_{q}": lt_ppl(hf_model[q], text), f"llama_cpp_{q}": cpp_ppl(hf_model[q], text)}
    print("gpt-oss", figures)
    assert ours < 256                                      # trained: far below the 512 of a uniform guess
    assert ours == pytest.approx(figures["llama_cpp"], rel=1e-3)
    assert ours == pytest.approx(figures["hf"], rel=1e-3)
    for q in ("q8_0", "mxfp4"):
        assert figures[f"llamatune_{q}"] == pytest.approx(figures[f"llama_cpp_{q}"], rel=1e-3)


@pytest.mark.slow
def test_hf_oracle_logits(hf_model, tmp_path):
    """llamatune's float32 runner within float32 rounding of HF's float64 logits."""
    from checks.gptoss_hf import hf_logits
    from llamatune.models.infer import Runner
    ids = np.random.default_rng(0).integers(0, 512, (2, 40))
    hf = hf_logits(TORCH_PYTHON, hf_model["hf"], ids, tmp_path)
    np.testing.assert_allclose(Runner(Model(hf_model["f32"])).forward(ids), hf, rtol=0, atol=2e-6 * np.abs(hf).max())


@pytest.mark.slow
def test_hf_oracle_loss_and_lora_gradients(hf_model, tmp_path):
    """LoRA on attention (PEFT) and on every expert tensor (per expert, build_lora_mm_id's
    layout) over the frozen file: the training graph's float64 loss and the gradient of
    every A and B equal HF autograd's on the same values to 1e-6 relative (per tensor: max
    |difference| / max |HF's|; the rope tables are float32, as llama.cpp's)."""
    from checks.gptoss_hf import hf_lora_grads
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    from llamatune.train.lora import lora_specs, lora_targets
    from llamatune.train.params import ParamBuffer
    model = Model(hf_model["f32"])
    cfg, rng = model.config, np.random.default_rng(3)
    B, T, r, alpha = 2, 40, 4, 8.0                           # T past the window of 16
    ids = rng.integers(0, cfg.n_vocab, (B, T + 1))
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output") + EXPERTS
    targets = lora_targets(cfg, {k: r for k in kinds}, alpha, tied=False)
    params = ParamBuffer(lora_specs(targets), np.float64)
    params.data[...] = rng.normal(0, 0.1, params.size)
    lora = {n: params[n].copy() for t in targets for n in (t.a, t.b)}
    hf = hf_lora_grads(TORCH_PYTHON, hf_model["hf"], ids, lora, r, alpha, tmp_path)
    g = StepExecutor(cfg, FrozenBase(model), params, targets, B, T, "selective", dtype=np.float64)
    loss = g.step(ids[:, :-1], ids[:, 1:], np.full((B, T), 1 / (B * T)))
    assert len(lora) == len(kinds) * 2 * cfg.n_layer
    worst = max(np.abs(params.grad_of(n) - hf[n]).max() / np.abs(hf[n]).max() for n in lora)
    print("gpt-oss loss", loss, "HF", hf["loss"], "worst gradient difference", worst)
    assert loss == pytest.approx(hf["loss"], rel=1e-7)     # float32 rope tables and gate constants, as llama.cpp's
    for name in lora:
        want = hf[name]
        assert np.abs(want).max() > 0 and np.abs(params.grad_of(name) - want).max() <= 1e-6 * np.abs(want).max(), name


@pytest.mark.slow
def test_hf_oracle_lora_finetune_llama_cpp_lora_and_mxfp4_export(hf_model, tmp_path):
    """A 40-step LoRA on the MXFP4_MOE file (attention and every expert tensor) lowers the
    perplexity; llama-perplexity --lora gives llamatune's within 0.5 %; export-lora merges
    it into the file with the experts kept MXFP4, and llama.cpp's perplexity of the merged
    model keeps at least 90 % of the adapter's gain and equals llamatune's within 0.1 %."""
    from llamatune.commands.export import export_lora
    from llamatune.commands.finetune import finetune
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.options import FinetuneOptions
    text, base = eval_text(tmp_path), hf_model["mxfp4"]
    train = tmp_path / "train.txt"
    train.write_text(need(REPO.parent / "shared" / "data" / "shakespeare.txt").read_text(encoding="utf-8")[:200_000],
                     encoding="utf-8")
    finetune(FinetuneOptions(model_base=base, train_data=train, ctx=64, batch=8, lora_r=8, adam_iter=40, warmup=5,
                             adam_alpha=3e-3, save_every=0, checkpoint_out=tmp_path / "chk-ITERATION.gguf",
                             lora_out=tmp_path / "adapter-ITERATION.gguf"), quiet=True)
    adapter = tmp_path / "adapter-LATEST.gguf"
    assert {f"blk.0.{k}.weight.lora_a" for k in EXPERTS} <= set(GGUFFile(adapter).tensors)
    before, tuned = lt_ppl(base, text), lt_ppl(base, text, adapter)
    figures = dict(base=before, tuned=tuned, llama_cpp_tuned=cpp_ppl(base, text, "--lora", adapter))
    export_lora(base, [(adapter, 1.0)], tmp_path / "merged.gguf")
    merged = GGUFFile(tmp_path / "merged.gguf")
    assert {merged.tensors[f"blk.{i}.{k}.weight"].qtype.name for i in range(2) for k in EXPERTS} == {"MXFP4"}
    figures |= dict(merged=lt_ppl(tmp_path / "merged.gguf", text), llama_cpp_merged=cpp_ppl(tmp_path / "merged.gguf", text))
    print("gpt-oss", figures)
    assert tuned < before
    assert tuned == pytest.approx(figures["llama_cpp_tuned"], rel=5e-3)
    assert before - figures["llama_cpp_merged"] >= 0.9 * (before - tuned)
    assert figures["merged"] == pytest.approx(figures["llama_cpp_merged"], rel=1e-3)


@pytest.mark.slow
def test_hf_oracle_peft_export(hf_model, tmp_path):
    """An attention adapter (a few steps, --no-lora-experts) written as a PEFT adapter by
    convert-checkpoint and loaded by PEFT onto HF's model gives llamatune's logits with the
    GGUF adapter (float32 rounding)."""
    from checks.gptoss_hf import hf_logits
    from llamatune.commands.convert import convert
    from llamatune.commands.finetune import finetune
    from llamatune.formats.adapter import load_runtime_adapters
    from llamatune.models.infer import Runner
    from llamatune.options import FinetuneOptions
    train = tmp_path / "train.txt"
    train.write_text(need(REPO.parent / "shared" / "data" / "shakespeare.txt").read_text(encoding="utf-8")[:50_000],
                     encoding="utf-8")
    finetune(FinetuneOptions(model_base=hf_model["f32"], train_data=train, ctx=32, batch=4, lora_r=4, adam_iter=5,
                             adam_alpha=1e-2, no_lora_experts=True, save_every=0,
                             checkpoint_out=tmp_path / "chk-ITERATION.gguf", lora_out=tmp_path / "adapter-ITERATION.gguf"),
             quiet=True)
    adapter = tmp_path / "adapter-LATEST.gguf"
    convert(adapter, tmp_path / "peft", to="peft", model_base=hf_model["f32"])
    ids = np.random.default_rng(1).integers(0, 512, (2, 40))
    hf = hf_logits(TORCH_PYTHON, hf_model["hf"], ids, tmp_path, tmp_path / "peft")
    model = Model(hf_model["f32"])
    ours = Runner(model, load_runtime_adapters(model, [(str(adapter), 1.0)])).forward(ids)
    assert np.abs(ours - Runner(model).forward(ids)).max() > 1e-3                    # the adapter matters
    np.testing.assert_allclose(ours, hf, rtol=0, atol=2e-6 * np.abs(hf).max())
