"""PEFT's LoRA on fused 3-D expert parameters (target_parameters) <-> llama.cpp's per-expert
adapters (formats/peft_experts.py), on a tiny qwen3moe (gate | up stacked) and gpt-oss (gate
and up in alternate rows): the layout by PEFT's own formula, both ways, and (slow, with
TORCH_PYTHON) against peft itself: its get_delta_weight of an adapter it saved, and of ours
loaded with PeftModel.from_pretrained."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from checks.arch_reference import write_arch_model
from conftest import tiny_config
from llamatune.commands.convert import convert
from llamatune.errors import LlamatuneError
from llamatune.formats.adapter import LoraAdapter, read_adapter, write_adapter as write
from llamatune.formats.gguf_io import GGUFFile

E, F, R = 4, 16, 2
MOE = dict(n_embd=32, n_ff=48, n_head=4, n_head_kv=2, head_dim=8, n_rot=8, n_expert=E, n_expert_used=2, n_ff_exp=F)
P = "base_model.model.model.layers.{}.mlp.experts"


@pytest.fixture(scope="module")
def gpt_oss_base(tmp_path_factory, tiny_vocab) -> Path:
    cfg = tiny_config("gpt-oss", n_ff=16, n_expert=8, n_expert_used=2, n_ff_exp=16, sliding_window=4, swa_pattern=2)
    return write_arch_model(tmp_path_factory.mktemp("oss") / "gpt-oss.gguf", cfg, tiny_vocab, seed=4)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_vocab) -> Path:
    cfg = tiny_config("qwen3moe", **MOE)
    return write_arch_model(tmp_path_factory.mktemp("moe") / "qwen3moe.gguf", cfg, tiny_vocab, seed=4)


def peft_delta(lora_a: np.ndarray, lora_b: np.ndarray, scale: float) -> np.ndarray:
    """peft's ParamWrapper.get_delta_weight for a 3-D parameter, as (E, out, in)."""
    a = lora_a.reshape(E, -1, lora_a.shape[-1])
    b = lora_b.reshape(lora_b.shape[0], -1, E)
    return np.einsum("ore,eri->eoi", b, a) * scale


def gguf_delta(pairs: dict, name: str, scale: float) -> np.ndarray:
    a, b = pairs[name]
    return np.einsum("eor,eri->eoi", b, a) * scale


def write_peft(path: Path, tensors: dict, **config) -> Path:
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    return path


def random_peft(rng, layers=2) -> dict:
    t = {}
    for i in range(layers):
        t[f"{P.format(i)}.base_layer.lora_A.weight"] = rng.normal(0, 0.3, (R * E, 32)).astype(np.float32)  # gate_up
        t[f"{P.format(i)}.base_layer.lora_B.weight"] = rng.normal(0, 0.3, (2 * F, R * E)).astype(np.float32)
        t[f"{P.format(i)}.lora_A.weight"] = rng.normal(0, 0.3, (R * E, F)).astype(np.float32)          # down
        t[f"{P.format(i)}.lora_B.weight"] = rng.normal(0, 0.3, (32, R * E)).astype(np.float32)
    return t


def test_peft_experts_to_gguf_and_back(base, tmp_path):
    """gate_up_proj's pair becomes ffn_gate_exps and ffn_up_exps (one A, B split by rows) and
    down_proj's ffn_down_exps, each expert's s B A equal to peft's delta of the fused
    parameter; the way back gives the same tensors, names and target_parameters."""
    t = random_peft(np.random.default_rng(0))
    src = write_peft(tmp_path / "peft", t, r=R, lora_alpha=6,
                     target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"])
    out = tmp_path / "a.gguf"
    convert(src, out, model_base=base)
    adapter = read_adapter(out, GGUFFile(base))
    s = adapter.scale("blk.0.ffn_gate_exps.weight")
    assert s == 3.0 and adapter.pairs["blk.1.ffn_up_exps.weight"][0].shape == (E, R, 32)
    for i in range(2):
        fused = peft_delta(t[f"{P.format(i)}.base_layer.lora_A.weight"], t[f"{P.format(i)}.base_layer.lora_B.weight"], 3.0)
        np.testing.assert_allclose(gguf_delta(adapter.pairs, f"blk.{i}.ffn_gate_exps.weight", s), fused[:, :F], rtol=1e-6)
        np.testing.assert_allclose(gguf_delta(adapter.pairs, f"blk.{i}.ffn_up_exps.weight", s), fused[:, F:], rtol=1e-6)
        down = peft_delta(t[f"{P.format(i)}.lora_A.weight"], t[f"{P.format(i)}.lora_B.weight"], 3.0)
        np.testing.assert_allclose(gguf_delta(adapter.pairs, f"blk.{i}.ffn_down_exps.weight", s), down, rtol=1e-6)
    back = tmp_path / "back"
    convert(out, back, "peft")
    cfg = json.loads((back / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert (cfg["r"], cfg["lora_alpha"], cfg["rank_pattern"], cfg["target_modules"]) == (R, 6.0, {}, None)
    got = load_file(str(back / "adapter_model.safetensors"))
    assert got.keys() == t.keys()
    for k in t:
        np.testing.assert_array_equal(got[k], t[k])


def test_gguf_experts_with_their_own_gate_and_up_a(base, tmp_path):
    """A llamatune expert adapter (gate and up with their own A) goes to PEFT as gate_up_proj of
    rank 2R (block-diagonal, rank_pattern and alpha_pattern keep alpha / R) and comes back with
    every expert's s B A unchanged; only the down_proj of a layer: no base_layer nesting."""
    rng = np.random.default_rng(1)
    adapter = LoraAdapter("qwen3moe", 4.0)
    for kind, (n_out, n_in) in (("ffn_gate_exps", (F, 32)), ("ffn_up_exps", (F, 32)), ("ffn_down_exps", (32, F))):
        adapter.pairs[f"blk.0.{kind}.weight"] = (rng.normal(0, 0.3, (E, R, n_in)).astype(np.float32),
                                                 rng.normal(0, 0.3, (E, n_out, R)).astype(np.float32))
    src = tmp_path / "a.gguf"
    write(src, adapter)
    back = tmp_path / "peft"
    convert(src, back, "peft")
    cfg = json.loads((back / "adapter_config.json").read_text())
    full = "model.layers.0.mlp.experts.gate_up_proj"
    assert cfg["rank_pattern"] == {full: 2 * R} and cfg["alpha_pattern"] == {full: 8.0}
    st = load_file(str(back / "adapter_model.safetensors"))
    assert st[f"{P.format(0)}.base_layer.lora_A.weight"].shape == (2 * R * E, 32)
    assert st[f"{P.format(0)}.lora_A.weight"].shape == (R * E, F)
    again = tmp_path / "again.gguf"
    convert(back, again, model_base=base)
    got = read_adapter(again, GGUFFile(base))
    for name in adapter.pairs:
        np.testing.assert_allclose(gguf_delta(got.pairs, name, got.scale(name)),
                                   gguf_delta(adapter.pairs, name, adapter.scale(name)), rtol=1e-5, atol=1e-6)

    only_down = LoraAdapter("qwen3moe", 4.0)
    only_down.pairs["blk.1.ffn_down_exps.weight"] = adapter.pairs["blk.0.ffn_down_exps.weight"]
    write(tmp_path / "d.gguf", only_down)
    convert(tmp_path / "d.gguf", tmp_path / "d-peft", "peft")
    st = load_file(str(tmp_path / "d-peft" / "adapter_model.safetensors"))
    assert sorted(st) == [f"{P.format(1)}.lora_A.weight", f"{P.format(1)}.lora_B.weight"]


def test_gpt_oss_gate_and_up_alternate_rows(gpt_oss_base, tmp_path):
    """gpt-oss's gate_up_proj holds gate and up in alternate outputs (llama.cpp's converter
    takes [..., ::2] and [..., 1::2]): PEFT's delta's even rows are ffn_gate_exps', the odd
    ffn_up_exps'; and back to the same tensors."""
    rng, t = np.random.default_rng(6), {}
    for i in range(2):
        t[f"{P.format(i)}.base_layer.lora_A.weight"] = rng.normal(0, 0.3, (R * 8, 64)).astype(np.float32)
        t[f"{P.format(i)}.base_layer.lora_B.weight"] = rng.normal(0, 0.3, (32, R * 8)).astype(np.float32)
        t[f"{P.format(i)}.lora_A.weight"] = rng.normal(0, 0.3, (R * 8, 16)).astype(np.float32)
        t[f"{P.format(i)}.lora_B.weight"] = rng.normal(0, 0.3, (64, R * 8)).astype(np.float32)
    src = write_peft(tmp_path / "peft", t, r=R, lora_alpha=2, target_parameters=["gate_up_proj", "down_proj"])
    convert(src, tmp_path / "a.gguf", model_base=gpt_oss_base)
    got = read_adapter(tmp_path / "a.gguf", GGUFFile(gpt_oss_base))
    for i in range(2):
        a, b = t[f"{P.format(i)}.base_layer.lora_A.weight"], t[f"{P.format(i)}.base_layer.lora_B.weight"]
        fused = np.einsum("ore,eri->eoi", b.reshape(32, R, 8), a.reshape(8, R, 64))       # (E, 2F, C), scale 1
        np.testing.assert_allclose(gguf_delta(got.pairs, f"blk.{i}.ffn_gate_exps.weight", 1.0), fused[:, ::2], rtol=1e-6)
        np.testing.assert_allclose(gguf_delta(got.pairs, f"blk.{i}.ffn_up_exps.weight", 1.0), fused[:, 1::2], rtol=1e-6)
    convert(tmp_path / "a.gguf", tmp_path / "back", "peft")
    back = load_file(str(tmp_path / "back" / "adapter_model.safetensors"))
    assert back.keys() == t.keys()
    for k in t:
        np.testing.assert_array_equal(back[k], t[k])


def test_bad_peft_expert_adapters(base, tmp_path):
    t = random_peft(np.random.default_rng(2), layers=1)
    src = write_peft(tmp_path / "p1", t, r=R, lora_alpha=4, target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(LlamatuneError, match=r"experts.base_layer' matches none of target_parameters"):
        convert(src, tmp_path / "x.gguf", model_base=base)
    src = write_peft(tmp_path / "p2", t, r=3, lora_alpha=4,
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    with pytest.raises(LlamatuneError, match=r"layer 0 .*are not rank 3 per expert"):
        convert(src, tmp_path / "y.gguf", model_base=base)


PEFT_SCRIPT = r"""
import json, sys, numpy as np, torch
from peft import LoraConfig, PeftModel, get_peft_model
out, ours, arch = sys.argv[1], sys.argv[2], sys.argv[3]
if arch == "qwen3moe":
    from transformers import Qwen3MoeConfig as Config, Qwen3MoeForCausalLM as Model
    cfg = Config(vocab_size=400, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2)
else:
    from transformers import GptOssConfig as Config, GptOssForCausalLM as Model
    cfg = Config(vocab_size=400, hidden_size=64, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2)
Qwen3MoeForCausalLM = Model
transposed = arch != "qwen3moe"     # gpt-oss's experts are (E, in, out): is_transposed
torch.manual_seed(0)
lc = LoraConfig(r=2, lora_alpha=6, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                init_lora_weights=False)
p = get_peft_model(Qwen3MoeForCausalLM(cfg), lc)
p.save_pretrained(out + "/peft")
def deltas(m):
    d = {}
    for i, layer in enumerate(m.base_model.model.model.layers):
        w = layer.mlp.experts
        while hasattr(w, "parameter_name"):
            delta = w.get_delta_weight("default").detach().numpy()
            d[f"{i}.{w.parameter_name}"] = delta.transpose(0, 2, 1) if transposed else delta   # (E, out, in)
            w = w.base_layer
    return d
np.savez(out + "/theirs.npz", **deltas(p))
q = PeftModel.from_pretrained(Qwen3MoeForCausalLM(cfg), ours)
np.savez(out + "/loaded.npz", **deltas(q))
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_against_peft_itself(base, gpt_oss_base, tmp_path, arch):
    """peft's own adapter (random A and B) converts to per-expert pairs whose s B A are its
    get_delta_weight (gpt-oss: gate and up in alternate rows); our export of an adapter with
    its own gate and up A loads in peft (PeftModel.from_pretrained) with get_delta_weight
    equal to ours."""
    torch_py = os.environ.get("TORCH_PYTHON")
    if not torch_py:
        pytest.skip("needs TORCH_PYTHON (a python with torch, transformers and peft)")
    model = base if arch == "qwen3moe" else gpt_oss_base
    n_e, f, c = (E, F, 32) if arch == "qwen3moe" else (8, 16, 64)
    split = (lambda x: (x[:, :f], x[:, f:])) if arch == "qwen3moe" else (lambda x: (x[:, ::2], x[:, 1::2]))
    rng = np.random.default_rng(3)
    adapter = LoraAdapter(arch, 4.0)
    for i in range(2):
        for kind, (n_out, n_in) in (("ffn_gate_exps", (f, c)), ("ffn_up_exps", (f, c)), ("ffn_down_exps", (c, f))):
            adapter.pairs[f"blk.{i}.{kind}.weight"] = (rng.normal(0, 0.3, (n_e, R, n_in)).astype(np.float32),
                                                       rng.normal(0, 0.3, (n_e, n_out, R)).astype(np.float32))
    write(tmp_path / "ours.gguf", adapter)
    convert(tmp_path / "ours.gguf", tmp_path / "ours-peft", "peft")
    subprocess.run([torch_py, "-c", PEFT_SCRIPT, str(tmp_path), str(tmp_path / "ours-peft"), arch], check=True)
    convert(tmp_path / "peft", tmp_path / "theirs.gguf", model_base=model)
    theirs, got = np.load(tmp_path / "theirs.npz"), read_adapter(tmp_path / "theirs.gguf", GGUFFile(model))
    loaded = np.load(tmp_path / "loaded.npz")
    for i in range(2):
        for mine, want in ((got, theirs), (adapter, loaded)):
            s = mine.scale(f"blk.{i}.ffn_gate_exps.weight")
            gate, up = split(want[f"{i}.gate_up_proj"])
            for kind, w in (("gate", gate), ("up", up)):
                np.testing.assert_allclose(gguf_delta(mine.pairs, f"blk.{i}.ffn_{kind}_exps.weight", s), w,
                                           rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(gguf_delta(mine.pairs, f"blk.{i}.ffn_down_exps.weight", s),
                                       want[f"{i}.down_proj"], rtol=1e-5, atol=1e-6)
