"""Every command's options come from one declaration (llamatune/options.py): each field
reaches the command line, every flag the commands had is still there, and defaults
agree across commands."""
from __future__ import annotations

import dataclasses
import re

import click
import pytest
import typer
from typer.testing import CliRunner

from llamatune import options as o
from llamatune.cli.main import app

COMMANDS = {"finetune": o.FinetuneOptions, "train-from-scratch": o.ScratchOptions, "tokenize": o.TokenizeOptions,
            "perplexity": o.PerplexityOptions, "generate": o.GenerateOptions, "chat": o.ChatOptions,
            "export-lora": o.ExportOptions, "convert-checkpoint": o.ConvertOptions, "plot": o.PlotOptions,
            "quickstart": o.QuickstartOptions, "preview-data": o.PreviewOptions}

# every flag each command had before its options were generated (none may go)
FLAGS = {
    "tokenize": "-m --model -p --prompt -f --file --ids --no-bos",
    "perplexity": "-m --model -f --file -c --ctx -b --batch --lora --lora-scaled --device --allow-nonfinite",
    "generate": "-m --model -p --prompt -n --n-predict --temp --top-k --top-p --seed -c --ctx --lora "
                "--lora-scaled --device --allow-nonfinite",
    "chat": "-m --model -p --prompt -s --system --chat-template -n --n-predict --temp --top-k --top-p --seed -c "
            "--ctx --lora --lora-scaled --device",
    "export-lora": "-m --model-base --lora --lora-scaled -o --output --outtype",
    "convert-checkpoint": "-o --output --to --model-base",
    "quickstart": "--workdir",
    "preview-data": "-m --model-base --model --train-data -c --ctx -n --json --data-format --chat-template "
                    "--train-on-prompt --drop-long --skip-bad-rows",
    "plot": "-o --output --smooth --log-y --title",
}


def command(name: str) -> click.Command:
    return typer.main.get_command(app).commands[name]


def flags_of(name: str) -> set[str]:
    return {f for p in command(name).params for f in (*p.opts, *p.secondary_opts) if f.startswith("-")}


def test_every_command_is_generated_from_its_dataclass():
    assert set(COMMANDS) == set(typer.main.get_command(app).commands)
    for name, cls in COMMANDS.items():
        params = {p.name for p in command(name).params}
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in params]
        assert not missing, f"{name}: fields without a flag: {missing}"


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_no_flag_was_lost(name):
    assert set(FLAGS[name].split()) <= flags_of(name)


def test_preview_data_reuses_finetune_declarations():
    by_name = {p.name.removeprefix("borrowed_"): p for p in command("preview-data").params}
    finetune = {p.name: p for p in command("finetune").params}
    for field in o.PREVIEW_FINETUNE_OPTIONS:
        assert by_name[field].help == finetune[field].help, field
    assert {"--model", "-m"} <= set(by_name["model_base"].opts)


def test_one_default_per_option_across_commands():
    """The same option name has the same default in every command that takes it, but
    for options that mean different things there: tokens to generate (generate) or per
    answer (chat); the training context, perplexity's window or the model's context;
    training samples or perplexity tokens per batch; the model's own template ("" in a
    preset, None on chat's command line); a new model's type or export's "same"; the
    compute dtype (auto, but f32 for perplexity: llama-perplexity's digits); the nucleus
    (llama.cpp's 0.95 for generate and chat, TRL's 1.0, no nucleus, for GRPO's sampling)."""
    seen: dict[str, dict[str, object]] = {}
    for name, cls in COMMANDS.items():
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            seen.setdefault(f.name, {})[name] = default
    differ = {k: v for k, v in seen.items() if len({repr(d) for d in v.values()}) > 1}
    assert set(differ) == {"n_predict", "ctx", "batch", "chat_template", "outtype", "compute_dtype", "top_p"}, differ
    assert {k for k, v in seen["compute_dtype"].items() if v != "auto"} == {"perplexity"}
    assert o.GenerateOptions().seed == o.ChatOptions().seed == o.FinetuneOptions().seed == o.SEED


def test_generated_command_builds_its_options():
    """Given values reach the dataclass; the rest are its defaults; switches and lists work."""
    from pathlib import Path

    from typer.testing import CliRunner

    from llamatune.cli.options_cli import add_options_command
    got = []
    app_ = typer.Typer()
    add_options_command(app_, "x", o.ExportOptions, got.append, "x", lambda f: f)
    add_options_command(app_, "y", o.TokenizeOptions, got.append, "y", lambda f: f)
    r = CliRunner().invoke(app_, ["x", "-m", "b.gguf", "-o", "out.gguf", "--lora", "a.gguf", "--lora", "c.gguf",
                                  "--lora-scaled", "d.gguf:0.5"])
    assert r.exit_code == 0, r.output
    assert got[-1] == o.ExportOptions(model_base=Path("b.gguf"), lora=[Path("a.gguf"), Path("c.gguf")],
                                      lora_scaled=["d.gguf:0.5"], output=Path("out.gguf"))
    assert got[-1].adapters() == [(Path("a.gguf"), 1.0), (Path("c.gguf"), 1.0), (Path("d.gguf"), 0.5)]
    r = CliRunner().invoke(app_, ["y", "-m", "v.gguf", "-p", "hi", "--no-bos"])
    assert r.exit_code == 0, r.output
    assert (got[-1].no_bos, got[-1].ids, got[-1].prompt) == (True, False, "hi")


@pytest.mark.parametrize("args, message", [
    (["tokenize", "-m", "v.gguf"], "give exactly one of -p/--prompt and -f/--file"),
    (["perplexity", "-m", "v.gguf", "-f", "t.txt", "--device", "tpu"], "--device 'tpu': choose cpu, cuda or auto"),
    (["generate", "-m", "v.gguf", "-p", "x", "--lora-scaled", "a.gguf"], "--lora-scaled 'a.gguf': expected FILE:SCALE"),
    (["generate", "-m", "v.gguf", "-p", "x", "--lora-scaled", "a.gguf:nan"], "scale nan: must be a finite number"),
    (["chat", "-m", "v.gguf", "--top-p", "0"], r"--top-p 0.0: must be in \(0, 1\]"),
    (["export-lora", "-m", "v.gguf", "-o", "o.gguf", "--lora-scaled", "a.gguf:x"], "expected FILE:SCALE"),
])
def test_options_are_checked_before_anything_loads(args, message):
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2
    assert r.output.count("\n") == 1
    assert re.search(message, r.output), r.output
