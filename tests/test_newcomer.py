"""The command line as a newcomer meets it: each test names the defect it covers
(numbered as in the issue that listed them: 1 examples and `-m`, 2 --version, 3 silent
replacement and scattered outputs, 4 warmup longer than the run, 6 non-models passed as
models, 7 the saved line's loss, 8 quickstart's chat command and chat streaming,
9 help text, 10 two error styles, 11 --dry-run sizes, 12 progress in logs)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from llamatune import options as o
from llamatune.cli.main import app

from conftest import TEXT

COMMANDS = ["finetune", "train-from-scratch", "tokenize", "perplexity", "generate", "export-lora",
            "convert-checkpoint", "quickstart", "preview-data", "chat", "plot"]


def run(*args, **kw):
    return CliRunner().invoke(app, [str(a) for a in args], **kw)


def command(name: str):
    return typer.main.get_command(app).commands[name]


def parsed(name: str, *args) -> dict:
    """The values a command line gives the command's parameters (parsing only)."""
    cmd = command(name)
    return cmd.make_context(name, [str(a) for a in args]).params


def train_args(d: Path, model: Path, *extra) -> list:
    return ["finetune", "-m", model, "--train-data", d / "t.txt", "-c", 16, "-b", 2, "--lora-r", 2,
            "--no-plot", *extra]


@pytest.fixture
def data(tmp_path, monkeypatch):
    """A folder with training text, the current one (relative outputs go there)."""
    (tmp_path / "t.txt").write_text(TEXT)
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---------------------------------------------------------------- 1, names users know

def test_finetune_takes_m_and_the_usual_aliases():
    """Defect 1: `finetune -m` was `No such option: -m`; TRL / mlx-lm spellings are one
    declaration each with llama.cpp's, shown together in the help."""
    p = parsed("finetune", "-m", "x.gguf", "--lr", "2e-4", "--max-steps", "7", "--batch-size", "3",
               "--lora-alpha", "16")
    assert (p["model_base"], p["adam_alpha"], p["adam_iter"], p["batch"], p["lora_alpha"]) == \
        (Path("x.gguf"), 2e-4, 7, 3, 16.0)
    p = parsed("train-from-scratch", "--learning-rate", "1e-2", "--iters", "5")
    assert (p["adam_alpha"], p["adam_iter"]) == (1e-2, 5)
    help_text = run("finetune", "--help").output
    for together in ("--adam-alpha, --learning-rate, --lr", "--adam-iter, --max-steps, --iters",
                     "-b, --batch, --batch-size", "-m, --model-base"):
        assert together in help_text


# ---------------------------------------------------------------- 2, version

def test_version_and_python_m():
    """Defect 2: no --version, and `python -m llamatune` was `No module named llamatune.__main__`."""
    from llamatune import __version__
    for flag in ("--version", "-V"):
        r = run(flag)
        assert r.exit_code == 0 and r.output == f"llamatune {__version__}\n"
    p = subprocess.run([sys.executable, "-m", "llamatune", "-V"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == f"llamatune {__version__}\n", p.stderr


# ---------------------------------------------------------------- 3, outputs

def test_a_new_run_does_not_silently_replace_the_last_one(data, tiny_model):
    """Defect 3: a run without --checkpoint-in replaced chk-LATEST and adapter-LATEST and cut
    metrics.jsonl, without a word. Now it refuses, naming them and the --checkpoint-in that
    resumes; --overwrite starts over; resuming goes on as before."""
    assert run(*train_args(data, tiny_model, "--adam-iter", 2)).exit_code == 0
    before = {p.name: p.read_bytes() for p in data.iterdir() if p.is_file()}
    r = run(*train_args(data, tiny_model, "--adam-iter", 2))
    assert r.exit_code == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "chk-LATEST.gguf" in lines[0] and "adapter-LATEST.gguf" in lines[0]
    assert "--checkpoint-in chk-LATEST.gguf" in lines[0] and "--overwrite" in lines[0]
    assert {p.name: p.read_bytes() for p in data.iterdir() if p.is_file()} == before
    r = run(*train_args(data, tiny_model, "--adam-iter", 3, "--checkpoint-in", data / "chk-LATEST.gguf"))
    assert r.exit_code == 0, r.output
    assert len((data / "metrics.jsonl").read_text().splitlines()) == 3        # steps 1-2 kept, 3 added
    r = run(*train_args(data, tiny_model, "--adam-iter", 1, "--overwrite"))
    assert r.exit_code == 0, r.output
    assert len((data / "metrics.jsonl").read_text().splitlines()) == 1


def test_the_lock_is_named_before_the_earlier_run(data, tiny_model):
    """Defect 3: a run whose outputs another run holds is told so (the lock), not that it
    would replace the other's files."""
    from llamatune.locks import hold
    from llamatune.outputs import training_paths
    assert run(*train_args(data, tiny_model, "--adam-iter", 1)).exit_code == 0
    opts = o.FinetuneOptions(model_base=tiny_model, train_data=data / "t.txt", plot=False,
                             checkpoint_out=data / "chk-ITERATION.gguf", lora_out=data / "adapter-ITERATION.gguf")
    with hold(training_paths(opts)[1], "finetune"):
        r = CliRunner().invoke(app, [str(a) for a in train_args(data, tiny_model, "--adam-iter", 1)])
    assert r.exit_code == 1 and "another run writes these outputs" in r.stderr, r.stderr


def test_output_dir_and_missing_folders(data, tiny_model, monkeypatch):
    """Defect 3: `--lora-out /nonexistent/dir/a.gguf` created that folder while checkpoints
    and metrics went to the current one. Now a missing folder is an error but for
    --output-dir, which holds the run's files (created if missing)."""
    monkeypatch.chdir(data)
    r = run(*train_args(data, tiny_model, "--adam-iter", 1, "--lora-out", data / "nope/dir/a.gguf"))
    assert r.exit_code == 1 and "folder" in r.stderr and "nope/dir does not exist" in r.stderr, r.stderr
    assert not (data / "nope").exists()
    r = run(*train_args(data, tiny_model, "--adam-iter", 2, "--save-every", 1, "--output-dir", "runs/first"))
    assert r.exit_code == 0, r.output
    got = sorted(p.name for p in (data / "runs/first").iterdir() if not p.name.startswith("."))
    assert got == ["adapter-1.gguf", "adapter-1.imatrix.gguf", "adapter-2.gguf", "adapter-2.imatrix.gguf",
                   "adapter-LATEST.gguf", "adapter-LATEST.imatrix.gguf", "chk-1.gguf", "chk-2.gguf",
                   "chk-LATEST.gguf", "metrics.jsonl"]
    assert not list(data.glob("*.gguf")) and not (data / "metrics.jsonl").exists()


def test_save_total_limit_keeps_the_newest(data, tiny_model):
    """Defect 3: checkpoints piled up (8 checkpoints and 8 adapters in 20 s).
    --save-total-limit N keeps the newest N numbered saves; LATEST and BEST always stay."""
    r = run(*train_args(data, tiny_model, "--adam-iter", 5, "--save-every", 1, "--save-total-limit", 2,
                        "--val-split", "0.2", "--sample-start", "\\n\\n", "--escape", "--save-best", "--eval-every", 1))
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in data.glob("*.gguf"))
    assert [n for n in names if n.startswith("chk-")] == ["chk-4.gguf", "chk-5.gguf", "chk-BEST.gguf",
                                                          "chk-LATEST.gguf"]
    assert [n for n in names if re.fullmatch(r"adapter-\d+\.gguf", n)] == ["adapter-4.gguf", "adapter-5.gguf"]
    assert [n for n in names if re.fullmatch(r"adapter-\d+\.imatrix\.gguf", n)] == \
        ["adapter-4.imatrix.gguf", "adapter-5.imatrix.gguf"]
    assert {"adapter-LATEST.gguf", "adapter-BEST.gguf"} <= set(names)


# ---------------------------------------------------------------- 4, warmup

def test_warmup_and_decay_fit_a_short_run():
    """Defect 4: with the default --warmup 100 a 4-step run ended at 4e-5, still warming
    up. Defaults longer than the run are scaled to it (and the run says so); values
    given are kept."""
    from llamatune.train.optimizer import learning_rate
    short = o.FinetuneOptions(adam_iter=4)
    warmup, decay, note = o.schedule_steps(short)
    assert warmup + decay == 4 and "scaled to the run's 4 steps" in note
    assert learning_rate(0, short) == pytest.approx(1e-3)
    assert learning_rate(3, short) > 1e-4
    given = o.FinetuneOptions(adam_iter=4, warmup=100, cos_decay_steps=1000)
    assert o.schedule_steps(given) == (100, 1000, "") and learning_rate(3, given) == pytest.approx(4e-5)
    assert o.schedule_steps(o.FinetuneOptions(adam_iter=2000))[:2] == (100, 1000)       # long runs: as before
    w, d, _ = o.schedule_steps(o.FinetuneOptions(adam_iter=50, warmup=10))               # only decay given way
    assert (w, d) == (10, 40)


# ---------------------------------------------------------------- 6, file kinds

def test_files_that_are_not_models_say_what_they_are(data, tiny_model, qwen_vocab):
    """Defect 6: an adapter passed as the model gave `--lora-out adapter-ITERATION.gguf would
    overwrite the input --model-base adapter-LATEST.gguf`, a checkpoint `missing required
    metadata key`, a vocab-only GGUF `missing tensor`: none said what the file is."""
    from llamatune.formats.gguf_io import kv, tensor_out, write_gguf
    import numpy as np
    assert run(*train_args(data, tiny_model, "--adam-iter", 1)).exit_code == 0
    write_gguf(data / "2023.gguf", "llama", [kv("training.type", "finetune_lora")],
               [tensor_out("x", np.zeros((1, 32), np.float32))])
    cases = {"adapter-LATEST.gguf": "is a LoRA adapter, not a model: pass it with --lora",
             "chk-LATEST.gguf": "is a llamatune training checkpoint, not a model: resume its run with --checkpoint-in",
             "adapter-LATEST.imatrix.gguf": "is an importance matrix (imatrix), not a model: it goes to export-lora "
                                            "--imatrix",
             "2023.gguf": "is a llama.cpp 2023 finetune checkpoint, not a model: convert it with convert-checkpoint",
             str(qwen_vocab): "is a vocabulary-only GGUF (no weights), not a model: it goes to tokenize -m"}
    for name, says in cases.items():
        path = data / name
        for args in (["finetune", "-m", path, "--train-data", data / "t.txt", "--no-plot"],
                     ["perplexity", "-m", path, "-f", data / "t.txt"]):
            r = run(*args)
            lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
            assert r.exit_code == 1 and len(lines) == 1 and says in lines[0], (args, r.stderr)


# ---------------------------------------------------------------- 7, saved line; 12, progress in logs

def test_saved_line_shows_the_logged_loss_and_progress_lines_come_as_it_runs(data, tiny_model):
    """Defect 7: `saved iteration 40: loss 3.7876` printed step 41's loss (metrics.jsonl had
    5.0913 at step 40). Defect 12: with stderr not a terminal, progress showed only at
    the end; now a line comes every --progress-every seconds (0: every step)."""
    r = run(*train_args(data, tiny_model, "--adam-iter", 4, "--save-every", 2, "--progress-every", 0))
    assert r.exit_code == 0, r.output
    logged = {row["step"]: row["loss"] for row in map(json.loads, (data / "metrics.jsonl").read_text().splitlines())}
    saved = re.findall(r"saved iteration (\d+): loss ([\d.]+)", r.stderr)
    assert [int(s) for s, _ in saved] == [2, 4]
    for step, loss in saved:
        assert loss == f"{logged[int(step)]:.4f}"
    lines = r.stderr.splitlines()
    progress = [i for i, ln in enumerate(lines) if re.match(r"train \d/4 ", ln)]
    assert [lines[i].split()[1] for i in progress] == ["1/4", "2/4", "3/4", "4/4"]
    assert progress[0] < next(i for i, ln in enumerate(lines) if ln.startswith("saved iteration 2"))


def test_progress_lines_are_timed_in_logs(monkeypatch, capsys):
    """Defect 12: one line per --progress-every seconds, and always the last step."""
    from types import SimpleNamespace
    from llamatune import progress
    clock = iter([0.0, 1.0, 5.0, 31.0, 32.0, 33.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    state = SimpleNamespace(epoch=0, guard={}, loss_ema=1.0, validation=None, iteration=0)
    with progress.train_progress(4, 0, every=30) as show:
        for step in range(1, 5):
            state.iteration = step
            show(state, 1.0, 1e-3, 0.5, 100.0)
    shown = [ln.split()[1] for ln in capsys.readouterr().err.splitlines()]
    assert shown == ["1/4", "3/4", "4/4"]          # at 1 s, at 31 s (30 after), and the last


# ---------------------------------------------------------------- 8, chat

class _ByteTok:
    """Token ids are bytes values; decode as the tokenizer does (UTF-8, errors replaced)."""
    def token_to_bytes(self, i):
        return bytes([i])

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_chat_stream_never_writes_half_a_character():
    """Defect 8: `chat` printed U+FFFD in the middle of multi-byte characters: the bytes of
    a character split across tokens are held back until whole, and dropped when the
    stream ends inside one or another byte breaks it off."""
    from llamatune.commands.chat import stream_ids
    text = "né 你好 🎉"
    got = []
    assert stream_ids(_ByteTok(), iter(text.encode()), got.append) == text
    assert "".join(got) == text and not any("\ufffd" in g for g in got)
    got = []
    broken = b"ok \xe4\xbd x \xf0\x9f\x8e\x89"   # a sequence broken off by an ASCII byte never completes
    assert stream_ids(_ByteTok(), iter(broken), got.append) == "ok  x 🎉"
    assert not any("\ufffd" in g for g in got)
    got = []
    cut = "ok 🎉".encode()[:-2]                  # the stream stops inside the emoji
    assert stream_ids(_ByteTok(), iter(cut), got.append) == "ok "
    assert "".join(got) == "ok "


def test_chat_banner_and_commands(tiny_model, monkeypatch):
    """Defect 8: interactive chat had no banner saying how to quit, and `/help` was sent to
    the model. /help, /reset and /exit are the chat's own; nothing reaches the model."""
    from llamatune.commands import chat
    asked = []
    monkeypatch.setattr(chat.Chat, "say", lambda self, text, write=None: asked.append(text) or "")
    monkeypatch.setattr(chat.Chat, "reset", lambda self: asked.append("(reset)"))
    r = run("chat", "-m", tiny_model, "--chat-template", "chatml", input="/help\nhello\n/reset\n/nope\n/exit\nlost\n")
    assert r.exit_code == 0, r.output
    assert "/help lists the commands, /exit or Ctrl-D quits" in r.stderr
    assert "/reset" in r.stderr and "unknown command /nope" in r.stderr
    assert asked == ["hello", "(reset)"]


# ---------------------------------------------------------------- 9, help

@pytest.mark.parametrize("name", ["export-lora", "perplexity", "generate", "finetune", "tokenize", "chat"])
def test_required_options_are_marked_and_first(name):
    """Defect 9: required options were not marked, and export-lora's, perplexity's and
    generate's -m/-o/-f/-p came last, after the advanced groups."""
    text = run(name, "--help").output
    rows = re.split(r"\n(?=  -)", text.split("\n\n", 2)[2])[1:]       # one per option, its help text wrapped
    marked = {"export-lora": ["-m, --model-base", "-o, --output"], "perplexity": ["-m, --model", "-f, --file"],
              "generate": ["-m, --model", "-p, --prompt"], "finetune": ["--train-data", "-m, --model-base"],
              "tokenize": ["-m, --model"], "chat": ["-m, --model"]}[name]
    assert [row.split(" <")[0].strip() for row in rows[:len(marked)]] == marked, rows[:4]
    assert all("[required]" in " ".join(row.split()) for row in rows[:len(marked)])
    assert not any("[required]" in row for row in rows[len(marked):])


def test_help_speaks_to_users():
    """Defect 9: Python types in the help (`<list[Path]>`), quickstart's help (and the
    top one) in another style, `--config list` 115 columns wide, --train-data said
    "Training text (UTF-8)" though JSONL works, a preset described as on raw text."""
    for name in COMMANDS + [None]:
        text = run(*([name] if name else []), "--help").output
        assert not re.search(r"<[^>]*\[", text) and "Path]" not in text, (name, text)
        assert "╭" not in text and "│" not in text, name
    for name in ("finetune", "train-from-scratch"):
        listing = run(name, "--config", "list").output
        assert max(map(len, listing.splitlines())) <= 80, listing
    assert "JSONL" in command("finetune").params[[p.name for p in command("finetune").params].index("train_data")].help
    from llamatune import presets
    assert "raw text" not in presets.description(presets.presets()["finetune-chat-7b-q4"])


# ---------------------------------------------------------------- 10, one error style

def test_usage_errors_share_one_style_and_exit_code():
    """Defect 10: typer's own checks printed a box and exited 2, ours `error: ...` and 1."""
    for args, says in ((["finetune", "--no-such-flag"], "error: No such option: --no-such-flag"),
                       (["perplexity", "-f", "x.txt"], "error: Missing option '--model' / '-m'"),
                       (["no-such-command"], "error: No such command 'no-such-command'"),
                       (["finetune", "-m", "x.gguf", "--train-data", "t.txt", "--lora-r", "0"],
                        "error: --lora-r 0: must be at least 1"),
                       (["finetune", "-m", "x.gguf"], "error: missing option --train-data")):
        r = run(*args)
        assert r.exit_code == 2, (args, r.output)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith(says), (args, r.stderr)


# ---------------------------------------------------------------- 11, dry-run sizes

def test_dry_run_sizes_match_the_files_a_run_writes(data, tiny_model):
    """Defect 11: --dry-run said a checkpoint is 1.9 MiB and an adapter 0.5 MiB (the files:
    0.94 and 0.30), and left out the imatrix files."""
    r = run(*train_args(data, tiny_model, "--adam-iter", 1, "--dry-run"))
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.stdout.splitlines() if "each save writes" in ln)
    said = {m.group(1): float(m.group(2)) * (2**20 if m.group(3) == "MiB" else 2**10)
            for m in re.finditer(r"([\w.-]+\.gguf) ([\d.,]+) (MiB|KiB)", line)}
    assert set(said) == {"chk-ITERATION.gguf", "chk-LATEST.gguf", "adapter-ITERATION.gguf", "adapter-LATEST.gguf",
                         "adapter-ITERATION.imatrix.gguf", "adapter-LATEST.imatrix.gguf"}
    assert run(*train_args(data, tiny_model, "--adam-iter", 1)).exit_code == 0
    for name, size in said.items():
        real = (data / name.replace("ITERATION", "1")).stat().st_size
        assert abs(size - real) <= 0.05 * real + 512, (name, size, real)
