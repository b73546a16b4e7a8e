"""The no-download demo: build a tiny llama GGUF from the embedded text and run it.

Everything comes from the package itself: a public-domain Shakespeare sample
(`llamatune/assets/shakespeare-sample.txt`), a SentencePiece vocabulary trained on
it, and a small llama model written with the project's own writer, quantized to
Q8_0. The demo then does what a user does with a real model.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from gguf import GGMLQuantizationType as QType

from .config import ModelConfig
from .console import out
from .modelfile import random_weights, train_spm_vocab, write_model


def sample_text() -> str:
    return resources.files("llamatune").joinpath("assets/shakespeare-sample.txt").read_text(encoding="utf-8")


# A small model that trains in minutes on a laptop CPU.
QUICKSTART_CONFIG = ModelConfig(arch="llama", n_vocab=2048, n_ctx_train=256, n_embd=128, n_layer=4, n_ff=384,
                                n_head=4, n_head_kv=2, head_dim=32, n_rot=32, norm_eps=1e-5)


def build_base_model(path: Path, seed: int = 0) -> Path:
    """Write the quickstart base model (random weights, trained vocabulary, Q8_0)."""
    vocab = train_spm_vocab(sample_text(), QUICKSTART_CONFIG.n_vocab, "embedded sample")
    write_model(path, QUICKSTART_CONFIG, random_weights(QUICKSTART_CONFIG, seed=seed), vocab, QType.Q8_0,
                name="llamatune quickstart base")
    return path


def run(workdir: Path) -> None:
    from .infer import Runner
    from .model import Model
    from .perplexity import perplexity
    from .generate import generate, stream_text

    workdir.mkdir(parents=True, exist_ok=True)
    base = build_base_model(workdir / "quickstart-base.Q8_0.gguf")
    out.print(f"[bold]1.[/bold] wrote {base} (llama, {QUICKSTART_CONFIG.n_layer} layers, "
              f"embd {QUICKSTART_CONFIG.n_embd}, vocab {QUICKSTART_CONFIG.n_vocab}, Q8_0)")
    runner = Runner(Model(base))
    text = sample_text()
    res = perplexity(runner, text[-16000:], 128, 512, source="embedded sample")
    out.print(f"[bold]2.[/bold] perplexity of the untrained model on the sample: {res.ppl:.2f} "
              f"(a uniform guess over the vocabulary would be {QUICKSTART_CONFIG.n_vocab})")
    out.print("[bold]3.[/bold] generating from it:")
    prompt = "KING OF FRANCE."
    import sys
    sys.stdout.write(prompt)
    stream_text(runner, prompt, generate(runner, prompt, 24, temp=0.8, seed=0), sys.stdout.write)
    sys.stdout.write("\n")
