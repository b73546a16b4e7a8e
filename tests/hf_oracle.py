"""What the Hugging Face oracle tests of the newer families share (slow tests): the torch
interpreter (LLAMATUNE_TORCH_PYTHON), llama.cpp's tools (LLAMA_BIN_DIR), a tiny model
made by HF and converted by llama.cpp through a checks/*_hf.py oracle, and perplexity as
llama-perplexity and as llamatune's CLI report it. Tests skip with the reason when the
interpreter or the tools are absent. The checks the oracle tests share: logits, perplexity
against llama-perplexity's and HF's, the loss and LoRA gradients against HF's autograd, a
short LoRA that llama-perplexity --lora scores as llamatune does, greedy generation."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import TEXT

TORCH_PY = Path(os.environ.get("LLAMATUNE_TORCH_PYTHON", "LLAMATUNE_TORCH_PYTHON-not-set"))
REPO = Path(__file__).resolve().parents[1]
PPL_RE = r"Final estimate: PPL = ([0-9.]+)"


def bins() -> Path | None:
    """llama.cpp's build/bin (LLAMA_BIN_DIR) when it holds llama-perplexity."""
    b = os.environ.get("LLAMA_BIN_DIR")
    return Path(b) if b and (Path(b) / "llama-perplexity").exists() else None


def oracle(module: str, cmd: str, *args) -> None:
    """One command of a checks/*_hf.py oracle, run by the torch interpreter from the repository root."""
    subprocess.run([str(TORCH_PY), "-m", module, cmd, *map(str, args)], check=True, capture_output=True, cwd=REPO)


def built_model(tmp_path_factory, module: str, steps: int = 200) -> Path:
    """A folder with the oracle's HF model (hf/, `steps` training steps), its F32 and Q8_0
    conversions and eval.txt (the last 6,000 characters of the shared Shakespeare text)."""
    if not TORCH_PY.exists():
        pytest.skip(f"no interpreter with torch and transformers at {TORCH_PY} (LLAMATUNE_TORCH_PYTHON)")
    if bins() is None:
        pytest.skip("llama.cpp's tools not found (LLAMA_BIN_DIR=<llama.cpp>/build/bin)")
    d = tmp_path_factory.mktemp(module.rsplit(".", 1)[-1])
    oracle(module, "build", d / "hf", "--steps", steps)
    for outtype in ("f32", "q8_0"):
        oracle(module, "convert", d / "hf", d / f"{outtype}.gguf", "--outtype", outtype,
               "--llama-cpp", bins().resolve().parents[1])
    data = REPO.parent / "shared" / "data" / "shakespeare.txt"
    (d / "eval.txt").write_text(data.read_text(encoding="utf-8")[-6000:] if data.exists() else TEXT[:6000],
                                encoding="utf-8")
    return d


def llama_ppl(d: Path, model: Path, *extra) -> float:
    """llama-perplexity of d/eval.txt at ctx 64 (no weight repacking)."""
    out = subprocess.run([str(bins() / "llama-perplexity"), "-m", str(model), "-f", str(d / "eval.txt"), "-c", "64",
                          "-b", "64", "-nr", "-t", "2", *map(str, extra)], capture_output=True, text=True, check=True)
    return float(re.search(PPL_RE, out.stdout + out.stderr).group(1))


def our_ppl(model: Path, text: Path, *extra) -> float:
    """`llamatune perplexity` of text at ctx 64."""
    from typer.testing import CliRunner

    from llamatune.cli.main import app
    r = CliRunner().invoke(app, ["perplexity", "-m", str(model), "-f", str(text), "-c", "64", *map(str, extra)])
    assert r.exit_code == 0, r.output
    return float(re.search(PPL_RE, r.output).group(1))


def hf_logits(d: Path, module: str, tokens: np.ndarray, name: str = "tokens") -> np.ndarray:
    """The oracle's float64 logits (B, T, V) of the token rows (B, T) by its model d/hf
    (d/NAME.npy and d/NAME-logits.npy its files)."""
    np.save(d / f"{name}.npy", tokens)
    oracle(module, "logits", d / "hf", d / f"{name}.npy", d / f"{name}-logits.npy")
    return np.load(d / f"{name}-logits.npy")


def check_logits(d: Path, module: str, n_tokens: int, tol: float) -> None:
    """llamatune's float32 logits of 2 random rows of n_tokens by d/f32.gguf equal the
    oracle's float64 ones to tol times their largest magnitude."""
    from llamatune.models.infer import Runner
    from llamatune.models.model import Model
    model = Model(d / "f32.gguf")
    tokens = np.random.default_rng(0).integers(0, model.config.n_vocab, (2, n_tokens))
    want = hf_logits(d, module, tokens)
    np.testing.assert_allclose(Runner(model).forward(tokens), want, rtol=0, atol=tol * np.abs(want).max())


def check_perplexity(d: Path, module: str, outtype: str, bos: bool = False) -> None:
    """llamatune's perplexity of d/eval.txt with d/OUTTYPE.gguf equals llama-perplexity's
    (windows of 64 tokens, the second half scored) and HF's from its float64 logits of the
    same windows (the F32 file's weights; BOS first where `bos`, as llama-perplexity puts
    it), each to 0.1 %."""
    from checks.arch_reference import cross_entropy
    from llamatune.models.model import Model
    path = d / f"{outtype}.gguf"
    ours, theirs = our_ppl(path, d / "eval.txt"), llama_ppl(d, path)
    assert abs(ours - theirs) <= 1e-3 * theirs, (ours, theirs)
    model = Model(path)
    ids = model.tokenizer.encode((d / "eval.txt").read_text(encoding="utf-8"))
    rows = np.array([ids[c * 64:(c + 1) * 64] for c in range(len(ids) // 64)])
    if bos:
        rows[:, 0] = model.tokenizer.bos_id
    z = hf_logits(d, module, rows, "rows")
    hf = float(np.exp(np.mean(np.concatenate([cross_entropy(z[r, 32:-1], rows[r, 33:]) for r in range(len(rows))]))))
    assert abs(ours - hf) <= 1e-3 * hf, (ours, hf)


def check_lora_gradients_against_hf(d: Path, module: str, ranks: dict[str, int], n_tokens: int, tied: bool,
                                    hf_weight_grad) -> list:
    """B = 0: the adapted model is HF's, so the float64 training graph's loss of 2 random rows
    of n_tokens equals HF's (the oracle's `grads`) and dL/dB = s dL/dW A^T (per expert for the
    experts) with HF's dL/dW, each to 1e-6 relative. hf_weight_grad(grads, layer, kind, cfg):
    HF's dL/dW of that weight in the GGUF's layout. Returns the LoRA targets."""
    from llamatune.models.model import Model
    from llamatune.models.weights import FrozenBase
    from llamatune.train.lora import init_lora, lora_specs, lora_targets
    from llamatune.train.params import ParamBuffer
    from llamatune.train.step import StepExecutor
    model = Model(d / "f32.gguf")
    cfg = model.config
    rng = np.random.default_rng(4)
    ids = rng.integers(0, cfg.n_vocab, (2, n_tokens + 1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    weights = np.full(targets.shape, 1 / targets.size)
    np.savez(d / "batch.npz", inputs=inputs, targets=targets, weights=weights)
    oracle(module, "grads", d / "hf", d / "batch.npz", d / "grads.npz")
    hf = np.load(d / "grads.npz")
    ts = lora_targets(cfg, ranks, alpha=8.0, tied=tied)
    params = ParamBuffer(lora_specs(ts), np.float64)
    init_lora(params, ts, rng)
    g = StepExecutor(cfg, FrozenBase(model), params, ts, 2, n_tokens, "none", dtype=np.float64)
    loss = g.step(inputs, targets, weights)
    assert abs(loss - float(hf["loss"])) <= 1e-6 * abs(float(hf["loss"]))
    for t in ts:
        G = hf_weight_grad(hf, int(t.weight.split(".")[1]), t.kind, cfg)
        want = t.scale * G @ np.swapaxes(params[t.a], -1, -2)
        got = params.grad_of(t.b)
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), t.weight
    return ts


def check_short_lora(d: Path, tmp_path: Path) -> None:
    """40 steps of finetune (r 4) on d/eval.txt over the Q8_0 file lower its perplexity by
    3 % or more, and llama-perplexity --lora gives llamatune's within 0.5 %."""
    from typer.testing import CliRunner

    from llamatune.cli.main import app
    base = d / "q8_0.gguf"
    r = CliRunner().invoke(app, [str(a) for a in (
        "finetune", "--model-base", base, "--train-data", d / "eval.txt", "--ctx", 64, "--batch", 4, "--lora-r", 4,
        "--adam-iter", 40, "--adam-alpha", 3e-3, "--warmup", 2, "--save-every", 0,
        "--checkpoint-out", tmp_path / "chk-ITERATION.gguf", "--lora-out", tmp_path / "adapter-ITERATION.gguf")])
    assert r.exit_code == 0, r.output
    adapter = tmp_path / "adapter-LATEST.gguf"
    before, after = our_ppl(base, d / "eval.txt"), our_ppl(base, d / "eval.txt", "--lora", adapter)
    assert after < 0.97 * before, (before, after)
    theirs = llama_ppl(d, base, "--lora", adapter)
    assert abs(after - theirs) <= 5e-3 * theirs, (after, theirs)


def check_greedy_generation(d: Path) -> None:
    """48 greedy tokens of the F32 file through the cache, as llama-completion's."""
    from typer.testing import CliRunner

    from llamatune.cli.main import app
    model = d / "f32.gguf"
    theirs = subprocess.run([str(bins() / "llama-completion"), "-m", str(model), "-p", "First Citizen:", "-n", "48",
                             "--temp", "0", "-nr", "-t", "2", "-no-cnv", "--no-warmup"], capture_output=True, text=True,
                            check=True, timeout=300).stdout
    r = CliRunner().invoke(app, ["generate", "-m", str(model), "-p", "First Citizen:", "-n", "48", "--temp", "0"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == theirs.strip()
