"""Preference pairs (--method dpo / orpo): row formats, shared prompts, masks, every bad
row and option error, the pair batcher, the pair split and preview-data."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from numpy.testing import assert_array_equal
from typer.testing import CliRunner

from llamatune.cli.main import app
from llamatune.data import datasets
from llamatune.data.datasets import load_dataset, load_pairs, preview
from llamatune.errors import LlamatuneError
from llamatune.models.chat_template import load_template
from llamatune.options import FinetuneOptions, validate
from llamatune.train.preference import PairBatcher, split_pairs

PROMPT = [{"role": "user", "content": "Greet me."}]
CHOSEN = [{"role": "assistant", "content": "Good day to you."}]
REJECTED = [{"role": "assistant", "content": "Yo."}]


def opts(**kw) -> FinetuneOptions:
    return FinetuneOptions(**{"ctx": 64, "batch": 2, "method": "dpo", **kw})


def write_rows(tmp_path, rows, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def sample(s, i):
    b, n = int(s.begins[i]), int(s.sizes[i])
    return s.tokens[b:b + n], s.mask[b:b + n]


@pytest.fixture
def notices(monkeypatch):
    got = []
    monkeypatch.setattr(datasets, "notice", got.append)
    return got


def test_standard_rows_share_the_prompt_and_train_the_answers(tmp_path, qwen_tokenizer):
    tok = qwen_tokenizer
    s = load_pairs(write_rows(tmp_path, [{"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"},
                                         {"chosen": "Yes.", "rejected": "No."}]), tok, opts())
    assert len(s) == 4                                                # chosen, rejected, chosen, rejected
    head = tok.encode("2 + 2 =", add_special=True)
    for i, answer in ((0, " 4"), (1, " 5")):
        tokens, mask = sample(s, i)
        assert_array_equal(tokens, head + tok.encode(answer) + [tok.eos_id])
        assert_array_equal(mask, [0] * len(head) + [1] * (len(tokens) - len(head)))
    for i, answer in ((2, "Yes."), (3, "No.")):                       # no prompt: the whole text is trained
        tokens, mask = sample(s, i)
        head = tok.encode("", add_special=True)
        assert_array_equal(tokens, head + tok.encode(answer) + [tok.eos_id])
        want = [0] * len(head) + [1] * (len(tokens) - len(head))
        want[0] = 0                                                   # a sample's first token predicts nothing
        assert_array_equal(mask, want)


def test_conversational_rows_render_as_sft_chat_rows(tmp_path, qwen_tokenizer):
    tok = qwen_tokenizer
    template = load_template(tok, None)
    rows = [{"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED},
            {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED, "system": "Be polite."},
            {"chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED}]          # implicit prompt
    s = load_pairs(write_rows(tmp_path, rows), tok, opts())
    sft = load_dataset(write_rows(tmp_path, [{"prompt": PROMPT, "completion": CHOSEN},
                                             {"prompt": PROMPT, "completion": REJECTED}], "sft.jsonl"),
                       tok, FinetuneOptions(ctx=64))
    for pair in (0, 2):                                  # exactly the prompt/completion chat rows of SFT
        for k in range(2):
            assert_array_equal(sample(s, 2 * pair + k)[0], sample(sft, k)[0])
            assert_array_equal(sample(s, 2 * pair + k)[1], sample(sft, k)[1])
    system = [{"role": "system", "content": "Be polite."}]
    want = template.encode(system + PROMPT + CHOSEN, {2})
    assert_array_equal(sample(s, 2)[0], want.tokens)
    assert_array_equal(sample(s, 2)[1], want.mask)
    tokens, mask = sample(s, 1)
    assert "".join(tok.decode([t]) for t, m in zip(tokens, mask) if m).startswith("Yo.")
    c, r = sample(s, 0)[0], sample(s, 1)[0]
    shared = int(np.argmax(c[:len(r)] != r[:len(c)]))
    assert shared > 0 and not sample(s, 0)[1][:shared].any()         # the prompt is shared and not trained


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "p", "rejected": "b"}, "a preference row needs 'chosen'"),
    ({"prompt": "p", "chosen": "a"}, "a preference row needs 'rejected'"),
    ({"prompt": "p", "completion": "a"}, r"a preference row needs 'chosen' \(found completion, prompt\)"),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, "'chosen' is empty"),
    ({"prompt": PROMPT, "chosen": CHOSEN, "rejected": []}, "'rejected' is empty"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "chosen and rejected are the same"),
    ({"prompt": "p", "chosen": "a", "rejected": "b", "system": "s"}, "'system' goes with conversational rows"),
    ({"prompt": "p", "chosen": CHOSEN, "rejected": REJECTED}, "prompt, chosen and rejected must all be strings or all lists"),
    ({"prompt": "p", "chosen": 3, "rejected": "b"}, "chosen must be a string, got int"),
    ({"prompt": PROMPT, "chosen": [{"role": "assistant"}], "rejected": REJECTED}, r"chosen\[0\] must be an object"),
    ({"prompt": PROMPT, "chosen": PROMPT, "rejected": REJECTED}, "no assistant message to train on"),
    ([1, 2], "a row must be a JSON object, got list"),
    ("{broken", "not valid JSON"),
])
def test_bad_rows_name_file_and_line(tmp_path, qwen_tokenizer, row, problem):
    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    path = write_rows(tmp_path, [good, row if isinstance(row, str) else json.dumps(row)])
    with pytest.raises(LlamatuneError, match=f"^{path}:2: {problem}"):
        load_pairs(path, qwen_tokenizer, opts())


def test_answers_that_render_alike_are_a_bad_row(tmp_path, qwen_tokenizer):
    """Messages that differ only in a field the chat template does not render."""
    chosen, rejected = [{**CHOSEN[0], "name": "a"}], [{**CHOSEN[0], "name": "b"}]
    path = write_rows(tmp_path, [{"prompt": PROMPT, "chosen": chosen, "rejected": rejected}])
    with pytest.raises(LlamatuneError, match=f"^{path}:1: chosen and rejected give the same tokens"):
        load_pairs(path, qwen_tokenizer, opts())


def test_skip_bad_rows_counts_them(tmp_path, qwen_tokenizer, notices):
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": "a"},
            {"prompt": "p", "chosen": "c", "rejected": "c"}, {"prompt": "q", "chosen": "c", "rejected": "d"}]
    path = write_rows(tmp_path, rows)
    s = load_pairs(path, qwen_tokenizer, opts(skip_bad_rows=True))
    assert len(s) == 4
    assert notices == [f"{path}: skipped 2 malformed row(s) (first: line 2: a preference row needs 'rejected')"]


def test_raw_text_and_empty_results_are_refused(tmp_path, qwen_tokenizer, notices):
    text = tmp_path / "t.txt"
    text.write_text("just some text\n")
    with pytest.raises(LlamatuneError, match=f"^{text}: --method dpo trains on preference rows"):
        load_pairs(text, qwen_tokenizer, opts())
    path = write_rows(tmp_path, [{"prompt": "p " * 80, "chosen": "a", "rejected": "b"}])
    with pytest.raises(LlamatuneError, match=f"^{path}: no preference pair with answers to score"):
        load_pairs(path, qwen_tokenizer, opts(ctx=16))
    assert notices[-1].startswith(f"{path}: dropped 1 pair(s) left without an answer")
    with pytest.raises(LlamatuneError, match="^--val-data is required"):
        load_pairs(None, qwen_tokenizer, opts(), "validation")


def test_long_pairs_are_cut_or_dropped_together(tmp_path, qwen_tokenizer, notices):
    tok = qwen_tokenizer
    rows = [{"prompt": "p", "chosen": "one two three " * 10, "rejected": "four"},
            {"prompt": "p", "chosen": "a", "rejected": "b"}]
    path = write_rows(tmp_path, rows)
    s = load_pairs(path, tok, opts(ctx=8))
    assert len(s) == 4 and s.sizes[0] == 9 and s.sizes[1] < 9
    assert notices[-1] == (f"{path}: 1 of 2 pair(s) longer than --ctx 8: truncated to --ctx "
                           "(use --drop-long to drop them)")
    s = load_pairs(path, tok, opts(ctx=8, drop_long=True))
    assert len(s) == 2 and notices[-1].endswith("dropped (--drop-long)")


def test_a_pair_row_under_sft_names_the_method(tmp_path, qwen_tokenizer):
    path = write_rows(tmp_path, [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    with pytest.raises(LlamatuneError, match=f"^{path}:1: a preference pair .* with --method dpo or orpo"):
        load_dataset(path, qwen_tokenizer, FinetuneOptions(ctx=64))


@pytest.mark.parametrize("over, message", [
    (dict(method="ppo"), "--method 'ppo': choose sft, dpo, orpo"),
    (dict(loss_type="hinge"), "--loss-type 'hinge': choose sigmoid, ipo"),
    (dict(beta=0.0), "--beta 0.0: must be greater than 0"),
    (dict(beta=float("nan")), "--beta nan: must be a finite number"),
    (dict(label_smoothing=0.5), r"--label-smoothing 0.5: must be in \[0, 0.5\)"),
    (dict(batch=3), "--batch 3: --method dpo puts a pair's chosen and rejected answers in two rows"),
    (dict(pack=True), "--pack: --method dpo trains on whole pairs"),
    (dict(lora_dropout=0.1), "--lora-dropout 0.1: --method dpo weighs each answer"),
    (dict(label_smoothing=0.1, loss_type="ipo"), "--label-smoothing applies to --method dpo --loss-type sigmoid"),
    (dict(method="orpo", label_smoothing=0.1), "--label-smoothing applies to --method dpo --loss-type sigmoid"),
    (dict(train_on_prompt=True), "--train-on-prompt: --method dpo scores the answers only"),
])
def test_option_errors(over, message):
    with pytest.raises(LlamatuneError, match="^" + message):
        validate(opts(**over))


def test_sft_keeps_its_options():
    validate(FinetuneOptions(batch=3, pack=True, lora_dropout=0.1))          # no pair rules without pairs


def pair_samples(tmp_path, tok, n):
    rows = [{"prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(n)]
    return load_pairs(write_rows(tmp_path, rows), tok, opts())


def test_pair_batcher_keeps_pairs_in_adjacent_rows_and_resumes(tmp_path, qwen_tokenizer):
    s = pair_samples(tmp_path, qwen_tokenizer, 5)
    o = opts(batch=4, seed=3)
    b = PairBatcher(s, o, qwen_tokenizer.n_vocab, qwen_tokenizer.bos_id, qwen_tokenizer.eos_id)
    seen = []
    for _ in range(5):                                  # 20 rows: two epochs over 5 pairs
        batch = b.next_batch()
        ids = batch.sample_ids
        assert_array_equal(ids[1::2], ids[0::2] + 1) and (ids[0::2] % 2 == 0).all()
        for k, i in enumerate(ids):                     # each row holds its sample
            tokens, mask = sample(s, i)
            assert_array_equal(batch.inputs[k, :len(tokens) - 1], tokens[:-1])
        seen += list(ids[0::2] // 2)
    assert sorted(seen[:5]) == list(range(5)) and sorted(seen[5:10]) == list(range(5))
    assert seen[:5] != list(range(5))                   # shuffled
    b.reference[2] = [-1.5, -2.25]
    state = json.loads(json.dumps(b.state()))
    want = [b.next_batch() for _ in range(3)]
    c = PairBatcher(s, o, qwen_tokenizer.n_vocab, qwen_tokenizer.bos_id, qwen_tokenizer.eos_id)
    c.load_state(state, s)
    assert_array_equal(c.reference, b.reference)
    for w in want:
        g = c.next_batch()
        assert_array_equal(g.sample_ids, w.sample_ids)
        assert_array_equal(g.inputs, w.inputs)
        assert_array_equal(g.targets, w.targets)
    other = pair_samples(tmp_path, qwen_tokenizer, 6)             # other data: the reference starts afresh
    c.load_state(state, other)
    assert c.reference.shape == (6, 2) and np.isnan(c.reference).all()
    broken = {**state, "reference": [[0.0, 0.0]]}
    with pytest.raises(LlamatuneError, match="^training state: the reference log-probabilities are not 5 pairs"):
        c.load_state(broken, s)


def test_split_pairs_holds_out_whole_pairs(tmp_path, qwen_tokenizer):
    s = pair_samples(tmp_path, qwen_tokenizer, 10)
    train, val = split_pairs(s, 0.25, seed=1)
    assert len(train) == 14 and len(val) == 6
    for part in (train, val):
        for i in range(0, len(part), 2):
            c, r = sample(part, i)[0], sample(part, i + 1)[0]
            assert qwen_tokenizer.decode(c.tolist()).replace("good", "bad") == qwen_tokenizer.decode(r.tolist())
    assert not set(val.begins) & set(train.begins)
    with pytest.raises(LlamatuneError, match=r"^--val-split 0.95: 10 pair\(s\) leave none for training"):
        split_pairs(s, 0.95, seed=1)


def test_preview_data_shows_pairs(qwen_vocab, qwen_tokenizer, tmp_path):
    path = write_rows(tmp_path, [{"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"},
                                 {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}])
    runner = CliRunner()
    r = runner.invoke(app, ["preview-data", "--model-base", str(qwen_vocab), "--train-data", str(path),
                            "--method", "dpo", "-n", "1", "--json"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.output.splitlines()]
    want = preview(load_pairs(path, qwen_tokenizer, opts()), qwen_tokenizer.bos_id, 2)
    assert [(x["pair"], x["answer"]) for x in lines] == [(0, "chosen"), (0, "rejected")]
    for got, (tokens, targets) in zip(lines, want):
        assert got["tokens"] == tokens.tolist() and got["targets"] == targets.tolist()
    r = runner.invoke(app, ["preview-data", "--model-base", str(qwen_vocab), "--train-data", str(path),
                            "--method", "orpo", "-n", "2"])
    assert r.exit_code == 0 and "pair 2, rejected:" in r.output and "Yo." in r.output
    r = runner.invoke(app, ["preview-data", "--model-base", str(qwen_vocab), "--train-data", str(path)])
    assert r.exit_code == 1 and r.output.startswith(f"error: {path}:1: a preference pair")


def test_every_preference_option_reaches_the_cli():
    names = {f.name for f in dataclasses.fields(FinetuneOptions)}
    assert {"method", "beta", "loss_type", "label_smoothing"} <= names
    r = CliRunner().invoke(app, ["finetune", "--help"])
    for flag in ("--method", "--beta", "--loss-type", "--label-smoothing"):
        assert flag in r.output


def test_the_example_preset_and_pairs_load(qwen_tokenizer):
    from conftest import REPO
    from llamatune.options import load_preset
    o = FinetuneOptions(**load_preset(REPO / "configs" / "finetune-dpo.toml", FinetuneOptions))
    validate(o)
    assert (o.method, o.beta, o.batch) == ("dpo", 0.1, 4)
    s = load_pairs(REPO / "configs" / "pairs-example.jsonl", qwen_tokenizer, o)
    assert len(s) == 8 and all(sample(s, i)[1].any() for i in range(8))
