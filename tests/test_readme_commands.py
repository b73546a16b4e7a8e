"""Every `llamatune` command line of README.md and of the presets' header comments
(configs/*.toml) runs as written, so that an example with a wrong flag fails here
(issue: `finetune --config finetune-chat -m model.gguf ...` once failed with
`No such option: -m`).

The command lines are extracted, not copied: code blocks' lines and inline code
spans that start with `llamatune `, continuation lines (`\\`) joined, trailing
`# comments` dropped. The files they name are placeholders, replaced before running,
by name:
  - a model (`-m`, `--model-base`, `--model`, MODEL.gguf, M): a tiny llama this test
    writes, with a 1024-token context (the presets' windows fit) and a ChatML template;
  - `adapter-LATEST.gguf` / `adapter.gguf`, `chk-LATEST.gguf`, `metrics.jsonl` (in any
    folder): the files of a 2-step finetune of that model, run first;
  - a file of the checkout (`llamatune/assets/chat-sample.jsonl`): itself;
  - `*.jsonl` training data: conversations (chats.jsonl) or preference pairs
    (pairs.jsonl: configs/pairs-example.jsonl);
  - text (`*.txt`, TEXT, T): the quickstart's Shakespeare sample; `chats.txt`: samples
    marked with `<s>`;
  - `...` (the options a line leaves out): `-m MODEL --train-data TEXT`.
Outputs go to a temporary folder. Training commands run with `--dry-run` (the model,
data and options load and are checked; nothing trains); an interactive `chat` gets
`/exit` on its input; `quickstart` runs whole (marked slow).
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llamatune.cli.main import app

from conftest import TEXT, tiny_config

REPO = Path(__file__).resolve().parents[1]
TRAINING = ("finetune", "train-from-scratch")


def readme_commands(text: str) -> list[str]:
    """`llamatune ...` command lines of a Markdown text: code-block lines (continuations
    joined, comments dropped) and inline code spans."""
    found = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                part = part.split(" #")[0].strip()
                if part.startswith("llamatune "):
                    found.append(" ".join(part.split()))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [" ".join(span.split()) for span in re.findall(r"`(llamatune [^`]+)`", prose)]
    return found


def preset_commands() -> list[str]:
    """The command lines in the presets' header comments."""
    found = []
    for path in sorted((REPO / "configs").glob("*.toml")):
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            m = re.search(r"(llamatune [^`;]+)", line)
            if m:
                found.append(" ".join(m.group(1).split()))
    return found


COMMANDS = sorted(set(readme_commands((REPO / "README.md").read_text()) + preset_commands()))


def test_the_examples_are_found():
    """The extraction finds the README's and the presets' examples (a change of format
    that hid them would make the tests below pass vacuously)."""
    assert len(COMMANDS) >= 15, COMMANDS
    for expected in ("llamatune quickstart", "llamatune finetune --config finetune-chat -m model.gguf "
                     "--train-data chats.jsonl", "llamatune train-from-scratch --config scratch-small "
                     "--train-data text.txt"):
        assert expected in COMMANDS


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_vocab):
    """The placeholder files: a tiny chat model, data, and a 2-step finetune's outputs."""
    from llamatune.commands.finetune import finetune
    from llamatune.formats.gguf_io import kv
    from llamatune.models.chat_template import BUILTIN
    from llamatune.models.writer import random_weights, write_model
    from llamatune.options import FinetuneOptions
    from llamatune.quickstart import sample_text
    d = tmp_path_factory.mktemp("readme")
    cfg = tiny_config(n_ctx_train=1024)
    write_model(d / "model.gguf", cfg, random_weights(cfg, seed=0, std=0.08), tiny_vocab,
                extra=[kv("tokenizer.chat_template", BUILTIN["chatml"])])
    (d / "text.txt").write_text(sample_text()[:20000] + TEXT)
    (d / "chats.txt").write_text("".join(f"<s>User: question {i}?\nBot: answer {i}.\n" for i in range(40)))
    rows = [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": f"{w}!"}]}
            for w in ("yes", "no", "maybe", "never", "always", "soon", "later", "now")]
    (d / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "pairs.jsonl").write_text((REPO / "configs" / "pairs-example.jsonl").read_text())
    finetune(FinetuneOptions(model_base=d / "model.gguf", train_data=d / "text.txt", adam_iter=2,
                             save_every=0, plot=False, checkpoint_out=d / "chk-ITERATION.gguf",
                             lora_out=d / "adapter-ITERATION.gguf", metrics_out=d / "metrics.jsonl"), quiet=True)
    return d


def substitute(command: str, d: Path) -> list[str]:
    """The command's arguments with the placeholders replaced (module docstring)."""
    command = command.replace("...", f"-m {d / 'model.gguf'} --train-data {d / 'text.txt'}")
    command = command.replace("COMMAND", "finetune")
    words = shlex.split(command)[1:]
    model_flags = ("-m", "--model-base", "--model")
    files = {"adapter-LATEST.gguf": "adapter-LATEST.gguf", "adapter.gguf": "adapter-LATEST.gguf",
             "chk-LATEST.gguf": "chk-LATEST.gguf", "metrics.jsonl": "metrics.jsonl", "chats.jsonl": "chats.jsonl",
             "pairs.jsonl": "pairs.jsonl", "chats.txt": "chats.txt"}
    out = []
    for i, w in enumerate(words):
        before = words[i - 1] if i else ""
        if before in model_flags or w in ("MODEL.gguf", "M"):
            w = str(d / "model.gguf")
        elif (REPO / w).is_file():                  # a file of the checkout (the built-in samples)
            w = str(REPO / w)
        elif Path(w).name in files:                 # a run's file, in any folder
            w = str(d / files[Path(w).name])
        elif w.endswith(".txt") or w in ("TEXT", "T"):
            w = str(d / "text.txt")
        out.append(w)
    if out[0] in TRAINING and "list" not in out:
        out.append("--dry-run")
    return out


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "llamatune quickstart"])
def test_example_runs(command, work, monkeypatch):
    """The example runs to exit code 0 (training commands as a --dry-run)."""
    monkeypatch.chdir(work)
    args = substitute(command, work)
    r = CliRunner().invoke(app, args, input="/exit\n")
    assert r.exit_code == 0, f"{command}\n-> {' '.join(args)}\n{r.output}"


@pytest.mark.slow
def test_quickstart_runs(tmp_path, monkeypatch):
    """`llamatune quickstart`, the README's first command, runs whole."""
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["quickstart"])
    assert r.exit_code == 0, r.output
    assert "llamatune chat -m llamatune-quickstart/" in r.output
