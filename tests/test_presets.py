"""Presets by name (presets.py): shipped in the package, listed by `--config list` and the
--config help, loaded by name or path, and present in a built wheel."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from llamatune import presets
from llamatune.cli.main import app
from llamatune.errors import LlamatuneError
from llamatune.options import FinetuneOptions, ScratchOptions, build_options

from conftest import REPO

CONFIGS = REPO / "configs"
FINETUNE = ["finetune-chat", "finetune-chat-7b-q4", "finetune-chat-pack", "finetune-default", "finetune-dpo"]


def test_the_package_ships_every_preset_of_configs():
    shipped = presets.presets()
    assert sorted(shipped) == sorted(p.stem for p in CONFIGS.glob("*.toml"))
    for name, path in shipped.items():
        assert path.read_bytes() == (CONFIGS / f"{name}.toml").read_bytes(), name


def test_each_command_gets_its_presets_by_name():
    assert list(presets.presets(FinetuneOptions)) == FINETUNE
    assert list(presets.presets(ScratchOptions)) == ["scratch-small"]
    for cls, names in ((FinetuneOptions, FINETUNE), (ScratchOptions, ["scratch-small"])):
        for name in names:
            assert build_options(cls, {}, presets.resolve(name, cls)) == build_options(cls, {}, CONFIGS / f"{name}.toml"), name


def test_a_checkout_installed_before_the_configs_mapping_finds_configs(monkeypatch):
    monkeypatch.setattr(presets, "find_spec", lambda name: None)
    assert presets.preset_dir() == CONFIGS.resolve()


def test_every_preset_has_a_one_line_description():
    for name, path in presets.presets().items():
        text = presets.description(path)
        assert 20 <= len(text) <= 100 and text[0].isupper() and text.endswith("."), (name, text)


def test_config_list_prints_names_and_descriptions():
    r = CliRunner().invoke(app, ["finetune", "--config", "list"])
    assert r.exit_code == 0, r.output
    width = max(map(len, FINETUNE))
    lines = r.output.splitlines()
    assert max(map(len, lines)) <= 80
    names = [ln[:width].rstrip() for ln in lines if ln[:1] != " "]          # each description wrapped under itself
    assert names == FINETUNE
    joined = " ".join(" ".join(ln.split()) for ln in lines)
    for n in FINETUNE:
        assert f"{n} {presets.description(CONFIGS / f'{n}.toml')}" in joined
    r = CliRunner().invoke(app, ["train-from-scratch", "--config", "list"])
    assert r.output.split()[0] == "scratch-small" and not any(ln[:1].strip() for ln in r.output.splitlines()[1:])


def test_config_help_names_the_presets():
    commands = typer.main.get_command(app).commands
    for command, names in (("finetune", FINETUNE), ("train-from-scratch", ["scratch-small"])):
        help_text = next(p.help for p in commands[command].params if p.name == "config")
        assert f"({', '.join(names)}; `--config list` describes them)" in help_text


def test_a_path_still_works(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert build_options(FinetuneOptions, {}, presets.resolve("configs/finetune-chat.toml", FinetuneOptions)).lora_r == 16
    (tmp_path / "mine").write_text("lora_r = 7\n")            # an existing file, even without a suffix
    monkeypatch.chdir(tmp_path)
    assert build_options(FinetuneOptions, {}, presets.resolve("mine", FinetuneOptions)).lora_r == 7
    with pytest.raises(LlamatuneError, match=r"^nothere\.toml: preset file not found$"):
        build_options(FinetuneOptions, {}, presets.resolve("nothere.toml", FinetuneOptions))


def test_unknown_and_foreign_preset_names():
    with pytest.raises(LlamatuneError, match=r"^--config finetune-chatt: no such preset or file \(presets: "
                                             r"finetune-chat, finetune-chat-7b-q4, finetune-chat-pack, "
                                             r"finetune-default, finetune-dpo; or give a TOML file's path\)$"):
        presets.resolve("finetune-chatt", FinetuneOptions)
    with pytest.raises(LlamatuneError, match=r"scratch-small\.toml: unknown option\(s\) embd, head, head_kv"):
        build_options(FinetuneOptions, {}, presets.resolve("scratch-small", FinetuneOptions))
    r = CliRunner().invoke(app, ["finetune", "--config", "nope"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "error: --config nope: no such preset" in r.output


def build_wheel(dest: Path) -> Path:
    """A wheel built from a copy of the package's sources (the checkout stays clean)."""
    src = dest / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("llamatune", "kernels", "cli", "configs"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dest / "dist"), str(src)],
                   check=True, capture_output=True)
    return next((dest / "dist").glob("llamatune-*.whl"))


@pytest.mark.slow          # building the wheel takes 15-30 s
def test_presets_work_from_an_installed_wheel(tmp_path):
    wheel = build_wheel(tmp_path)
    assert {f"llamatune/configs/{p.name}" for p in CONFIGS.glob("*.toml")} <= set(zipfile.ZipFile(wheel).namelist())
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    code = (f"import sys; sys.path.insert(0, {str(site)!r}); import llamatune; "
            f"assert llamatune.__file__.startswith({str(site)!r}), llamatune.__file__; "
            "from llamatune.options import FinetuneOptions, build_options; "
            "assert build_options(FinetuneOptions, {}, 'finetune-chat-7b-q4').sample_start == '<s>'; "
            "from llamatune.cli.main import app; app(['finetune', '--config', 'list'])")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in r.stdout.splitlines()] == FINETUNE
