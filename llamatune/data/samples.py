"""Training data: samples cut from a text, and the batches the trainer consumes.

Mirrors llama.cpp's 2023 common/train.cpp:
  tokenize_file             -> load_samples
  shuffle_samples           -> Batcher._shuffle
  get_example_targets_batch -> Batcher.next_batch
with these deliberate changes:
  * numpy's seeded Generator (PCG64) replaces std::mt19937 for the shuffle order and the
    random sample offsets;
  * padding positions are never loss targets (target -1; train.cpp trained EOS there);
  * when the shuffled order runs out inside a batch, the next epoch's order is drawn at
    once (train.cpp wrapped around the old order and reshuffled after the batch);
  * empty samples are dropped instead of being kept with size 0;
  * a missing --sample-start pattern gives one sample holding the whole text (train.cpp
    also skipped len(pattern) characters at the start).
Text is handled as Python str, so sample boundaries never split a UTF-8 character.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.markup import escape as _esc

from ..console import notice
from ..errors import LlamatuneError
from ..options import TrainOptions

STATE_VERSION = 1
_DEFAULT_PIECE_CHARS = 16   # bound on a token's text length when the tokenizer cannot tell
_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"'": b"'", b'"': b'"', b"\\": b"\\"}
_HEX = b"0123456789abcdefABCDEF"


class Samples:
    """All sample tokens concatenated; sample i is tokens[begins[i] : begins[i] + sizes[i]].

    `mask` (int8, aligned with tokens) marks loss targets: 1 where the token is predicted
    from the tokens before it in its sample, 0 where it is context only. None: raw text,
    every token is a target and samples are windows the batcher prefixes with BOS. With a
    mask, each sample is a whole sequence (a conversation, a row) fed as it is."""

    def __init__(self, tokens, begins, sizes, mask=None):
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        self.begins = np.ascontiguousarray(begins, dtype=np.int64).reshape(-1)
        self.sizes = np.ascontiguousarray(sizes, dtype=np.int64).reshape(-1)
        self.mask = None if mask is None else np.ascontiguousarray(mask, dtype=np.int8).reshape(-1)
        if self.mask is not None and len(self.mask) != len(self.tokens):
            raise ValueError(f"mask has {len(self.mask)} entries for {len(self.tokens)} tokens")
        extra = () if self.mask is None else (self.mask,)
        self.hash = _hash(self.tokens, self.begins, self.sizes, *extra)

    def __len__(self) -> int:
        return len(self.begins)


def _hash(*arrays: np.ndarray) -> int:
    """Stable 64-bit hash (little-endian bytes, lengths included) to detect changed data."""
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        a = np.asarray(a)
        h.update(len(a).to_bytes(8, "little"))
        h.update(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    return int.from_bytes(h.digest(), "little")


def process_escapes(s: str) -> str:
    """common.cpp process_escapes: \\n \\r \\t \\' \\" \\\\ and \\xNN (a byte); others stay as is."""
    out, i, raw = bytearray(), 0, s.encode("utf-8")
    while i < len(raw):
        if raw[i] == 0x5C and i + 1 < len(raw):     # a backslash with something after it
            i += 1
            e = raw[i:i + 1]
            if e in _ESCAPES:
                out += _ESCAPES[e]
            elif e == b"x" and i + 2 < len(raw) and all(c in _HEX for c in raw[i + 1:i + 3]):
                out.append(int(raw[i + 1:i + 3], 16))
                i += 2
            else:                                   # unknown escape: kept verbatim
                out += b"\\" + e
        else:
            out.append(raw[i])
        i += 1
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        raise LlamatuneError(f"--sample-start {s!r}: escapes do not form valid UTF-8") from None


def _max_piece_chars(tokenizer) -> int:
    """Longest token text (train.cpp's max_token_text_size), or a generous default."""
    piece = getattr(tokenizer, "token_to_piece", None)
    if piece is None:
        return _DEFAULT_PIECE_CHARS
    try:
        return max(1, max(len(piece(i)) for i in range(tokenizer.n_vocab)))
    except Exception:  # noqa: BLE001 - any failure just means "no better bound known"
        return _DEFAULT_PIECE_CHARS


def load_samples(text: str, tokenizer, opts: TrainOptions, source: str) -> Samples:
    """Tokenize the training text into samples (train.cpp tokenize_file)."""
    check_text(text, source)
    encode = lambda s: tokenizer.encode(s, add_special=False)  # noqa: E731
    pattern = process_escapes(opts.sample_start) if opts.escape else opts.sample_start
    ctx = opts.ctx
    if not pattern:
        # One tokenization; a sample starts at every token position that leaves a full context.
        tokens = np.asarray(encode(text), dtype=np.int32)
        n = len(tokens)
        if n == 0:
            raise LlamatuneError(f"{source}: the training data yields no tokens")
        count = max(1, n - ctx)
        sizes = np.full(count, ctx, dtype=np.int64)
        sizes[0] = min(ctx, n)
        samples = Samples(tokens, np.arange(count), sizes)
    else:
        starts, i = [], text.find(pattern)
        while i >= 0:                                   # non-overlapping occurrences, like find()
            starts.append(i)
            i = text.find(pattern, i + len(pattern))
        skip = 0 if opts.include_sample_start else len(pattern)
        if not starts:
            notice(_esc(f"{source}: sample start {pattern!r} not found; using the whole text as one sample"))
            starts, skip = [0], 0
        max_chars = ctx * _max_piece_chars(tokenizer) if opts.overlapping_samples else 0
        pieces, begins, sizes, empty, at = [], [], [], 0, 0
        for k, s in enumerate(starts):
            b = s + skip
            if opts.overlapping_samples:
                e = min(len(text), b + max_chars)
            else:
                e = starts[k + 1] if k + 1 < len(starts) else len(text)
            ids = encode(text[b:e]) if e > b else []
            if not ids:
                empty += 1
                continue
            pieces.append(np.asarray(ids, dtype=np.int32))
            begins.append(at)
            sizes.append(len(ids))
            at += len(ids)
        if empty:
            notice(_esc(f"{source}: dropped {empty} empty sample(s)"))
        if not pieces:
            raise LlamatuneError(f"{source}: no sample yields any tokens")
        samples = Samples(np.concatenate(pieces), begins, sizes)
    check_token_count(len(samples.tokens), 2 if pattern else ctx, source)
    return samples


def check_text(text: str, source: str) -> None:
    """Training text must hold something to learn: not empty, not only whitespace."""
    if not text:
        raise LlamatuneError(f"{source}: the training data is empty")
    if not text.strip():
        raise LlamatuneError(f"{source}: the training data is only whitespace ({len(text)} characters)")


def check_token_count(n_tokens: int, need: int, source: str) -> None:
    """At least one sample: `need` is --ctx when samples are windows of the text (a
    shorter text would train on padding), 2 when samples start at --sample-start (they
    may be short: they are padded or filled)."""
    if n_tokens < need:
        raise LlamatuneError(f"{source}: the training data has {n_tokens} tokens, fewer than one sample of "
                             f"{need} tokens: use more text" + (" or a smaller --ctx" if need > 2 else ""))


def describe(samples: Samples) -> str:
    """One line for the CLI: token and sample counts, sample length statistics."""
    s = samples.sizes
    return (f"{len(samples.tokens)} tokens, {len(samples)} samples, sample length "
            f"min {int(s.min())} / mean {float(s.mean()):.1f} / max {int(s.max())} tokens")


@dataclass
class Batch:
    inputs: np.ndarray    # int64 (B, T): BOS, then the targets shifted right (EOS at padding)
    targets: np.ndarray   # int64 (B, T): next token; -1 where nothing is to be learned
    n_targets: int        # number of targets >= 0
    epoch_done: bool      # the shuffled order ran out (an epoch ended) while filling this batch
    positions: np.ndarray | None = None   # int64 (B, T): rope position, restarting at 0 per packed sample
    segments: np.ndarray | None = None    # int32 (B, T): sample id within the row; padding has its own
    sample_ids: np.ndarray | None = None  # int64 (B,): the sample in each row, -1 for none (preference pairs)


class Batcher:
    """Deterministic, resumable batches over shuffled samples (train.cpp's batch loop)."""

    def __init__(self, samples: Samples, opts: TrainOptions, n_vocab: int, bos_id: int, eos_id: int):
        self.opts, self.n_vocab, self.bos, self.eos = opts, int(n_vocab), int(bos_id), int(eos_id)
        self._set_samples(samples)
        self.epoch = 0          # completed passes over the shuffled order
        self.next_sample = 0    # position in the current shuffled order
        self.sample_count = 0   # samples consumed in total
        self.token_count = 0    # target positions consumed in total
        self._crossed = False
        self._rng = np.random.default_rng(opts.seed)
        self._shuffle()

    def _set_samples(self, samples: Samples) -> None:
        if len(samples) == 0 or samples.sizes.min() < 1:
            raise LlamatuneError("training data: every sample needs at least one token")
        if samples.mask is not None and samples.sizes.min() < 2:
            raise LlamatuneError("training data: every conversation or row needs at least two tokens")
        self.samples = samples

    def _shuffle(self) -> None:
        """A new order (and random offsets), drawn from the Generator (train.cpp shuffle_samples)."""
        self._shuffle_state = self._rng.bit_generator.state   # the state this order is drawn from
        self.order = self._rng.permutation(len(self.samples))
        if self.opts.sample_random_offsets:
            self.offsets = self._rng.integers(0, self.samples.sizes[self.order])
        else:
            self.offsets = np.zeros(len(self.order), dtype=np.int64)

    def _take(self) -> tuple[int, int]:
        """The next sample in shuffled order and its start offset; reshuffles at an epoch's end."""
        j = self.next_sample
        idx, off = int(self.order[j]), int(self.offsets[j])
        self.next_sample += 1
        self.sample_count += 1
        if self.next_sample == len(self.order):
            self.epoch += 1
            self.next_sample = 0
            self._crossed = True
            self._shuffle()
        return idx, off

    def exhausted(self) -> bool:
        """No more samples to take: never for training, which goes on to the next epoch."""
        return False

    def _chunk(self, idx: int, off: int, room: int) -> np.ndarray:
        b, n = int(self.samples.begins[idx]), int(self.samples.sizes[idx])
        return self.samples.tokens[b + off:b + min(n, off + room)]

    def _row(self, T: int) -> np.ndarray:
        """Targets of one row; shorter than T when the rest is padding."""
        o = self.opts
        seps = [self.eos] * o.separate_with_eos + [self.bos] * o.separate_with_bos
        parts, filled = [], 0
        idx, off = self._take()
        while True:
            chunk = self._chunk(idx, off, T - filled)
            parts.append(np.clip(chunk, 0, self.n_vocab - 1))
            filled += len(chunk)
            if filled == T:
                break
            if not o.fill_with_next_samples:
                if o.separate_with_eos:        # teach the model to end the sample
                    parts.append(np.array([self.eos]))
                break
            sep = seps[:T - filled]            # separators are real targets
            parts.append(np.array(sep, dtype=np.int64))
            filled += len(sep)
            if filled == T:
                break
            idx, off = self._take()[0], 0      # train.cpp: following samples start at offset 0
        return np.concatenate(parts).astype(np.int64)

    def _sequence_row(self, k: int, inputs, targets, positions, segments) -> None:
        """Row k from whole sequences (samples with a mask): one sample, or with --pack as many
        as fit in order; a sample of n tokens fills n - 1 positions (inputs tokens[:-1],
        targets tokens[1:] where masked in). The rest is padding (input EOS, no target)."""
        T, pack, s = inputs.shape[1], positions is not None, self.samples
        filled, seg = 0, 0
        while filled < T and not self.exhausted():
            j = int(self.order[self.next_sample])          # peek: a sample that does not fit waits
            n = int(s.sizes[j]) - 1
            if filled and n > T - filled:
                break
            idx, _ = self._take()
            b, L = int(s.begins[idx]), min(n, T - filled)
            tok = np.clip(s.tokens[b:b + L + 1], 0, self.n_vocab - 1)
            inputs[k, filled:filled + L] = tok[:L]
            targets[k, filled:filled + L] = np.where(s.mask[b + 1:b + L + 1] > 0, tok[1:], -1)
            if pack:
                positions[k, filled:filled + L] = np.arange(L)
                segments[k, filled:filled + L] = seg
            filled, seg = filled + L, seg + 1
            if not pack:
                break
        if pack and filled < T:
            positions[k, filled:] = np.arange(T - filled)
            segments[k, filled:] = seg

    def next_batch(self) -> Batch:
        B, T = self.opts.batch, self.opts.ctx
        if self.samples.mask is not None:
            return self._sequence_batch(B, T)
        targets = np.full((B, T), -1, dtype=np.int64)
        self._crossed = False
        for k in range(B):
            if self.exhausted():
                break
            row = self._row(T)
            targets[k, :len(row)] = row
        inputs = np.empty((B, T), dtype=np.int64)
        inputs[:, 0] = self.bos
        inputs[:, 1:] = np.where(targets[:, :-1] >= 0, targets[:, :-1], self.eos)
        n_targets = int((targets >= 0).sum())
        self.token_count += n_targets
        return Batch(inputs, targets, n_targets, self._crossed)

    def _sequence_batch(self, B: int, T: int) -> Batch:
        inputs = np.full((B, T), self.eos, dtype=np.int64)
        targets = np.full((B, T), -1, dtype=np.int64)
        pack = getattr(self.opts, "pack", False)
        positions = np.zeros((B, T), np.int64) if pack else None
        segments = np.zeros((B, T), np.int32) if pack else None
        self._crossed = False
        for k in range(B):
            self._sequence_row(k, inputs, targets, positions, segments)
        n_targets = int((targets >= 0).sum())
        self.token_count += n_targets
        return Batch(inputs, targets, n_targets, self._crossed, positions, segments)

    # ---- resume
    def _order_hash(self) -> int:
        return _hash(self.order.astype(np.int64), self.offsets.astype(np.int64))

    def state(self) -> dict[str, Any]:
        """JSON-serializable state to continue exactly. The current order is stored as the
        Generator state it was drawn from plus a hash (compact for any number of samples)."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "next_sample": self.next_sample,
                "sample_count": self.sample_count, "token_count": self.token_count,
                "n_samples": len(self.samples), "samples_hash": self.samples.hash,
                "shuffle_rng_state": self._shuffle_state, "rng_state": self._rng.bit_generator.state,
                "order_hash": self._order_hash()}

    def load_state(self, state: dict[str, Any], samples: Samples, force_reshuffle: bool = False) -> None:
        """Continue from `state()`; with changed data or force_reshuffle, keep the counters and
        start a fresh shuffle from the restored Generator."""
        try:
            if state["version"] != STATE_VERSION:
                raise LlamatuneError(f"training state: version {state['version']} is not supported")
            counters = [int(state[k]) for k in ("epoch", "next_sample", "sample_count", "token_count")]
            self._set_samples(samples)
            self.epoch, self.next_sample, self.sample_count, self.token_count = counters
            changed = int(state["samples_hash"]) != samples.hash
            if not (changed or force_reshuffle):
                self._rng.bit_generator.state = state["shuffle_rng_state"]
                self._shuffle()              # regenerates the saved order and offsets
                if (self._order_hash() == int(state["order_hash"])
                        and self._rng.bit_generator.state == state["rng_state"]
                        and 0 <= self.next_sample < len(self.order)):
                    return
                notice("training state: the saved sample order could not be reproduced; reshuffling")
            elif changed:
                notice(f"training data changed since the checkpoint ({state['n_samples']} -> {len(samples)} "
                       f"samples): reshuffling, epoch {self.epoch} restarts its pass over the data")
            else:
                notice(f"forced reshuffle: epoch {self.epoch} restarts its pass over the data")
            self._rng.bit_generator.state = state["rng_state"]
        except (KeyError, TypeError, ValueError) as e:
            raise LlamatuneError(f"training state: missing or invalid field ({e})") from None
        self.next_sample = 0
        self._shuffle()


def read_text(path, what: str = "text") -> str:
    """A file's exact text (nothing stripped), or one clear error naming the file."""
    from pathlib import Path
    path = Path(path)
    if not path.exists():
        raise LlamatuneError(f"{path}: {what} file not found")
    if path.is_dir():
        raise LlamatuneError(f"{path}: is a directory, expected a text file")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise LlamatuneError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
