"""The command line: outputs, exit codes, one-line errors without tracebacks."""
from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from llamatune.cli.main import app

from conftest import TEXT, VOCAB, need

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def run_process(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "llamatune.cli.main", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def test_help_imports_nothing_heavy():
    """`llamatune --help` must not import numpy/numba/gguf (and so compiles nothing)."""
    code = ("import sys; from llamatune.cli.main import app; "
            "print(sorted(m for m in ('numpy', 'numba', 'gguf', 'llamatune.models.model') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_help_lists_commands():
    r = run("--help")
    assert r.exit_code == 0
    for cmd in ("finetune", "train-from-scratch", "perplexity", "generate", "tokenize", "quickstart"):
        assert cmd in r.output


def test_tokenize_ids(tiny_model):
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.models.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(GGUFFile(tiny_model))
    r = run("tokenize", "-m", tiny_model, "-p", "Speak, speak.", "--ids")
    assert r.exit_code == 0, r.output
    assert r.output.strip() == str(tok.encode("Speak, speak.", add_special=True))
    r = run("tokenize", "-m", tiny_model, "-p", "Speak, speak.", "--ids", "--no-bos")
    assert r.output.strip() == str(tok.encode("Speak, speak.", add_special=False))


def test_tokenize_file_exact_text_on_vocab_only_gguf(tmp_path):
    vocab = need(VOCAB / "ggml-vocab-llama-spm.gguf")
    text = "  Hello\n\nworld  \n"                       # leading/trailing whitespace must survive
    (tmp_path / "t.txt").write_text(text)
    r = run("tokenize", "-m", vocab, "-f", tmp_path / "t.txt", "--ids", "--no-bos")
    assert r.exit_code == 0, r.output
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.models.tokenizer import Tokenizer
    assert r.output.strip() == str(Tokenizer.from_gguf(GGUFFile(vocab)).encode(text, add_special=False))


def test_tokenize_pieces(tiny_model):
    r = run("tokenize", "-m", tiny_model, "-p", "Speak")
    assert r.exit_code == 0
    assert "     1 -> '<s>'" in r.output


def test_perplexity_runs(tiny_model, tmp_path):
    (tmp_path / "t.txt").write_text(TEXT)
    r = run("perplexity", "-m", tiny_model, "-f", tmp_path / "t.txt", "-c", 16, "-b", 64)
    assert r.exit_code == 0, r.output
    assert "Final estimate: PPL = " in r.output


def test_generate_runs(tiny_model):
    r = run("generate", "-m", tiny_model, "-p", "First Citizen:", "-n", 5, "--temp", 0)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("First Citizen:")
    assert r.stderr.startswith("compute: ")                 # the resolved --compute-dtype (auto)


@pytest.mark.parametrize("args,match", [
    (["perplexity", "-m", "{tmp}/missing.gguf", "-f", "{text}"], "missing.gguf: file not found"),
    (["perplexity", "-m", "{model}", "-f", "{tmp}/nope.txt"], "nope.txt: text file not found"),
    (["perplexity", "-m", "{model}", "-f", "{empty}"], "text is empty"),
    (["perplexity", "-m", "{model}", "-f", "{text}", "-c", "4096"], "larger than the model's context length 64"),
    (["perplexity", "-m", "{notgguf}", "-f", "{text}"], "not a GGUF file"),
    (["tokenize", "-m", "{model}"], "give exactly one of -p/--prompt and -f/--file"),
    (["generate", "-m", "{model}", "-p", "x", "--lora", "{tmp}/none.gguf"], "none.gguf: file not found"),
    (["generate", "-m", "{model}", "-p", "x", "--lora-scaled", "{model}"], "expected FILE:SCALE"),
    (["generate", "-m", "{model}", "-p", "x", "--lora", "{model}"], "not a LoRA adapter"),
    (["finetune", "--model-base", "{model}"], "missing option --train-data"),
    (["finetune", "--model-base", "{model}", "--train-data", "{empty}", "-c", "16"], "empty"),
    (["finetune", "--model-base", "{model}", "--train-data", "{text}"], "--ctx 128 is larger than the model's context length 64"),
    (["finetune", "--model-base", "{model}", "--train-data", "{text}", "--lora-r", "0"], "--lora-r 0: must be at least 1"),
    (["finetune", "--model-base", "{model}", "--train-data", "{text}", "--config", "{badtoml}"], "unknown option"),
])
def test_bad_input_is_one_line_without_traceback(tiny_model, tmp_path, args, match):
    """Exit code 1, but 2 for a command line the command cannot run (usage errors)."""
    (tmp_path / "text.txt").write_text(TEXT)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "x.bin").write_text("not a model")
    (tmp_path / "bad.toml").write_text("lora_rr = 3\n")
    sub = {"{tmp}": str(tmp_path), "{model}": str(tiny_model), "{text}": str(tmp_path / "text.txt"),
           "{empty}": str(tmp_path / "empty.txt"), "{notgguf}": str(tmp_path / "x.bin"),
           "{badtoml}": str(tmp_path / "bad.toml")}
    argv = []
    for a in args:
        for k, v in sub.items():
            a = a.replace(k, v)
        argv.append(a)
    p = run_process(*argv, cwd=tmp_path)     # default outputs here, not where another test's run locks them
    usage = ("give exactly one", "FILE:SCALE", "missing option", "must be at least", "unknown option")
    assert p.returncode == (2 if any(u in match for u in usage) else 1), (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and match in lines[0], p.stderr


def test_out_of_memory_is_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    """A MemoryError (numpy's, or CuPy's OutOfMemoryError, a subclass, on a GPU) is one
    line with what to try, exit 1."""
    from llamatune.commands import finetune

    def oom(*args, **kwargs):
        raise MemoryError("cannot allocate")
    monkeypatch.setattr(finetune, "finetune", oom)
    (tmp_path / "t.txt").write_text(TEXT)
    r = run("finetune", "--model-base", tiny_model, "--train-data", tmp_path / "t.txt", "-c", 16)
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.output.strip().splitlines()[-1] == ("error: out of memory (try --checkpointing layer, a smaller --batch "
                                                 "or a smaller --ctx)")
