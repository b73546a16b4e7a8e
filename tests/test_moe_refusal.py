"""Files llamatune cannot run yet are refused in one line, before anything computes: a
mixture-of-experts model of a family not declared with experts (a family llama.cpp knows
as one, qwen2moe, olmoe, llama4, ..., or any file whose `{arch}.expert_count` is above
0, as Mixtral's `llama`) names its architecture and lists the supported ones (qwen3moe and
gpt-oss are); a tensor of an unknown ggml type, or of a
type nothing here dequantizes, is named with its type. The files are small synthetic
GGUFs (the tiny llama's tensors under another architecture's keys, plus 3-D expert
tensors as llama.cpp names them); the CLI cases run `llamatune perplexity` as a user
does: exit 1, one `error:` line, no traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from checks import fuzz_mutate as fm
from conftest import TEXT, write_tiny_model
from llamatune.errors import LlamatuneError
from llamatune.formats.gguf_io import GGUFFile, KV, kv, tensor_out, write_gguf
from llamatune.models.arch import MOE_ARCHS, moe_supported, supported
from llamatune.models.config import ModelConfig

SUPPORTED = (f"(supported: dense models of {', '.join(n for n in supported() if n not in moe_supported())}; "
             f"mixtures of experts of {', '.join(moe_supported())})")
EXPERTS = ("blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight",
           "blk.0.ffn_down_exps.weight")


def as_arch(src: Path, dst: Path, arch: str, n_experts: int = 0, expert_type=None) -> Path:
    """src's tensors and metadata under `arch` (its `llama.*` keys renamed); with n_experts,
    `{arch}.expert_count` / `expert_used_count` and layer 0's router and expert tensors
    (n_experts, n_ff, n_embd), in `expert_type` bytes (zeros) where given."""
    f = GGUFFile(src)
    kvs = [KV(k.replace("llama.", f"{arch}.", 1), v.value, v.vtype, v.sub_type) for k, v in f.kvs.items()]
    tensors = [tensor_out(n, np.array(t.data)) for n, t in f.tensors.items()]
    if n_experts:
        kvs += [kv(f"{arch}.expert_count", n_experts), kv(f"{arch}.expert_used_count", 2)]
        C, F = f.tensors["blk.0.ffn_gate.weight"].shape[::-1]
        shapes = [(n_experts, C), (n_experts, F, C), (n_experts, F, C), (n_experts, C, F)]
        tensors += [tensor_out(n, np.full(s, 0.01, np.float32)) for n, s in zip(EXPERTS, shapes)]
    write_gguf(dst, arch, kvs, tensors)
    return dst


def with_type_id(src: Path, dst: Path, name: str, type_id: int) -> Path:
    """src with the ggml type id of tensor `name` overwritten (its bytes left as they are)."""
    lay = fm.Layout(src)
    at = next(t for t in lay.tinfos if t[0] == name)[4]
    data = bytearray(src.read_bytes())
    data[at:at + 4] = type_id.to_bytes(4, "little")
    dst.write_bytes(bytes(data))
    return dst


def perplexity(model: Path, tmp_path: Path) -> str:
    """`llamatune perplexity -m model`: exit 1, exactly one error line (returned), no traceback."""
    (tmp_path / "t.txt").write_text(TEXT)
    p = subprocess.run([sys.executable, "-m", "llamatune.cli.main", "perplexity", "-m", str(model),
                        "-f", str(tmp_path / "t.txt"), "-c", "16"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "PPL" not in p.stdout, p.stderr
    return lines[0]


@pytest.mark.parametrize("arch,n_experts", [("qwen2moe", 8), ("olmoe", 4), ("llama", 8)],
                         ids=["qwen2moe", "olmoe", "mixtral-llama"])
def test_cli_refuses_a_mixture_of_experts(tmp_path, tiny_model, arch, n_experts):
    path = as_arch(tiny_model, tmp_path / "moe.gguf", arch, n_experts)
    assert perplexity(path, tmp_path) == (
        f"error: {path}: architecture '{arch}' with {n_experts} experts is a mixture of experts not supported "
        f"yet {SUPPORTED}")


@pytest.mark.parametrize("arch", ["qwen3next", "llama4", "openai-moe", "qwen2moe", "deepseek2"])
def test_known_moe_families_are_refused_without_an_expert_count(tmp_path, tiny_model, arch):
    md = GGUFFile(as_arch(tiny_model, tmp_path / "m.gguf", arch)).metadata
    assert arch in MOE_ARCHS and f"{arch}.expert_count" not in md
    with pytest.raises(LlamatuneError) as e:
        ModelConfig.from_metadata(md, "m.gguf")
    assert str(e.value) == f"m.gguf: architecture '{arch}' is a mixture of experts not supported yet {SUPPORTED}"


def test_unknown_dense_architecture_is_refused_as_before(tiny_model, tmp_path):
    md = GGUFFile(as_arch(tiny_model, tmp_path / "m.gguf", "falcon")).metadata
    with pytest.raises(LlamatuneError, match=r"^m.gguf: architecture 'falcon' is not supported \(supported: gemma, "):
        ModelConfig.from_metadata(md, "m.gguf")


@pytest.mark.parametrize("value,match", [("8", r"is a string '8', expected an integer"),
                                         (-1, r"is -1, expected 0 to")])
def test_expert_count_must_be_a_count(tiny_model, value, match):
    md = dict(GGUFFile(tiny_model).metadata, **{"llama.expert_count": value})
    with pytest.raises(LlamatuneError, match=r"x: metadata key 'llama.expert_count' " + match):
        ModelConfig.from_metadata(md, "x")


def test_dense_file_with_a_zero_expert_count_loads(tiny_model):
    md = dict(GGUFFile(tiny_model).metadata, **{"llama.expert_count": 0})
    assert ModelConfig.from_metadata(md, "x").arch == "llama"


def test_cli_refuses_an_unknown_type_in_an_expert_tensor(tmp_path, tiny_model):
    moe = as_arch(tiny_model, tmp_path / "moe.gguf", "qwen3moe", 8)
    bad = with_type_id(moe, tmp_path / "bad.gguf", "blk.0.ffn_up_exps.weight", 99)
    assert perplexity(bad, tmp_path) == f"error: {bad}: tensor 'blk.0.ffn_up_exps.weight' has unknown ggml type id 99"


def test_cli_refuses_a_type_that_cannot_be_dequantized(tmp_path, tiny_vocab):
    """Q8_K (ggml's intermediate type: neither llamatune nor the gguf package dequantizes it)
    in a weight the model computes with."""
    base = write_tiny_model(tmp_path / "base.gguf", tiny_vocab, n_embd=256, head_dim=64, n_rot=64)
    f = GGUFFile(base)
    name = "blk.0.ffn_gate.weight"
    rows = f.tensors[name].shape[0]
    tensors = [tensor_out(n, np.zeros((rows, 292), np.uint8), QType.Q8_K) if n == name
               else tensor_out(n, np.array(t.data)) for n, t in f.tensors.items()]
    write_gguf(tmp_path / "q8k.gguf", f.arch, f.kvs.values(), tensors)
    assert perplexity(tmp_path / "q8k.gguf", tmp_path) == (
        f"error: {tmp_path / 'q8k.gguf'}: tensor '{name}' has type Q8_K, which cannot be dequantized")
