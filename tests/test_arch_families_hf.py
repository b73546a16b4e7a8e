"""olmo2, smollm3 and granite against HF transformers and llama.cpp, on tiny models that
HF made (random init, a few hundred AdamW steps on shakespeare.txt) and llama.cpp's
convert_hf_to_gguf.py converted to F32 and Q8_0 (checks/families_hf.py, under a Python
with torch, transformers and peft):

  - perplexity of shakespeare-eval.txt (-c 128): llamatune's equals llama-perplexity's
    (F32 without activation rounding, and Q8_0) and HF's (float64, the same windows scored
    as llama-perplexity scores them) within 0.1 %;
  - loss and LoRA gradients (every layer matrix, float64) equal HF's autograd through peft
    to 1e-6 relative (per tensor: max |difference| / max |HF's|);
  - a 40-step LoRA finetune lowers the perplexity, and llama-perplexity --lora gives
    llamatune's perplexity of the base with the adapter within 0.5 %.

Measured (200 HF steps; 4 layers of 64, 4 heads, 2 KV heads, vocabulary 512):
  perplexity F32 llamatune / llama-perplexity / HF, then Q8_0 llamatune / llama-perplexity:
    olmo2    65.92494 / 65.9249 / 65.92494     65.8901 / 65.9015
    smollm3  54.79979 / 54.7998 / 54.79980     54.7888 / 54.7908
    granite 119.05832 / 119.0583 / 119.05832   119.0290 / 119.023
  float64 loss (HF) and the worst LoRA gradient's difference over its tensor's largest:
    olmo2 4.213494420 (4.213494415) 3.4e-7; smollm3 4.010733546 (4.010733539) 3.1e-7;
    granite 4.736651496 (4.736651497) 7.1e-7
  40-step rank-8 LoRA on Q8_0, perplexity base -> tuned (llama-perplexity --lora):
    olmo2 65.890 -> 62.451 (62.4512); smollm3 54.789 -> 53.487 (53.4785);
    granite 119.029 -> 117.756 (117.7599)

Slow (each family's model takes minutes to make); skipped without TORCH_PYTHON (an
interpreter with torch, transformers and peft) and LLAMA_BIN_DIR (llama.cpp's build/bin,
its convert_hf_to_gguf.py two folders up or in LLAMA_CPP_DIR). LLAMATUNE_HF_WORK keeps
the made models between runs.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, need

FAMILIES = ("olmo2", "smollm3", "granite")
SHARED = REPO.parent / "shared" / "data"
EVAL_CHARS = 12000
N_CTX = 128
CPP_EXACT = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]
pytestmark = pytest.mark.slow


def tools() -> tuple[str, Path, Path]:
    torch_py, bin_dir = os.environ.get("TORCH_PYTHON"), os.environ.get("LLAMA_BIN_DIR")
    if not torch_py or not bin_dir:
        pytest.skip("needs TORCH_PYTHON (torch, transformers, peft) and LLAMA_BIN_DIR (llama.cpp's build/bin)")
    cpp = Path(os.environ.get("LLAMA_CPP_DIR", Path(bin_dir).parent.parent))
    if not (cpp / "convert_hf_to_gguf.py").exists():
        pytest.skip(f"llama.cpp's convert_hf_to_gguf.py not in {cpp} (set LLAMA_CPP_DIR)")
    return torch_py, Path(bin_dir), cpp


def hf_side(*args) -> None:
    subprocess.run([tools()[0], "-m", "checks.families_hf", *map(str, args)], check=True, cwd=REPO)


@pytest.fixture(scope="module", params=FAMILIES)
def made(request, tmp_path_factory):
    """(family, work folder) with hf/, FAMILY-F32.gguf and FAMILY-Q8_0.gguf."""
    fam = request.param
    torch_py, bin_dir, cpp = tools()
    work = Path(os.environ["LLAMATUNE_HF_WORK"]) / fam if os.environ.get("LLAMATUNE_HF_WORK") \
        else tmp_path_factory.mktemp(fam)
    if not (work / f"{fam}-Q8_0.gguf").exists():
        hf_side("build", fam, work, "--data", need(SHARED / "shakespeare.txt"), "--steps", 200, "--llama-cpp", cpp)
    return fam, work


def eval_text(tmp: Path) -> Path:
    path = tmp / "eval.txt"
    path.write_text(need(SHARED / "shakespeare-eval.txt").read_text(encoding="utf-8")[:EVAL_CHARS], encoding="utf-8")
    return path


def cpp_ppl(model: Path, text: Path, *extra) -> float:
    args = [tools()[1] / "llama-perplexity", "-m", model, "-f", text, "-c", N_CTX, "-b", N_CTX, "-t", 2, "-nr", *extra]
    out = subprocess.run([str(a) for a in args], capture_output=True, text=True, check=True)
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr).group(1))


def lt_ppl(model: Path, text: Path, adapter: Path | None = None) -> float:
    from llamatune.commands.perplexity import perplexity
    from llamatune.formats.adapter import load_runtime_adapters
    from llamatune.models.infer import Runner
    from llamatune.models.model import Model
    m = Model(model)
    adapters = load_runtime_adapters(m, [(str(adapter), 1.0)]) if adapter else None
    return perplexity(Runner(m, adapters), text.read_text(encoding="utf-8"), N_CTX, N_CTX).ppl


def hf_ppl(work: Path, model: Path, text: Path) -> float:
    """HF's logits (float64) of llama-perplexity's windows, scored as it scores them."""
    from llamatune.commands.perplexity import make_windows
    from llamatune.models.model import Model
    tok = Model(model).tokenizer
    windows = make_windows(tok.encode(text.read_text(encoding="utf-8"), add_special=True), N_CTX, tok.bos_id,
                           tok.add_bos, "eval")
    np.savez(work / "windows.npz", tokens=windows)
    hf_side("logits", work / "hf", work / "windows.npz", work / "hf-logits.npz")
    z = np.load(work / "hf-logits.npz")["logits"][:, N_CTX // 2:N_CTX - 1]
    targets = windows[:, N_CTX // 2 + 1:]
    m = z.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
    nll = lse - np.take_along_axis(z, targets[..., None], -1)[..., 0]
    return math.exp(nll.mean())


def test_perplexity_equals_llama_cpp_and_hf(made, tmp_path):
    fam, work = made
    text = eval_text(tmp_path)
    f32, q8 = work / f"{fam}-F32.gguf", work / f"{fam}-Q8_0.gguf"
    ours = lt_ppl(f32, text)
    figures = dict(llamatune=ours, llama_cpp=cpp_ppl(f32, text, *CPP_EXACT), hf=hf_ppl(work, f32, text),
                   llamatune_q8=lt_ppl(q8, text), llama_cpp_q8=cpp_ppl(q8, text))
    print(fam, figures)
    assert ours < 256                                      # trained: far below the 512 of a uniform guess
    assert ours == pytest.approx(figures["llama_cpp"], rel=1e-3)
    assert ours == pytest.approx(figures["hf"], rel=1e-3)
    assert figures["llamatune_q8"] == pytest.approx(figures["llama_cpp_q8"], rel=1e-3)


def lora_inputs(model, T: int = 48, seed: int = 0):
    """A float64 LoRA of rank 2, alpha 3 on every layer matrix (B nonzero) and one batch of the eval text."""
    from checks.arch_reference import lora_setup
    targets, params = lora_setup(model, {k: 2 for k in model.config.spec.matrices}, np.float64, seed=seed)
    rng = np.random.default_rng(seed)
    tokens = np.asarray(model.tokenizer.encode(eval_text_cached(), add_special=False))
    starts = rng.integers(0, len(tokens) - T - 1, 2)
    inputs = np.stack([tokens[s:s + T] for s in starts])
    tg = np.stack([tokens[s + 1:s + T + 1] for s in starts])
    tg[1, -3:] = -1                                        # a few positions without a target
    weights = (tg >= 0) / (tg >= 0).sum()
    return targets, params, inputs, tg, weights


def eval_text_cached() -> str:
    return need(SHARED / "shakespeare-eval.txt").read_text(encoding="utf-8")[:4000]


def test_loss_and_lora_gradients_equal_hf_autograd(made):
    from llamatune.formats.peft import hf_module, unpermute_rows, permute_rows
    from llamatune.commands.convert import peft_names
    from llamatune.models.model import Model
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    fam, work = made
    model = Model(work / f"{fam}-F32.gguf")
    cfg = model.config
    targets, params, inputs, tg, w = lora_inputs(model)
    g = StepExecutor(cfg, FrozenBase(model), params, targets, *inputs.shape, "none", dtype=np.float64)
    params.zero_grad()
    loss = g.step(inputs, tg, w)
    names = peft_names(cfg.arch)
    heads = {"attn_q": cfg.n_head, "attn_k": cfg.n_head_kv}

    def rows(t, m, back=False):        # llama.cpp's q/k row order (NORM rope) <-> HF's
        n = heads.get(t.kind) if names.permute_qk else None
        return m if n is None else (permute_rows(m, n) if back else unpermute_rows(m, n))
    arrays = dict(tokens=inputs, targets=tg, weights=w, lora_r=2, lora_alpha=2 * targets[0].scale)
    for t in targets:
        module = hf_module(t.weight, names)
        arrays[f"A:{module}"], arrays[f"B:{module}"] = params[t.a], rows(t, params[t.b])
    np.savez(work / "grads-in.npz", **arrays)
    hf_side("grads", work / "hf", work / "grads-in.npz", work / "grads-out.npz")
    hf = np.load(work / "grads-out.npz")
    assert loss == pytest.approx(float(hf["loss"]), rel=1e-6)
    worst = 0.0
    for t in targets:
        module = hf_module(t.weight, names)
        for ours, theirs in ((params.grad_of(t.a), hf[f"dA:{module}"]),
                             (params.grad_of(t.b), rows(t, hf[f"dB:{module}"], back=True))):
            assert np.abs(theirs).max() > 0, t.weight
            worst = max(worst, np.abs(ours - theirs).max() / np.abs(theirs).max())
    print(fam, "loss", loss, "HF", float(hf["loss"]), "worst gradient difference", worst)
    assert worst < 1e-6


def test_lora_finetune_lowers_perplexity_and_llama_cpp_agrees(made, tmp_path):
    from llamatune.commands.finetune import finetune
    from llamatune.options import FinetuneOptions
    fam, work = made
    text = eval_text(tmp_path)
    train = tmp_path / "train.txt"
    train.write_text(need(SHARED / "shakespeare.txt").read_text(encoding="utf-8")[:200_000], encoding="utf-8")
    q8 = work / f"{fam}-Q8_0.gguf"
    finetune(FinetuneOptions(model_base=q8, train_data=train, ctx=64, batch=8, lora_r=8, adam_iter=40, warmup=5,
                             adam_alpha=3e-3, save_every=0, checkpoint_out=tmp_path / "chk-ITERATION.gguf",
                             lora_out=tmp_path / "adapter-ITERATION.gguf"), quiet=True)
    adapter = tmp_path / "adapter-LATEST.gguf"
    base, tuned = lt_ppl(q8, text), lt_ppl(q8, text, adapter)
    theirs = cpp_ppl(q8, text, "--lora", adapter)
    print(fam, dict(base=base, tuned=tuned, llama_cpp_tuned=theirs))
    assert tuned < base
    assert tuned == pytest.approx(theirs, rel=5e-3)
