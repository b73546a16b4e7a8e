"""`llamatune chat` and `preview-data`: library and command line."""
from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from llamatune.cli.main import app
from llamatune.commands.chat import Chat, Sampling
from llamatune.data.datasets import load_dataset, preview
from llamatune.models.chat_template import load_template
from llamatune.models.infer import Runner
from llamatune.models.model import Model
from llamatune.models.sampling import generate_ids
from llamatune.options import FinetuneOptions

runner = CliRunner()
CONV = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."},
                     {"role": "user", "content": "Bye?"}, {"role": "assistant", "content": "Bye."}]}


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_chat_turn_is_greedy_generation_after_the_generation_prompt(tiny_model):
    model = Model(tiny_model)
    template = load_template(model.tokenizer, "chatml")
    chat = Chat(Runner(model), template, system="Be kind.", sampling=Sampling(n_predict=6, temp=0, ctx=256))
    got = []
    answer = chat.say("hello there", got.append)
    prompt = template.prompt_tokens([{"role": "system", "content": "Be kind."},
                                     {"role": "user", "content": "hello there"}])
    ids = list(generate_ids(Runner(model), prompt, 6, temp=0, n_ctx=256, stop=model.tokenizer.eog_ids))
    text = model.tokenizer.decode(ids).replace("\ufffd", "")   # bytes that are no character are not written
    assert answer == text == "".join(got) and len(ids) > 0
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant"]
    assert chat.messages[-1]["content"] == answer
    r = run("chat", "-m", tiny_model, "--chat-template", "chatml", "-s", "Be kind.", "-p", "hello there",
            "-n", 6, "--temp", 0, "-c", 256, "--compute-dtype", "f32")
    assert r.exit_code == 0 and r.stdout == answer + "\n"
    assert r.stderr == "compute: f32 products as asked\n"


def test_chat_without_template_is_an_error(tiny_model):
    r = run("chat", "-m", tiny_model, "-p", "hi")
    assert r.exit_code == 1
    assert r.output.startswith(f"error: {tiny_model.name}: the model has no chat template: pass --chat-template")


def test_preview_data_json(qwen_vocab, qwen_tokenizer, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(CONV) + "\n" + json.dumps({"text": "one two"}) + "\n")
    r = run("preview-data", "--model-base", qwen_vocab, "--train-data", data, "-n", 5, "--json", "--ctx", 64)
    assert r.exit_code == 0
    lines = [json.loads(x) for x in r.output.splitlines()]
    want = preview(load_dataset(data, qwen_tokenizer, FinetuneOptions(ctx=64)), qwen_tokenizer.bos_id, 5)
    assert len(lines) == 2
    for got, (tokens, targets) in zip(lines, want):
        assert got == {"tokens": tokens.tolist(), "targets": targets.tolist()}
    assert np.sum(lines[0]["targets"]) == len(qwen_tokenizer.encode("Hello.")) + len(qwen_tokenizer.encode("Bye.")) + 2
    r = run("preview-data", "--model-base", qwen_vocab, "--train-data", data, "-n", 1)
    assert r.exit_code == 0 and "sample 1:" in r.output and "Hello." in r.output


def test_preview_data_bad_row_is_one_line(qwen_vocab, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(CONV) + "\n{broken\n")
    r = run("preview-data", "--model-base", qwen_vocab, "--train-data", data)
    assert r.exit_code == 1 and r.output.startswith(f"error: {data}:2: not valid JSON")
    assert "Traceback" not in r.output


@pytest.mark.slow
def test_quickstart_chat_leg(tiny_model, tmp_path, capsys):
    """And the chat command it prints runs from where the quickstart ran (defect 8 of the
    newcomer issue: it named the files without their folder)."""
    from pathlib import Path
    from llamatune.quickstart import chat_leg
    chat_leg(tmp_path, tiny_model, ctx=64, chat_ctx=256)
    assert (tmp_path / "chat-adapter-LATEST.gguf").exists()
    printed = capsys.readouterr().out
    assert "6. chat finetune" in printed
    words = next(ln for ln in printed.splitlines() if "llamatune chat -m" in ln).split()
    assert Path(words[words.index("-m") + 1]).is_file() and Path(words[words.index("--lora") + 1]).is_file()


class _PieceTok:                     # ids are text pieces
    def decode(self, ids):
        return "".join(ids)


def test_stream_stops_at_the_stop_text_and_holds_back_its_start():
    from llamatune.commands.chat import stream_ids
    got = []
    pieces = iter(["Hel", "lo <|im", "_e", "nd|>", "\n<|im_start|>user"])
    assert stream_ids(_PieceTok(), pieces, got.append, "<|im_end|>") == "Hello "
    assert got == ["Hel", "lo "]                      # "<|im" was held back, then dropped
    assert next(pieces) == "\n<|im_start|>user"        # the stream was left at the stop text
    got = []
    assert stream_ids(_PieceTok(), iter(["a <", "b", "<|i", "x"]), got.append, "<|im_end|>") == "a <b<|ix"
    assert "".join(got) == "a <b<|ix" and got == ["a ", "<b", "<|ix"]   # held, then released
    got = []
    assert stream_ids(_PieceTok(), iter(["x <|im_"]), got.append, "<|im_end|>") == "x <|im_"
    assert "".join(got) == "x <|im_"                   # what is held is written at the end


def test_chat_answer_ends_at_the_templates_end_of_turn_text(tiny_model, monkeypatch):
    """A vocabulary without <|im_end|> as a control token: the model writes it as ordinary
    tokens, and the answer (shown and kept) ends before it."""
    import llamatune.commands.chat as chat_mod
    model = Model(tiny_model)
    tok = model.tokenizer
    template = load_template(tok, "chatml")
    assert not tok.has_special_text("<|im_end|>")
    reply = tok.encode("Fine thanks<|im_end|>\n<|im_start|>user\nmore", add_special=False)
    monkeypatch.setattr(chat_mod, "generate_ids", lambda *a, **k: iter(reply))
    chat = Chat(Runner(model), template, sampling=Sampling(n_predict=len(reply), temp=0, ctx=256))
    shown = []
    answer = chat.say("how are you", shown.append)
    assert answer == "".join(shown) == tok.decode(tok.encode("Fine thanks", add_special=False))
    assert chat.messages[-1]["content"] == answer
