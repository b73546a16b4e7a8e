"""The training data a LoRA adapter records, and that data rendered again as the run
rendered it (export-lora's default calibration).

finetune writes into the adapter (GGUF KVs llama.cpp does not read and ignores):

  llamatune.data.path    str  the --train-data file, absolute
  llamatune.data.size    u64  its size in bytes
  llamatune.data.sha256  str  the sha256 of its bytes
  llamatune.data.render  str  JSON of the options that shape the rendered tokens
                              (RENDER_OPTIONS); with a --chat-template file also
                              chat_template_sha256, its text's sha256

`recorded_data` reads them back, `check` says what no longer matches (a file moved,
deleted or edited), and `calibration_windows` renders a sample of the file through the
training pipeline (datasets.py / data.py: the same template, masks aside, the same
preference rows) into windows (export-lora: of --calibration-ctx tokens).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValueType as VType

from ..errors import LlamatuneError
from ..formats.gguf_io import KV, GGUFFile, kv
from .datasets import RowEncoder, RowError, detect_format, read_rows
from .samples import load_samples, read_text

KEY = "llamatune.data."
# every option the renderer (datasets.RowEncoder, data.load_samples, the batcher's rows) reads
RENDER_OPTIONS = ("method", "data_format", "chat_template", "train_on_prompt", "skip_bad_rows", "drop_long", "pack",
                  "ctx", "sample_start", "include_sample_start", "escape", "overlapping_samples",
                  "fill_with_next_samples", "separate_with_eos", "separate_with_bos")
PAIR_METHODS = ("dpo", "orpo")      # rows of chosen/rejected pairs; sft: datasets.load_dataset's rows or text


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def data_kvs(o) -> list[KV]:
    """The adapter KVs that record the training data of options `o` (module docstring)."""
    path = Path(o.train_data).resolve()
    render = {name: getattr(o, name) for name in RENDER_OPTIONS if hasattr(o, name)}
    template = Path(o.chat_template) if getattr(o, "chat_template", "") else None
    if template is not None and template.is_file():
        render["chat_template"] = str(template.resolve())
        render["chat_template_sha256"] = sha256_of(template)
    return [kv(KEY + "path", str(path)), kv(KEY + "size", path.stat().st_size, VType.UINT64),
            kv(KEY + "sha256", sha256_of(path)), kv(KEY + "render", json.dumps(render, sort_keys=True))]


@dataclass
class RecordedData:
    """What an adapter records of its training data."""
    path: Path
    size: int
    sha256: str
    render: dict


def recorded_data(f: GGUFFile) -> RecordedData | None:
    """The record of adapter file `f`, None when it has none (older adapters, converted ones)."""
    if KEY + "sha256" not in f.kvs:
        return None
    try:
        render = json.loads(f.get_str(KEY + "render", "{}"))
        return RecordedData(Path(f.get_str(KEY + "path", required=True)), f.get_int(KEY + "size", -1),
                            f.get_str(KEY + "sha256", required=True), render if isinstance(render, dict) else {})
    except (ValueError, json.JSONDecodeError) as e:
        raise LlamatuneError(f"{f.path}: invalid training-data record ({e})") from None


def check(record: RecordedData) -> str | None:
    """None when the recorded file (and --chat-template file) is there unchanged, else what is wrong."""
    path = record.path
    if not path.is_file():
        return f"the training data {path} is gone (moved or deleted)"
    if path.stat().st_size != record.size or sha256_of(path) != record.sha256:
        return (f"the training data {path} was edited since training ({path.stat().st_size} bytes, "
                f"{record.size} when trained; its sha256 differs)")
    template = record.render.get("chat_template_sha256")
    if template is not None:
        t = Path(record.render.get("chat_template", ""))
        if not t.is_file() or sha256_of(t) != template:
            return f"the chat template {t} is gone or was edited since training"
    method = record.render.get("method", "sft")
    if method not in ("sft",) + PAIR_METHODS:
        # GRPO and other methods that sample their completions: render their prompts (with
        # the template's generation prompt) here once they exist; until then, the imatrix.
        return f"--method {method}: no renderer for its training data"
    return None


def render_options(record: RecordedData):
    """The finetune options the recorded run rendered its data with (others at their defaults)."""
    from ..options import FinetuneOptions
    known = {f.name for f in dataclasses.fields(FinetuneOptions)}
    return dataclasses.replace(FinetuneOptions(), **{k: v for k, v in record.render.items() if k in known})


def calibration_windows(record: RecordedData, tokenizer, n_tokens: int, width: int | None = None) -> np.ndarray:
    """About n_tokens tokens of the recorded data (at least one window), rendered as the
    run rendered them, as windows (n, width) (default: the training --ctx). Raw text: its
    first tokens, each window starting with BOS as the batcher's rows do; rows
    (conversations, completions, preference pairs with both answers): rows drawn in a
    seeded random order, each rendered and cut at --ctx + 1 as in training, following
    one another."""
    o = render_options(record)
    source = str(record.path)
    text = read_text(record.path, "training data")
    is_text = o.method not in PAIR_METHODS and detect_format(text, o.data_format, record.path) == "text"
    stream = (_text_stream if is_text else _rows_stream)(text, tokenizer, o, source, n_tokens)
    width = min(width or o.ctx, len(stream))
    n = max(1, min(n_tokens // width, len(stream) // width))
    windows = stream[: n * width].astype(np.int64).reshape(n, width).copy()
    if is_text and not o.sample_start and tokenizer.bos_id is not None:
        windows[:, 0] = tokenizer.bos_id
    return windows


def _text_stream(text: str, tokenizer, o, source: str, n_tokens: int) -> np.ndarray:
    """The first tokens of raw training text, by data.load_samples on a prefix grown until
    it gives enough (a sample start pattern: its samples one after another)."""
    length = 8 * n_tokens + 4096
    while True:
        samples = load_samples(text[:length], tokenizer, o, source)
        if length >= len(text) or len(samples.tokens) >= n_tokens + 256:
            break
        length *= 2
    if not o.sample_start:
        return samples.tokens
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return np.concatenate([np.concatenate([bos, samples.tokens[b:b + s]])
                           for b, s in zip(samples.begins, samples.sizes)]).astype(np.int32)


def _rows_stream(text: str, tokenizer, o, source: str, n_tokens: int) -> np.ndarray:
    """Rows in a seeded random order, each encoded by the training RowEncoder and cut at
    --ctx + 1 tokens, until n_tokens are reached; bad rows are skipped."""
    rows = read_rows(text, source)
    enc = RowEncoder(tokenizer, o, source)
    pieces, total = [], 0
    for i in np.random.default_rng(0).permutation(len(rows)):
        try:
            encoded = enc.encode_pair(rows[i][1]) if o.method in PAIR_METHODS else (enc.encode(rows[i][1]),)
        except RowError:
            continue
        for tokens, _ in encoded:
            pieces.append(np.asarray(tokens[: o.ctx + 1], np.int32))
            total += len(pieces[-1])
        if total >= n_tokens:
            break
    if not pieces:
        raise LlamatuneError(f"{source}: no row of the training data renders (nothing to calibrate on)")
    return np.concatenate(pieces)
