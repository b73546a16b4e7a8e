"""Data files: format detection, every row format, masks, malformed rows, long samples."""
from __future__ import annotations

import json

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from llamatune.data import datasets
from llamatune.data.datasets import load_dataset, preview
from llamatune.data.samples import load_samples
from llamatune.errors import LlamatuneError
from llamatune.options import FinetuneOptions

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"},
        {"role": "assistant", "content": "Bye."}]
IM_START, IM_END = 151644, 151645


def opts(**kw) -> FinetuneOptions:
    return FinetuneOptions(**{"ctx": 64, **kw})


def write_rows(tmp_path, rows, name="d.jsonl") -> object:
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def notices(monkeypatch):
    got = []
    monkeypatch.setattr(datasets, "notice", got.append)
    return got


def sample(s, i):
    b, n = int(s.begins[i]), int(s.sizes[i])
    return s.tokens[b:b + n], s.mask[b:b + n]


def test_raw_text_is_unchanged(tmp_path, qwen_tokenizer):
    text = "{not json} just text\n" * 20
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    o = opts(ctx=16)
    s, ref = load_dataset(path, qwen_tokenizer, o), load_samples(text, qwen_tokenizer, o, str(path))
    assert s.mask is None and s.hash == ref.hash
    assert load_dataset(path, qwen_tokenizer, opts(ctx=16, data_format="text")).hash == ref.hash


def test_every_row_format(tmp_path, qwen_tokenizer):
    tok = qwen_tokenizer
    sharegpt = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                for m in CONV]
    rows = [{"messages": CONV}, {"conversations": sharegpt},
            {"prompt": "2 + 2 =", "completion": " 4"},
            {"instruction": "Add.", "input": "2 + 2", "output": "4"},
            {"text": "Plain words."},
            {"prompt": CONV[:3], "completion": CONV[3:]}]
    s = load_dataset(write_rows(tmp_path, rows), tok, opts())
    assert len(s) == 6
    chat, chat_mask = sample(s, 0)
    assert_array_equal(sample(s, 1)[0], chat)                        # ShareGPT == messages
    assert_array_equal(sample(s, 1)[1], chat_mask)
    trained = [tok.decode([t]) for t, m in zip(chat, chat_mask) if m]
    assert "".join(trained) == "Hello.Bye." and chat[chat_mask > 0][-1] == IM_END
    assert int(chat_mask.sum()) == len(tok.encode("Hello.")) + len(tok.encode("Bye.")) + 2
    pc, pc_mask = sample(s, 2)                                       # plain prompt/completion
    head = tok.encode("2 + 2 =", add_special=True)
    assert_array_equal(pc, head + tok.encode(" 4") + [tok.eos_id])
    assert_array_equal(pc_mask, [0] * len(head) + [1] * (len(pc) - len(head)))
    alpaca, alpaca_mask = sample(s, 3)
    from llamatune.models.chat_template import load_template
    ref = load_template(tok, None).encode([{"role": "user", "content": "Add.\n\n2 + 2"},
                                          {"role": "assistant", "content": "4"}])
    assert_array_equal(alpaca, ref.tokens)
    assert_array_equal(alpaca_mask, ref.mask)
    text, text_mask = sample(s, 4)
    assert_array_equal(text, tok.encode("Plain words.", add_special=True) + [tok.eos_id])
    assert_array_equal(text_mask, [0] + [1] * (len(text) - 1))
    split, split_mask = sample(s, 5)                                 # only the completion's answer
    assert_array_equal(split, chat)
    assert "".join(tok.decode([t]) for t, m in zip(split, split_mask) if m) == "Bye."


def test_json_array_and_its_line_numbers(tmp_path, qwen_tokenizer):
    path = tmp_path / "d.json"
    path.write_text('[\n {"messages": %s},\n {"text": "x"},\n {"messages": []}\n]\n' % json.dumps(CONV))
    with pytest.raises(LlamatuneError, match=r"d\.json:4: 'messages' must be a non-empty list"):
        load_dataset(path, qwen_tokenizer, opts())
    path.write_text('[{"text": "one two"}, {"text": "three four"}]')
    assert len(load_dataset(path, qwen_tokenizer, opts())) == 2


@pytest.mark.parametrize("row,match", [
    ('{"messages": [{"role": "user"}]}', r":2: messages\[0\] must be an object with 'role' and 'content'"),
    ('{"messages": [{"role": "user", "content": 5}]}', r":2: messages\[0\]\.content must be a string, got int"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', r":2: no assistant message to train on"),
    ('{"conversations": [{"from": "alien", "value": "x"}]}', r":2: conversations\[0\]\.from 'alien' is not one of"),
    ('{"prompt": "x"}', r":2: a prompt row needs 'completion'"),
    ('{"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]}', r":2: prompt and completion must both"),
    ('{"instruction": "x"}', r":2: an instruction row needs 'output'"),
    ('{"question": "x"}', r":2: no known fields .* found question"),
    ('[1, 2]', r":2: a row must be a JSON object, got list"),
    ('{"text": "x", ', r":2: not valid JSON"),
])
def test_malformed_rows_name_file_and_line(tmp_path, qwen_tokenizer, row, match):
    path = write_rows(tmp_path, [{"text": "fine row"}, row, {"text": "another"}])
    with pytest.raises(LlamatuneError, match=r"d\.jsonl" + match):
        load_dataset(path, qwen_tokenizer, opts())


def test_skip_bad_rows_counts_them(tmp_path, qwen_tokenizer, notices):
    path = write_rows(tmp_path, [{"text": "fine row"}, '{"text": 3}', "{oops", {"text": "another"}])
    s = load_dataset(path, qwen_tokenizer, opts(skip_bad_rows=True))
    assert len(s) == 2
    assert notices == [f"{path}: skipped 2 malformed row(s) (first: line 2: text must be a string, got int)"]


@pytest.mark.parametrize("name", ["d.jsonl", "d.JSON"])
def test_a_json_file_that_does_not_parse_is_an_error_not_raw_text(tmp_path, qwen_tokenizer, name):
    path = write_rows(tmp_path, ['{"messages": [{"role": "user"'], name)        # cut off mid-row
    with pytest.raises(LlamatuneError, match=r"d\.(jsonl|JSON):1: not valid JSON"):
        load_dataset(path, qwen_tokenizer, opts())
    assert load_dataset(path, qwen_tokenizer, opts(ctx=4, data_format="text")).mask is None   # unless asked for


def test_format_override_checks_rows(tmp_path, qwen_tokenizer):
    path = write_rows(tmp_path, [{"text": "x y"}])
    with pytest.raises(LlamatuneError, match=r":1: --data-format chat expects 'messages' or 'conversations'"):
        load_dataset(path, qwen_tokenizer, opts(data_format="chat"))
    path = write_rows(tmp_path, [{"messages": CONV}])
    with pytest.raises(LlamatuneError, match=r":1: --data-format completion expects"):
        load_dataset(path, qwen_tokenizer, opts(data_format="completion"))
    s = load_dataset(path, qwen_tokenizer, opts(data_format="text"))    # the JSON itself as raw text
    assert s.mask is None


def test_long_samples_truncated_or_dropped(tmp_path, qwen_tokenizer, notices):
    long = {"messages": [{"role": "user", "content": "a " * 10}, {"role": "assistant", "content": "b " * 80}]}
    path = write_rows(tmp_path, [long, {"text": "short one"}])
    s = load_dataset(path, qwen_tokenizer, opts(ctx=40))
    assert list(s.sizes) == [41, len(qwen_tokenizer.encode("short one")) + 1]
    assert notices == [f"{path}: 1 of 2 sample(s) longer than --ctx 40: truncated to --ctx (use --drop-long to drop them)"]
    notices.clear()
    s = load_dataset(path, qwen_tokenizer, opts(ctx=40, drop_long=True))
    assert len(s) == 1 and "dropped (--drop-long)" in notices[0]
    notices.clear()
    s = load_dataset(path, qwen_tokenizer, opts(ctx=12))    # truncated before the answer: no target left
    assert len(s) == 1 and notices[-1] == f"{path}: dropped 1 sample(s) with no loss target within --ctx 12"


def test_train_on_prompt(tmp_path, qwen_tokenizer):
    s = load_dataset(write_rows(tmp_path, [{"messages": CONV}, {"prompt": "p", "completion": "c"}]),
                     qwen_tokenizer, opts(train_on_prompt=True))
    for i in range(2):
        tokens, mask = sample(s, i)
        assert_array_equal(mask, [0] + [1] * (len(tokens) - 1))


def test_content_is_never_parsed_for_special_tokens(tmp_path, qwen_tokenizer):
    conv = [{"role": "user", "content": "say <|im_end|> please"}, {"role": "assistant", "content": "<|im_start|>ok"}]
    tokens, mask = sample(load_dataset(write_rows(tmp_path, [{"messages": conv}]), qwen_tokenizer, opts()), 0)
    assert list(tokens).count(IM_END) == 3 and list(tokens).count(IM_START) == 3   # system, user, assistant
    assert "".join(qwen_tokenizer.decode([t]) for t, m in zip(tokens, mask) if m) == "<|im_start|>ok"


def test_conversations_need_a_template(tmp_path, qwen_tokenizer, monkeypatch):
    monkeypatch.setattr(qwen_tokenizer, "chat_template", None)
    path = write_rows(tmp_path, [{"messages": CONV}])
    with pytest.raises(LlamatuneError, match=r"d\.jsonl: conversations need a chat template .* --chat-template"):
        load_dataset(path, qwen_tokenizer, opts())
    s = load_dataset(path, qwen_tokenizer, opts(chat_template="chatml"))       # built-in: no default system
    assert sample(s, 0)[0][0] == IM_START and len(s) == 1
    with pytest.raises(LlamatuneError, match=r"--chat-template 'nope': neither a file nor a built-in name"):
        load_dataset(path, qwen_tokenizer, opts(chat_template="nope"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    with pytest.raises(LlamatuneError, match=r"bad\.jinja: not a valid Jinja template"):
        load_dataset(path, qwen_tokenizer, opts(chat_template=str(bad)))


def test_template_errors_are_user_errors(tmp_path, qwen_tokenizer):
    path = write_rows(tmp_path, [{"messages": CONV}])            # gemma rejects system messages
    with pytest.raises(LlamatuneError, match=r"built-in chat template 'gemma': System role not supported"):
        load_dataset(path, qwen_tokenizer, opts(chat_template="gemma"))


def test_preview_matches_samples(tmp_path, qwen_tokenizer):
    s = load_dataset(write_rows(tmp_path, [{"messages": CONV}]), qwen_tokenizer, opts())
    (tokens, targets), = preview(s, qwen_tokenizer.bos_id, 5)
    assert_array_equal(tokens, sample(s, 0)[0])
    assert_array_equal(targets, sample(s, 0)[1])
    raw = load_samples("one two three", qwen_tokenizer, opts(ctx=3), "t")
    (tokens, targets), = preview(raw, 7, 1)
    assert_array_equal(tokens, [7] + qwen_tokenizer.encode("one two three"))
    assert_array_equal(targets, [0, 1, 1, 1])
    assert tokens.dtype == np.int64
