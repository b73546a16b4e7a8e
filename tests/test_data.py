"""Training-data pipeline: samples (train.cpp tokenize_file) and batches (get_example_targets_batch)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from llamatune.data import samples as data
from llamatune.data.samples import Batcher, Samples, describe, load_samples, process_escapes
from llamatune.errors import LlamatuneError
from llamatune.options import TrainOptions

BOS, EOS, NV = 1, 2, 128


class CharTok:
    """One id per character (its code point); spaces are dropped."""
    bos_id, eos_id, n_vocab = BOS, EOS, NV

    def encode(self, text, add_special=False):
        return [ord(c) for c in text if c != " "]


class PieceTok(CharTok):
    def token_to_piece(self, i):   # every token is one character long
        return "x"


def t(s: str) -> list[int]:
    return [ord(c) for c in s]


def opts(**kw) -> TrainOptions:
    return TrainOptions(**{"ctx": 4, "batch": 1, **kw})


def sample_texts(s: Samples) -> list[str]:
    return ["".join(chr(c) for c in s.tokens[b:b + n]) for b, n in zip(s.begins, s.sizes)]


@pytest.fixture
def notices(monkeypatch):
    got = []
    monkeypatch.setattr(data, "notice", got.append)
    return got


# ---- samples

def test_no_sample_start_every_position():
    s = load_samples("abcdefg", CharTok(), opts(ctx=4), "f.txt")
    assert_array_equal(s.tokens, t("abcdefg"))
    assert_array_equal(s.begins, [0, 1, 2])          # max(1, 7 - 4) samples
    assert_array_equal(s.sizes, [4, 4, 4])
    assert s.tokens.dtype == np.int32 and s.begins.dtype == np.int64


def test_text_shorter_than_one_sample_is_refused():
    with pytest.raises(LlamatuneError, match=r"f.txt: the training data has 3 tokens, fewer than one sample of "
                                             r"8 tokens: use more text or a smaller --ctx"):
        load_samples("abc", CharTok(), opts(ctx=8), "f.txt")
    s = load_samples("abcdefgh", CharTok(), opts(ctx=8), "f.txt")     # exactly one sample is enough
    assert_array_equal(s.begins, [0])
    assert_array_equal(s.sizes, [8])


def test_whitespace_only_text_is_refused():
    with pytest.raises(LlamatuneError, match=r"f.txt: the training data is only whitespace \(4 characters\)"):
        load_samples(" \n\t\n", CharTok(), opts(ctx=2), "f.txt")


def test_sample_start_excluded():
    s = load_samples("xx<s>ab<s>cde<s>", CharTok(), opts(sample_start="<s>"), "f.txt")
    assert sample_texts(s) == ["ab", "cde"]          # the empty last sample is dropped
    assert_array_equal(s.tokens, t("abcde"))
    assert_array_equal(s.begins, [0, 2])
    assert_array_equal(s.sizes, [2, 3])


def test_sample_start_included_and_dropped_notice(notices):
    s = load_samples("<s>ab<s>cde<s>", CharTok(), opts(sample_start="<s>", include_sample_start=True), "f.txt")
    assert sample_texts(s) == ["<s>ab", "<s>cde", "<s>"]
    load_samples("<s><s>ab", CharTok(), opts(sample_start="<s>"), "f.txt")
    assert notices == ["f.txt: dropped 1 empty sample(s)"]


def test_sample_start_not_found(notices):
    s = load_samples("abcd", CharTok(), opts(sample_start="<s>"), "f.txt")
    assert sample_texts(s) == ["abcd"]
    assert "not found" in notices[0] and "f.txt" in notices[0]


def test_sample_start_escape():
    text = "ab\ncd\nef"
    s = load_samples(text, CharTok(), opts(sample_start="\\n", escape=True), "f.txt")
    assert sample_texts(s) == ["cd", "ef"]
    raw = load_samples(text, CharTok(), opts(sample_start="\\n"), "f.txt")   # no --escape: literal
    assert sample_texts(raw) == [text]


def test_process_escapes():
    assert process_escapes(r"a\n\t\r\\\'\"b") == "a\n\t\r\\'\"b"
    assert process_escapes(r"\x41\xe2\x80\x94") == "A\u2014"
    assert process_escapes(r"\q\x4") == r"\q\x4"     # unknown / short escapes stay
    with pytest.raises(LlamatuneError, match="--sample-start"):
        process_escapes(r"\xff")


def test_overlapping_samples():
    o = opts(ctx=3, sample_start="|", overlapping_samples=True)
    s = load_samples("|abcd|efgh|ij", PieceTok(), o, "f.txt")    # at most ctx * 1 characters
    assert sample_texts(s) == ["abc", "efg", "ij"]
    s = load_samples("|abcd|efgh|ij", CharTok(), o, "f.txt")     # default bound: 16 chars/token
    assert sample_texts(s) == ["abcd|efgh|ij", "efgh|ij", "ij"]


def test_errors():
    with pytest.raises(LlamatuneError, match=r"^f\.txt: the training data is empty"):
        load_samples("", CharTok(), opts(), "f.txt")
    with pytest.raises(LlamatuneError, match=r"^f\.txt: the training data is only whitespace"):
        load_samples("   ", CharTok(), opts(), "f.txt")
    with pytest.raises(LlamatuneError, match=r"^f\.txt: the training data yields no tokens"):
        load_samples("abc", type("NoTok", (CharTok,), {"encode": lambda self, s, add_special=False: []})(),
                     opts(), "f.txt")
    with pytest.raises(LlamatuneError, match=r"^f\.txt: no sample yields any tokens"):
        load_samples("<s> <s>", CharTok(), opts(sample_start="<s>"), "f.txt")
    with pytest.raises(LlamatuneError, match=r"^f\.txt: the training data has 1 token"):
        load_samples("a ", CharTok(), opts(), "f.txt")
    with pytest.raises(LlamatuneError, match=r"^f\.txt: the training data has 1 token"):
        load_samples("<s>a", CharTok(), opts(sample_start="<s>"), "f.txt")


def test_describe_and_hash():
    s = Samples(t("abcdef"), [0, 1, 3], [1, 2, 3])
    assert describe(s) == "6 tokens, 3 samples, sample length min 1 / mean 2.0 / max 3 tokens"
    assert s.hash == Samples(t("abcdef"), [0, 1, 3], [1, 2, 3]).hash
    assert s.hash != Samples(t("abcdeg"), [0, 1, 3], [1, 2, 3]).hash
    assert s.hash != Samples(t("abcdef"), [0, 1, 3], [1, 2, 2]).hash
    assert 0 <= s.hash < 2**64


# ---- batches

def unshuffled(b: Batcher) -> Batcher:
    """Fix the order to 0, 1, 2, ... for hand-computed batches."""
    b.order = np.arange(len(b.samples))
    return b


def batcher(samples, **kw) -> Batcher:
    return Batcher(samples, opts(**kw), NV, BOS, EOS)


def test_batch_padding_is_not_a_target():
    s = Samples(t("abcxy"), [0, 3], [3, 2])
    b = unshuffled(batcher(s, ctx=5, batch=2))
    x = b.next_batch()
    assert_array_equal(x.targets, [[*t("abc"), -1, -1], [*t("xy"), -1, -1, -1]])
    assert_array_equal(x.inputs, [[BOS, *t("abc"), EOS], [BOS, *t("xy"), EOS, EOS]])
    assert x.inputs.dtype == np.int64 and x.targets.dtype == np.int64
    assert x.n_targets == 5 and b.token_count == 5 and b.sample_count == 2


def test_batch_separate_with_eos_target():
    s = Samples(t("abcxy"), [0, 3], [3, 2])
    b = unshuffled(batcher(s, ctx=5, batch=2, separate_with_eos=True))
    x = b.next_batch()
    assert_array_equal(x.targets, [[*t("abc"), EOS, -1], [*t("xy"), EOS, -1, -1]])
    assert_array_equal(x.inputs, [[BOS, *t("abc"), EOS], [BOS, *t("xy"), EOS, EOS]])
    assert x.n_targets == 7


def test_batch_truncates_long_sample_and_clamps_ids():
    s = Samples([*t("ab"), 500, *t("cdef")], [0], [7])
    x = batcher(s, ctx=4).next_batch()
    assert_array_equal(x.targets, [[*t("ab"), NV - 1, ord("c")]])
    assert_array_equal(x.inputs, [[BOS, *t("ab"), NV - 1]])


def test_batch_fill_with_next_samples():
    s = Samples(t("abcxyuvw"), [0, 3, 5], [3, 2, 3])
    b = unshuffled(batcher(s, ctx=8, batch=1, fill_with_next_samples=True, separate_with_eos=True))
    x = b.next_batch()
    assert_array_equal(x.targets, [[*t("abc"), EOS, BOS, *t("xy"), EOS]])  # separators cut by the row end
    assert_array_equal(x.inputs, [[BOS, *t("abc"), EOS, BOS, *t("xy")]])
    assert x.n_targets == 8 and b.sample_count == 2 and b.next_sample == 2


def test_batch_fill_without_separators():
    s = Samples(t("abcxyuvw"), [0, 3, 5], [3, 2, 3])
    b = unshuffled(batcher(s, ctx=7, fill_with_next_samples=True, separate_with_bos=False))
    assert_array_equal(b.next_batch().targets, [t("abcxyuv")])


def test_batch_fill_bos_only_default():
    s = Samples(t("abcxyuvw"), [0, 3, 5], [3, 2, 3])
    b = unshuffled(batcher(s, ctx=7, fill_with_next_samples=True))
    assert_array_equal(b.next_batch().targets, [[*t("abc"), BOS, *t("xy"), BOS]])


def test_no_sample_start_batches():
    s = load_samples("abcdefg", CharTok(), opts(ctx=4), "f.txt")
    b = unshuffled(batcher(s, ctx=4, batch=3))
    x = b.next_batch()
    assert_array_equal(x.targets, [t("abcd"), t("bcde"), t("cdef")])
    assert_array_equal(x.inputs, [[BOS, *t("abc")], [BOS, *t("bcd")], [BOS, *t("cde")]])


def test_shuffle_is_a_seeded_permutation():
    s = Samples(np.arange(40) + 10, np.arange(20) * 2, np.full(20, 2))
    a, b, c = batcher(s, seed=7), batcher(s, seed=7), batcher(s, seed=8)
    assert_array_equal(a.order, b.order)
    assert sorted(a.order.tolist()) == list(range(20))
    assert not np.array_equal(a.order, c.order)
    for _ in range(30):
        assert_array_equal(a.next_batch().targets, b.next_batch().targets)


def test_epoch_rollover():
    s = Samples(t("abcdefghi"), [0, 3, 6], [3, 3, 3])
    b = batcher(s, ctx=3, batch=2, seed=3)
    order0 = b.order.copy()
    x1 = b.next_batch()
    assert not x1.epoch_done and b.epoch == 0 and b.next_sample == 2
    x2 = b.next_batch()                     # 3rd sample ends epoch 0, 4th is epoch 1's first
    assert x2.epoch_done and b.epoch == 1 and b.next_sample == 1 and b.sample_count == 4
    order1 = b.order.copy()
    rows = [s.tokens[s.begins[i]:s.begins[i] + 3] for i in [*order0, order1[0]]]
    assert_array_equal(np.concatenate([x1.targets, x2.targets]), rows)
    assert sorted(order0.tolist()) == [0, 1, 2]          # every sample once per epoch
    x3 = b.next_batch()                     # epoch 1's 2nd and 3rd samples: ends epoch 1
    assert_array_equal(x3.targets, [s.tokens[s.begins[i]:s.begins[i] + 3] for i in order1[1:]])
    assert x3.epoch_done and b.epoch == 2 and b.next_sample == 0
    assert not b.next_batch().epoch_done and b.epoch == 2 and b.sample_count == 8


def test_epoch_done_on_exact_boundary():
    s = Samples(t("abcd"), [0, 2], [2, 2])
    b = batcher(s, ctx=2, batch=2)
    assert [b.next_batch().epoch_done for _ in range(3)] == [True, True, True]
    assert b.epoch == 3 and b.next_sample == 0


def test_random_offsets():
    s = Samples(t("abcdefgh"), [0, 4], [4, 4])
    b = batcher(s, ctx=4, batch=2, seed=5, sample_random_offsets=True)
    rng = np.random.default_rng(5)             # the documented draw: permutation, then offsets
    order = rng.permutation(2)
    offs = rng.integers(0, s.sizes[order])
    assert_array_equal(b.order, order)
    assert_array_equal(b.offsets, offs)
    x = b.next_batch()
    for k in range(2):
        rest = s.tokens[s.begins[order[k]] + offs[k]:s.begins[order[k]] + 4]
        assert_array_equal(x.targets[k], [*rest, *[-1] * offs[k]])
    seen = set()
    for _ in range(50):
        seen.update(b.offsets.tolist())
        b.next_batch()
    assert seen == {0, 1, 2, 3}


@pytest.mark.parametrize("kw", [dict(), dict(fill_with_next_samples=True, separate_with_eos=True),
                                dict(sample_random_offsets=True, fill_with_next_samples=True)])
def test_resume_continues_the_same_sequence(kw, notices):
    s = load_samples("the quick brown fox jumps over the lazy dog", CharTok(), opts(ctx=6), "f.txt")
    a = batcher(s, ctx=6, batch=3, seed=11, **kw)
    for _ in range(5):
        a.next_batch()
    saved = json.loads(json.dumps(a.state()))
    b = batcher(s, ctx=6, batch=3, seed=999, **kw)            # a different fresh state, then restored
    b.load_state(saved, s)
    assert (b.epoch, b.next_sample, b.sample_count, b.token_count) == \
           (a.epoch, a.next_sample, a.sample_count, a.token_count)
    for _ in range(25):
        xa, xb = a.next_batch(), b.next_batch()
        assert_array_equal(xa.inputs, xb.inputs)
        assert_array_equal(xa.targets, xb.targets)
        assert xa.epoch_done == xb.epoch_done
    assert a.state() == b.state()
    assert notices == []


def test_changed_data_reshuffles(notices):
    s = Samples(t("abcdefghij"), np.arange(5) * 2, np.full(5, 2))
    a = batcher(s, ctx=2, batch=2, seed=4)
    for _ in range(4):
        a.next_batch()
    saved = json.loads(json.dumps(a.state()))
    s2 = Samples(t("abcdefghijkl"), np.arange(6) * 2, np.full(6, 2))
    b = batcher(s2, ctx=2, batch=2, seed=4)
    b.load_state(saved, s2)
    assert "changed" in notices[0] and "5 -> 6" in notices[0]
    assert (b.epoch, b.next_sample, b.sample_count, b.token_count) == (a.epoch, 0, a.sample_count, a.token_count)
    rng = np.random.default_rng()
    rng.bit_generator.state = saved["rng_state"]              # fresh shuffle from the restored Generator
    assert_array_equal(b.order, rng.permutation(6))
    assert b.state()["samples_hash"] == s2.hash


def test_force_reshuffle(notices):
    s = Samples(t("abcdefghij"), np.arange(5) * 2, np.full(5, 2))
    a = batcher(s, ctx=2, batch=2, seed=4)
    a.next_batch()
    saved = json.loads(json.dumps(a.state()))
    b = batcher(s, ctx=2, batch=2, seed=4)
    b.load_state(saved, s, force_reshuffle=True)
    assert "forced reshuffle" in notices[0]
    assert (b.epoch, b.next_sample, b.sample_count, b.token_count) == (0, 0, 2, 4)
    rng = np.random.default_rng()
    rng.bit_generator.state = saved["rng_state"]
    assert_array_equal(b.order, rng.permutation(5))


def test_bad_state_and_empty_samples():
    s = Samples(t("ab"), [0], [2])
    b = batcher(s)
    bad = b.state()
    del bad["rng_state"]
    with pytest.raises(LlamatuneError, match="training state: missing or invalid field"):
        b.load_state(bad, s)
    with pytest.raises(LlamatuneError, match="version 99"):
        b.load_state({**b.state(), "version": 99}, s)
    with pytest.raises(LlamatuneError, match="at least one token"):
        batcher(Samples(t("ab"), [0, 2], [2, 0]))


# ---- whole sequences (conversations, rows): masks, padding, packing

SEQS = [([10, 11, 12, 13], [0, 0, 1, 1]), ([20, 21, 22], [0, 1, 1]), ([30, 31, 32, 33, 34], [0, 0, 0, 1, 1]),
        ([40, 41], [0, 1]), ([50, 51, 52, 53, 54, 55, 56], [0, 1, 0, 1, 0, 1, 1])]


def seq_samples() -> Samples:
    sizes = [len(t) for t, _ in SEQS]
    return Samples(np.concatenate([t for t, _ in SEQS]), np.cumsum([0] + sizes[:-1]), sizes,
                   np.concatenate([m for _, m in SEQS]))


def test_mask_changes_the_hash_and_must_align():
    s = seq_samples()
    assert s.hash != Samples(s.tokens, s.begins, s.sizes).hash
    with pytest.raises(ValueError, match="mask has 3 entries for 21 tokens"):
        Samples(s.tokens, s.begins, s.sizes, [1, 1, 1])


def test_sequences_one_per_row_padded():
    o = opts(ctx=6, batch=5)
    b = Batcher(seq_samples(), o, NV, BOS, EOS)
    order = list(b.order)
    batch = b.next_batch()
    assert batch.positions is None and batch.segments is None and batch.epoch_done
    for k, idx in enumerate(order):
        tokens, mask = (np.array(a) for a in SEQS[idx])
        n = min(len(tokens) - 1, 6)
        want_in = np.full(6, EOS)
        want_in[:n] = tokens[:n]
        want_t = np.full(6, -1)
        want_t[:n] = np.where(mask[1:n + 1] > 0, tokens[1:n + 1], -1)
        assert_array_equal(batch.inputs[k], want_in)
        assert_array_equal(batch.targets[k], want_t)
    assert batch.n_targets == sum(int(np.sum(m[1:7])) for _, m in SEQS)


def test_sequences_packed_with_positions_and_segments():
    o = opts(ctx=8, batch=2, pack=True)
    b = Batcher(seq_samples(), o, NV, BOS, EOS)
    seen = []
    for _ in range(3):
        batch = b.next_batch()
        for k in range(2):
            seg, pos = batch.segments[k], batch.positions[k]
            ids = list(dict.fromkeys(seg.tolist()))
            assert ids == list(range(len(ids)))                       # 0, 1, 2, ... in order
            for s_id in ids:
                cols = np.flatnonzero(seg == s_id)
                assert_array_equal(cols, np.arange(cols[0], cols[0] + len(cols)))   # contiguous
                assert_array_equal(pos[cols], np.arange(len(cols)))                  # restarts at 0
                ins, tg = batch.inputs[k, cols], batch.targets[k, cols]
                match = [i for i, (t, m) in enumerate(SEQS) if len(t) - 1 == len(cols) and list(t[:-1]) == list(ins)]
                if not match:                                         # padding: its own segment, no targets
                    assert s_id == ids[-1] and (tg == -1).all() and (ins == EOS).all()
                    continue
                t, m = (np.array(a) for a in SEQS[match[0]])
                assert_array_equal(tg, np.where(m[1:] > 0, t[1:], -1))
                seen.append(match[0])
    assert sorted(seen[:5]) == [0, 1, 2, 3, 4]                        # an epoch: each sample once


def test_packed_state_resumes_exactly():
    o = opts(ctx=8, batch=2, pack=True)
    a = Batcher(seq_samples(), o, NV, BOS, EOS)
    for _ in range(3):
        a.next_batch()
    state = json.loads(json.dumps(a.state()))
    b = Batcher(seq_samples(), o, NV, BOS, EOS)
    b.load_state(state, seq_samples())
    for _ in range(4):
        x, y = a.next_batch(), b.next_batch()
        for f in ("inputs", "targets", "positions", "segments"):
            assert_array_equal(getattr(x, f), getattr(y, f))
    assert a.state() == b.state()


def test_sequences_need_two_tokens():
    with pytest.raises(LlamatuneError, match="every conversation or row needs at least two tokens"):
        Batcher(Samples([5, 6, 7], [0, 2], [2, 1], [0, 1, 0]), opts(), NV, BOS, EOS)
