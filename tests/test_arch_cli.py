"""Each new architecture end to end through the command line, on a tiny Q8_0 model:
finetune (LoRA on every kind it has, the new norms included) and its exact resume,
perplexity and generate with the adapter, export-lora keeping the tensor types,
convert-checkpoint to PEFT names and back."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from typer.testing import CliRunner

from checks.arch_reference import write_arch_model
from conftest import TEXT, tiny_config
from llamatune.cli.main import app
from llamatune.formats.gguf_io import GGUFFile

SHAPE = dict(n_embd=32, n_ff=64, n_head=4, n_head_kv=2, head_dim=8, n_rot=8, n_ctx_train=64)
CONFIGS = {
    "qwen3": dict(SHAPE),
    "gemma": dict(SHAPE),
    "gemma2": dict(SHAPE, attn_softcap=20.0, final_softcap=15.0, sliding_window=8, swa_pattern=2),
    "gemma3": dict(SHAPE, sliding_window=8, swa_pattern=2, rope_freq_base=1e6, rope_freq_base_swa=10000.0,
                   rope_freq_scale_swa=1.0),
    "olmo2": dict(SHAPE),
    "smollm3": dict(SHAPE, n_layer=4, nope_step=4),
    "granite": dict(SHAPE, embd_multiplier=12.0, attn_scale=0.0625, residual_scale=0.375, logit_scale=8.0),
}
NEW_NORM_FLAGS = {"attn_q_norm": "--rank-q-norm", "attn_k_norm": "--rank-k-norm",
                  "post_attention_norm": "--rank-post-att-norm", "post_ffw_norm": "--rank-post-ffn-norm"}


def run(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_finetune_resume_perplexity_generate_export_convert(arch, tmp_path, tiny_vocab):
    cfg = tiny_config(arch, **CONFIGS[arch])
    model = write_arch_model(tmp_path / f"{arch}.Q8_0.gguf", cfg, tiny_vocab, seed=3, outtype=QType.Q8_0)
    (tmp_path / "t.txt").write_text(TEXT)
    norms = [f for kind, f in NEW_NORM_FLAGS.items() if kind in cfg.spec.norms]
    train = ["finetune", "--model-base", model, "--train-data", tmp_path / "t.txt", "--ctx", 16, "--batch", 2,
             "--lora-r", 2, *(["--rank-att-norm", 1] if "attn_norm" in cfg.spec.norms else []), "--warmup", 1, "--adam-alpha", 1e-2, "--save-every", 0,
             "--checkpoint-out", tmp_path / "chk-ITERATION.gguf", "--lora-out", tmp_path / "adapter-ITERATION.gguf",
             *[x for f in norms for x in (f, 1)]]
    run(*train, "--adam-iter", 2)
    run(*train, "--adam-iter", 3, "--checkpoint-in", tmp_path / "chk-LATEST.gguf")
    adapter = GGUFFile(tmp_path / "adapter-LATEST.gguf")
    assert adapter.get("general.architecture") == arch
    kinds = {n.split(".")[2] for n in adapter.tensors if n.startswith("blk.0.")}
    assert set(cfg.spec.norms) - {"ffn_norm"} <= kinds and "attn_q" in kinds and "ffn_down" in kinds

    base_ppl = run("perplexity", "-m", model, "-f", tmp_path / "t.txt", "-c", 16)
    lora_ppl = run("perplexity", "-m", model, "-f", tmp_path / "t.txt", "-c", 16, "--lora", tmp_path / "adapter-LATEST.gguf")
    assert "Final estimate: PPL = " in base_ppl and base_ppl != lora_ppl
    assert "\nFirst Citizen:" in run("generate", "-m", model, "-p", "First Citizen:", "-n", 4, "--temp", 0,
                                     "--lora", tmp_path / "adapter-LATEST.gguf")   # after the norm-adapter notice

    run("export-lora", "-m", model, "--lora", tmp_path / "adapter-LATEST.gguf", "-o", tmp_path / "merged.gguf")
    base, merged = GGUFFile(model), GGUFFile(tmp_path / "merged.gguf")
    assert {n: t.qtype for n, t in merged.tensors.items()} == {n: t.qtype for n, t in base.tensors.items()}
    changed = [n for n in base.tensors if not np.array_equal(np.array(base.tensors[n].data),
                                                             np.array(merged.tensors[n].data))]
    assert "blk.0.attn_q.weight" in changed                 # every norm with an adapter (olmo2 has no attn_norm)
    assert all(f"blk.0.{k}.weight" in changed for k in cfg.spec.norms if k != "ffn_norm")

    run("convert-checkpoint", tmp_path / "adapter-LATEST.gguf", "--to", "peft", "-o", tmp_path / "peft",
        "--model-base", model)
    run("convert-checkpoint", tmp_path / "peft", "--to", "gguf-adapter", "-o", tmp_path / "back.gguf",
        "--model-base", model)
    back = GGUFFile(tmp_path / "back.gguf")
    matrices = [n for n in adapter.tensors if not any(f".{k}.weight" in n for k in cfg.spec.norms + ("output_norm",))]
    assert sorted(back.tensors) == sorted(matrices)         # PEFT holds no norm adapters
    for n in matrices:
        np.testing.assert_allclose(np.array(back.tensors[n].data), np.array(adapter.tensors[n].data), rtol=1e-6)
