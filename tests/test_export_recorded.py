"""export-lora's default statistics (data/recorded.py): finetune records its training
data in the adapter; export-lora calibrates on it, rendered as training rendered it,
while it is there unchanged, else falls back to finetune's imatrix and ends with a
warning. And what survived the merge (models/survival.py): the summary and its warning."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from conftest import TEXT, write_tiny_model
from llamatune.commands.export import export_lora
from llamatune.commands.finetune import finetune
from llamatune.data.datasets import load_dataset
from llamatune.data.recorded import calibration_windows, recorded_data
from llamatune.data.samples import load_samples
from llamatune.formats.gguf_io import GGUFFile
from llamatune.models.model import Model
from llamatune.options import FinetuneOptions, MergeOptions
from test_export import KCFG, MATS, make_adapter, saved

CHAT = [{"messages": [{"role": "user", "content": f"{w}"}, {"role": "assistant", "content": f"{w} " * (1 + i % 3)}]}
        for i, w in enumerate(["king", "queen", "night", "sword", "crown", "field"] * 6)]
TEMPLATE, CTX = "chatml", 64


def train(tmp, base, data="train.txt", **over):
    o = FinetuneOptions(**{**dict(model_base=base, train_data=tmp / data, ctx=16, batch=2, lora_r=2, adam_iter=2,
                                  save_every=2, warmup=1, adam_alpha=1e-2, checkpointing="layer",
                                  checkpoint_out=tmp / "chk-ITERATION.gguf", lora_out=tmp / "adapter-ITERATION.gguf"),
                           **over})
    finetune(o, quiet=True)
    return tmp / "adapter-LATEST.gguf"


@pytest.fixture
def trained(tmp_path, tiny_vocab):
    base = write_tiny_model(tmp_path / "q8.gguf", tiny_vocab, outtype=QType.Q8_0)
    (tmp_path / "train.txt").write_text(TEXT)
    return base, train(tmp_path, base)


def test_finetune_records_its_training_data(trained, tmp_path):
    base, adapter = trained
    record = recorded_data(GGUFFile(adapter))
    data = (tmp_path / "train.txt").read_bytes()
    assert record.path == (tmp_path / "train.txt").resolve() and record.path.is_absolute()
    assert (record.size, record.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert record.render["method"] == "sft" and record.render["ctx"] == 16 and record.render["data_format"] == "auto"
    assert json.loads(GGUFFile(adapter).get("llamatune.data.render")) == record.render
    assert GGUFFile(adapter).get("general.type") == "adapter"       # llama.cpp's keys are unchanged


def test_matching_data_is_the_calibration(trained, tmp_path, capsys):
    base, adapter = trained
    report = export_lora(base, [(adapter, 1.0)], tmp_path / "m.gguf")
    assert report.statistics == "calibration" and report.warnings == []
    err = capsys.readouterr().err
    assert "calibration: the training data" in err and "train.txt" in err and "sha256 matches" in err
    # the same as giving the rendered windows' text: raw text windows start with BOS, then the text's tokens
    tok = Model(base).tokenizer
    windows = calibration_windows(recorded_data(GGUFFile(adapter)), tok, 64)
    tokens = load_samples(TEXT, tok, FinetuneOptions(ctx=16), "t").tokens
    assert windows.shape == (4, 16)
    assert np.all(windows[:, 0] == tok.bos_id)
    np.testing.assert_array_equal(windows[:, 1:], tokens[:64].reshape(4, 16)[:, 1:])


def test_conversations_render_with_the_training_template(tmp_path, tiny_vocab):
    base = write_tiny_model(tmp_path / "q8.gguf", tiny_vocab, outtype=QType.Q8_0)
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in CHAT) + "\n")
    adapter = train(tmp_path, base, "chat.jsonl", chat_template=TEMPLATE, ctx=CTX)
    record = recorded_data(GGUFFile(adapter))
    assert record.render["chat_template"] == TEMPLATE
    tok = Model(base).tokenizer
    windows = calibration_windows(record, tok, 10_000)
    samples = load_dataset(tmp_path / "chat.jsonl", tok, FinetuneOptions(ctx=CTX, chat_template=TEMPLATE))
    rows = [tuple(samples.tokens[b:b + s]) for b, s in zip(samples.begins, samples.sizes)]
    stream = windows.reshape(-1)                     # every rendered row, in some order, whole
    assert sum(len(r) for r in rows) // CTX * CTX == stream.size
    at, found = 0, 0
    while at < stream.size:
        row = next((r for r in rows if tuple(stream[at:at + len(r)]) == r), None)
        if row is None:
            assert stream.size - at < max(len(r) for r in rows)        # the cut at the last window
            break
        at, found = at + len(row), found + 1
    assert found >= len(rows) - 2
    report = export_lora(base, [(adapter, 1.0)], tmp_path / "m.gguf")
    assert report.statistics == "calibration"


@pytest.mark.parametrize("change", ["moved", "edited"])
def test_missing_or_edited_data_falls_back_with_a_warning(trained, tmp_path, change):
    base, adapter = trained
    data = tmp_path / "train.txt"
    if change == "moved":
        data.rename(tmp_path / "elsewhere.txt")
    else:
        data.write_text(TEXT + " one more line.")
    report = export_lora(base, [(adapter, 1.0)], tmp_path / "m.gguf")
    assert report.statistics == "imatrix" and report.imatrix == tmp_path / "adapter-LATEST.imatrix.gguf"
    warning = report.warnings[-1]
    assert ("is gone (moved or deleted)" if change == "moved" else "was edited since training") in warning
    assert f"--calibration-data with the training data (it was {data.resolve()})" in warning
    assert "48 % of the KL shift" in warning            # the likely loss


def test_cli_ends_with_the_warning(trained, tmp_path):
    from typer.testing import CliRunner

    from cli.main import app
    base, adapter = trained
    (tmp_path / "train.txt").unlink()
    r = CliRunner().invoke(app, ["export-lora", "-m", str(base), "--lora", str(adapter), "-o", str(tmp_path / "m.gguf")])
    assert r.exit_code == 0, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert "statistics: the imatrix finetune wrote beside adapter-LATEST.gguf" in r.output
    assert lines[-1].startswith("llamatune: warning: the training data") and "is gone" in lines[-1]
    assert any(line.startswith("changed ") for line in lines)


def test_plain_and_explicit_imatrix_ignore_the_record(trained, tmp_path):
    """The record changes nothing for --merge-method plain and an explicit --imatrix: the
    same bytes as an adapter that records nothing (the same tensors)."""
    base, adapter = trained
    from llamatune.formats.adapter import read_adapter, write_adapter
    bare = tmp_path / "bare.gguf"
    write_adapter(bare, read_adapter(adapter, GGUFFile(base)))
    assert recorded_data(GGUFFile(bare)) is None
    imatrix = MergeOptions(imatrix=tmp_path / "adapter-LATEST.imatrix.gguf")
    for name, merge in (("plain", MergeOptions(merge_method="plain")), ("imatrix", imatrix)):
        one = export_lora(base, [(adapter, 1.0)], tmp_path / f"{name}-1.gguf", merge=merge)
        two = export_lora(base, [(bare, 1.0)], tmp_path / f"{name}-2.gguf", merge=merge)
        assert (tmp_path / f"{name}-1.gguf").read_bytes() == (tmp_path / f"{name}-2.gguf").read_bytes()
        assert one.statistics == ("imatrix" if name == "imatrix" else "none") and not one.warnings


def test_an_adapter_too_small_for_q4_k_is_reported(tmp_path, tiny_vocab):
    """#50: the merge printed 'merged N tensors' while every tensor came out as the base's."""
    base = write_tiny_model(tmp_path / "q4k.gguf", tiny_vocab, outtype=QType.Q4_K, **KCFG)
    tiny = make_adapter(base, MATS)
    tiny.pairs = {n: (a, b * 1e-5) for n, (a, b) in tiny.pairs.items()}
    report = export_lora(base, [(saved(tmp_path, tiny), 1.0)], tmp_path / "m.gguf")
    assert report.survival.startswith(f"changed 0 of {len(MATS)} merged tensors")
    assert len(report.warnings) == 1 and "the merge changed nothing" in report.warnings[0]
    assert "--lora" in report.warnings[0] and "--outtype" in report.warnings[0]
    m, b = GGUFFile(tmp_path / "m.gguf"), GGUFFile(base)
    assert all(np.array_equal(m.tensor(n).raw_rows(), b.tensor(n).raw_rows()) for n in MATS)


def test_an_adapter_that_survives_is_reported_without_warning(tmp_path, tiny_vocab):
    base = write_tiny_model(tmp_path / "q8.gguf", tiny_vocab, outtype=QType.Q8_0, **KCFG)
    report = export_lora(base, [(saved(tmp_path, make_adapter(base, MATS)), 1.0)], tmp_path / "m.gguf")
    assert report.survival.startswith(f"changed {len(MATS)} of {len(MATS)} merged tensors")
    kept = float(report.survival.split("kept about ")[1].split("%")[0])
    carried = float(report.survival.split("it carries ")[1].split("%")[0])
    assert kept > 95 and carried > 80 and not report.warnings
