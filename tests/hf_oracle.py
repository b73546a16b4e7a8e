"""What the Hugging Face oracle tests of the newer families share (slow tests): the torch
interpreter (LLAMATUNE_TORCH_PYTHON), llama.cpp's tools (LLAMA_BIN_DIR), a tiny model
made by HF and converted by llama.cpp through a checks/*_hf.py oracle, and perplexity as
llama-perplexity and as llamatune's CLI report it. Tests skip with the reason when the
interpreter or the tools are absent."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

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
