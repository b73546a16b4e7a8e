"""Seed files and mutators of the fuzz suite (checks/fuzz.py drives them).

Seeds: a tiny F32 llama, the same in Q8_0, a Q4_K llama, a LoRA adapter, a resumable
finetune checkpoint, the adapter as a PEFT directory and as a 2023 ggla .bin, all
written with the project's own writers. `mutate` changes a GGUF file where its
structure is (header, metadata, tensor infos, data: `Layout` finds the regions in the
seed); `mutate_bytes` changes the other formats. Both take a seeded generator, so a
case number always gives the same mutant.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

# the run that wrote the seed checkpoint (its frozen options must match on resume)
CKPT_OPTIONS = dict(lora_r=2, lora_alpha=4.0, rank_att_norm=1, ctx=16, batch=1)
CKPT_FLAGS = ["--lora-r", "2", "--lora-alpha", "4", "--rank-att-norm", "1", "--ctx", "16", "--batch", "1"]
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n") * 8


# --------------------------------------------------------------------------- seed files

def make_corpus(out: Path) -> dict[str, Path]:
    """Write the seed files into `out` (the project's own writer) and return them by name."""
    from gguf import GGMLQuantizationType as QType
    from llamatune.train import checkpoint as ckpt
    from llamatune.formats.adapter import LoraAdapter, write_adapter
    from llamatune.models.config import ModelConfig
    from llamatune.train.lora import lora_specs, lora_targets
    from llamatune.models.writer import random_weights, train_spm_vocab, write_model
    from llamatune.options import FinetuneOptions
    from llamatune.train.params import ParamBuffer

    out.mkdir(parents=True, exist_ok=True)
    vocab = train_spm_vocab(TEXT, 300)
    small = ModelConfig("llama", 300, 64, 64, 2, 96, 4, 2, 16, 16, 1e-5)
    wide = ModelConfig("llama", 300, 64, 256, 1, 256, 4, 2, 64, 64, 1e-5)
    files = {name: out / f"{name}.gguf" for name in ("model-f32", "model-q8", "model-q4k", "adapter", "checkpoint")}
    write_model(files["model-f32"], small, random_weights(small, seed=0, std=0.08), vocab, QType.F32)
    write_model(files["model-q8"], small, random_weights(small, seed=0, std=0.08), vocab, QType.Q8_0)
    write_model(files["model-q4k"], wide, random_weights(wide, seed=1, std=0.08), vocab, QType.Q4_K)
    rng = np.random.default_rng(0)
    opts = FinetuneOptions(**CKPT_OPTIONS)
    targets = lora_targets(small, opts.ranks(), 4.0, tied=False)
    adapter = LoraAdapter("llama", 4.0)
    for t in targets:
        adapter.pairs[t.weight] = (rng.standard_normal(t.a_shape).astype(np.float32) * 0.1,
                                   rng.standard_normal(t.b_shape).astype(np.float32) * 0.1)
    write_adapter(files["adapter"], adapter)
    params = ParamBuffer(lora_specs(targets))
    params.data[...] = rng.standard_normal(params.size).astype(np.float32) * 0.1
    params.m[...] = rng.standard_normal(params.size).astype(np.float32) * 0.01
    params.v[...] = rng.random(params.size).astype(np.float32) * 0.01
    from llamatune.formats.gguf_io import kv
    model_kvs = [kv(f"training.lora.rank.{k}", r) for k, r in opts.ranks().items()] + [kv("training.lora.alpha", 4.0)]
    model_kvs += [kv(k, v) for k, v in small.metadata().items()]
    ckpt.save(files["checkpoint"], ckpt.KIND_LORA, "llama", opts, params, ckpt.TrainState(3, 24, 768, 0, 5.0),
              model_kvs)
    from llamatune.commands.convert import convert
    files["peft"] = out / "peft"
    convert(files["adapter"], files["peft"], "peft", files["model-f32"])
    files["ggla"] = out / "adapter.bin"
    write_ggla(files["ggla"], adapter)
    (out / "text.txt").write_text(TEXT)
    (out / "corpus.json").write_text(json.dumps({k: str(v) for k, v in files.items()}))
    return files


def write_ggla(path: Path, adapter) -> None:
    """llama.cpp's 2023 ggla LoRA .bin (FORMATS.md): header, then 32-byte aligned F32 records,
    A in the 2023 layout (n_in, r), B (n_out, r); r is the adapter's first rank."""
    r = next(iter(adapter.pairs.values()))[1].shape[-1]
    buf = bytearray(struct.pack("<4I", 0x67676C61, 1, r, int(adapter.alpha)))
    for weight, (a, b) in adapter.pairs.items():
        for suffix, arr in ((".loraA", a.T), (".loraB", b)):
            name = (weight + suffix).encode()
            ne = list(reversed(arr.shape))
            buf += struct.pack(f"<3I{len(ne)}I", len(ne), len(name), 0, *ne) + name
            buf += b"\0" * (-len(buf) & 31)
            buf += np.ascontiguousarray(arr, np.float32).tobytes()
    path.write_bytes(bytes(buf))


def mutate_bytes(seed_bytes: bytes, rng: np.random.Generator) -> tuple[bytes, list[str]]:
    """Mutations of a file that is not GGUF: truncation, bit flips (mostly in its first 512 bytes,
    where headers are), huge or zero integers, and for a safetensors header edits of its JSON."""
    data = bytearray(seed_bytes)
    done = []
    for _ in range(pick(rng, [1, 1, 2])):
        kind = str(rng.choice(["truncate", "flip", "int", "json"]))
        done.append(kind)
        head = min(len(data), 512)
        if kind == "truncate":
            data = data[:int(rng.integers(0, len(data) + 1))]
        elif kind == "flip" and data:
            for _ in range(int(rng.integers(1, 9))):
                pos = int(rng.integers(0, head if rng.random() < 0.8 else len(data)))
                data[pos] ^= 1 << int(rng.integers(8))
        elif kind == "int" and head >= 8:
            pos = int(rng.integers(0, head - 7))
            width = pick(rng, [4, 8])
            data[pos:pos + width] = pick(rng, [0] + HUGE).to_bytes(8, "little")[:width]
        elif kind == "json" and data[8:9] == b"{":
            n = int.from_bytes(data[:8], "little")
            text = bytes(data[8:8 + n]).decode("utf-8", "replace")
            edits = [('"F32"', '"I8"'), ('"F32"', '"BF16"'), ('"F32"', '"F16"'), ("[", "[-1, "),
                     ("[", "[99999999999, "), ('"shape"', '"shapes"'), ("]", ", 1]"),
                     ('"data_offsets":[', '"data_offsets":[7')]
            old, new = edits[int(rng.integers(len(edits)))]
            where = [i for i in range(len(text)) if text.startswith(old, i)]
            if where:
                i = where[int(rng.integers(len(where)))]
                text = text[:i] + new + text[i + len(old):]
                blob = text.encode()
                data = bytearray(len(blob).to_bytes(8, "little") + blob + bytes(data[8 + n:]))
                done[-1] += f":{old}->{new}"
    return bytes(data), done


# --------------------------------------------------------------------------- file layout

class Layout:
    """Byte regions of a GGUF file, read once from the seed file with gguf-py."""

    def __init__(self, path: Path):
        import gguf
        r = gguf.GGUFReader(path)
        self.size = len(r.data)
        self.kvs = []            # (key, start, end, value-type offset, value start)
        for name, f in r.fields.items():
            if name.startswith("GGUF."):
                continue
            start = f.offset
            end = start + sum(int(p.nbytes) for p in f.parts)
            type_off = start + 8 + int(f.parts[0][0])
            self.kvs.append((name, start, end, type_off, type_off + 4))
        self.tinfos = []         # (name, start, end, n_dims offset, type offset, offset offset)
        for t in r.tensors:
            f = t.field
            start = f.offset
            end = start + sum(int(p.nbytes) for p in f.parts)
            n_dims_off = start + 8 + len(t.name.encode())
            self.tinfos.append((t.name, start, end, n_dims_off, end - 12, end - 8))
        self.meta_end = self.tinfos[0][1] if self.tinfos else self.kvs[-1][2]
        self.info_end = self.tinfos[-1][2] if self.tinfos else self.meta_end
        self.data_start = r.data_offset
        self.tensors = [(t.name, int(t.tensor_type), t.data_offset, t.data_offset + t.n_bytes) for t in r.tensors]
        self.alignment = int(r.alignment)


def pick(rng: np.random.Generator, values: list[int]) -> int:
    """One of `values`, exactly (numpy's choice would turn 2^64 - 1 into a float)."""
    return int(values[int(rng.integers(len(values)))])


def _u32(v: int) -> bytes:
    return int(v % 2**32).to_bytes(4, "little")


def _u64(v: int) -> bytes:
    return int(v % 2**64).to_bytes(8, "little")


HUGE = [2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63, 2**64 - 1, 10**12]
F16_BAD = [0x7C00, 0xFC00, 0x7E00]                  # +inf, -inf, nan
F32_BAD = [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F7FFFFF, 0x5F000000]   # inf, -inf, nan, max, 2^63


def insert(data: bytearray, lay: Layout, at: int, blob: bytes) -> bytearray:
    """Insert `blob` at `at` (inside metadata/tensor infos) and re-pad so tensor data stays aligned."""
    head = bytes(data[:at]) + blob + bytes(data[at:lay.info_end])
    pad = -len(head) % lay.alignment
    return bytearray(head + b"\0" * pad + bytes(data[lay.data_start:]))


def add_record(data: bytearray, lay: Layout, kind: str, record: bytes) -> bytearray:
    """Append one metadata record (kind "kv") or tensor info ("tensor") and count it in the header."""
    lo, at = (16, lay.meta_end) if kind == "kv" else (8, lay.info_end)
    data = bytearray(data)
    data[lo:lo + 8] = _u64(int.from_bytes(data[lo:lo + 8], "little") + 1)
    return insert(data, lay, at, record)


def mutate(seed_bytes: bytes, lay: Layout, rng: np.random.Generator) -> tuple[bytes, list[str]]:
    """One to three mutations of a GGUF file (see module docstring); returns (bytes, what was done)."""
    data = bytearray(seed_bytes)
    done = []
    for _ in range(pick(rng, [1, 1, 1, 2, 3])):
        kind = str(rng.choice(["truncate", "flip", "flip", "huge", "tensor_type", "value_type", "offset",
                               "duplicate", "value", "value", "poison", "poison", "dims"]))
        done.append(kind)
        if kind == "truncate":
            cut = pick(rng, [rng.integers(0, 64), rng.integers(0, lay.info_end + 1),
                                  rng.integers(lay.data_start, lay.size + 1), lay.size - rng.integers(1, 64)])
            data = data[:max(0, min(cut, len(data)))]
        elif kind == "flip":
            region = str(rng.choice(["header", "metadata", "infos", "data"]))
            lo, hi = {"header": (0, 24), "metadata": (24, lay.meta_end), "infos": (lay.meta_end, lay.info_end),
                      "data": (lay.data_start, lay.size)}[region]
            done[-1] += f":{region}"
            for _ in range(int(rng.integers(1, 9))):
                if hi > lo and hi <= len(data):
                    pos = int(rng.integers(lo, hi))
                    data[pos] ^= 1 << int(rng.integers(8))
        elif kind == "huge":
            where = str(rng.choice(["tensor_count", "kv_count", "key_len", "str_len", "array_len", "name_len"]))
            done[-1] += f":{where}"
            v = pick(rng, HUGE + [int(rng.integers(1, 1000))])
            if where == "tensor_count":
                data[8:16] = _u64(v)
            elif where == "kv_count":
                data[16:24] = _u64(v)
            elif where == "key_len":
                _, start, _, _, _ = lay.kvs[int(rng.integers(len(lay.kvs)))]
                data[start:start + 8] = _u64(v)
            elif where in ("str_len", "array_len"):
                vt = 8 if where == "str_len" else 9
                cands = [k for k in lay.kvs if int.from_bytes(seed_bytes[k[3]:k[3] + 4], "little") == vt]
                if cands:
                    _, _, _, _, vstart = cands[int(rng.integers(len(cands)))]
                    off = vstart if vt == 8 else vstart + 4
                    data[off:off + 8] = _u64(v)
            elif lay.tinfos:
                start = lay.tinfos[int(rng.integers(len(lay.tinfos)))][1]
                data[start:start + 8] = _u64(v)
        elif kind == "tensor_type" and lay.tinfos:
            _, _, _, _, type_off, _ = lay.tinfos[int(rng.integers(len(lay.tinfos)))]
            data[type_off:type_off + 4] = _u32(pick(rng, [0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 20,
                                                              24, 25, 26, 27, 28, 29, 30, 31, 39, 40, 1000]))
        elif kind == "value_type":
            _, _, _, type_off, _ = lay.kvs[int(rng.integers(len(lay.kvs)))]
            data[type_off:type_off + 4] = _u32(int(rng.integers(0, 16)))
        elif kind == "offset" and lay.tinfos:
            _, _, _, _, _, off_off = lay.tinfos[int(rng.integers(len(lay.tinfos)))]
            old = int.from_bytes(seed_bytes[off_off:off_off + 8], "little")
            how = str(rng.choice(["past_end", "misaligned", "overlap", "huge"]))
            done[-1] += f":{how}"
            new = {"past_end": lay.size - lay.data_start + int(rng.integers(0, 4096)),
                   "misaligned": old + int(rng.integers(1, lay.alignment)),
                   "overlap": int(rng.integers(0, max(1, lay.size - lay.data_start))) // lay.alignment * lay.alignment,
                   "huge": pick(rng, HUGE)}[how]
            data[off_off:off_off + 8] = _u64(new)
        elif kind == "duplicate" and len(data) >= lay.data_start:
            if rng.random() < 0.5 or not lay.tinfos:
                _, start, end, _, _ = lay.kvs[int(rng.integers(len(lay.kvs)))]
                data = add_record(data, lay, "kv", bytes(seed_bytes[start:end]))
                done[-1] += ":key"
            else:
                _, start, end, _, _, _ = lay.tinfos[int(rng.integers(len(lay.tinfos)))]
                data = add_record(data, lay, "tensor", bytes(seed_bytes[start:end]))
                done[-1] += ":tensor"
        elif kind == "value":
            data = _mutate_value(data, seed_bytes, lay, rng, done)
        elif kind == "poison" and lay.tensors:
            name, qtype, lo, hi = lay.tensors[int(rng.integers(len(lay.tensors)))]
            lo, hi = lay.data_start + lo, min(lay.data_start + hi, len(data))
            done[-1] += f":{name}"
            for _ in range(int(rng.integers(1, 4))):
                if qtype == 0 and hi - lo >= 4:                 # F32: inf/nan/huge values
                    pos = lo + int(rng.integers(0, (hi - lo) // 4)) * 4
                    data[pos:pos + 4] = _u32(pick(rng, F32_BAD))
                elif hi - lo >= 2:                              # F16 values or a quant block's f16 scale
                    block = {8: 34, 12: 144, 1: 2}.get(qtype, 2)
                    pos = lo + int(rng.integers(0, (hi - lo) // block)) * block
                    data[pos:pos + 2] = pick(rng, F16_BAD).to_bytes(2, "little")
        elif kind == "dims" and lay.tinfos:
            _, _, _, n_dims_off, _, _ = lay.tinfos[int(rng.integers(len(lay.tinfos)))]
            if rng.random() < 0.3:
                data[n_dims_off:n_dims_off + 4] = _u32(pick(rng, [0, 3, 5, 64, 2**31, 2**32 - 1]))
                done[-1] += ":n_dims"
            else:
                d = n_dims_off + 4 + 8 * int(rng.integers(0, 2))
                data[d:d + 8] = _u64(pick(rng, [0, 1, 2, 31, 33, 4096] + HUGE))
                done[-1] += ":dim"
    return bytes(data), done


# metadata values a reader must check: (value type id, encoded value, label)
BAD_VALUES = [(8, _u64(3) + b"abc", "string"), (5, _u32(-5), "int32 -5"), (10, _u64(2**63), "uint64 2^63"),
              (4, _u32(0), "uint32 0"), (6, np.float32(np.nan).tobytes(), "f32 nan"),
              (6, np.float32(np.inf).tobytes(), "f32 inf"), (6, np.float32(-1.5).tobytes(), "f32 -1.5"),
              (7, b"\1", "bool"), (9, _u32(4) + _u64(2) + _u32(1) + _u32(2), "array of 2"),
              (4, _u32(2**31 - 1), "uint32 2^31-1"), (4, _u32(3), "uint32 3"), (4, _u32(7), "uint32 7"),
              (11, _u64(2**40), "int64 2^40"), (12, np.float64(1e300).tobytes(), "f64 1e300"),
              (8, _u64(0), "empty string"), (8, _u64(4) + b"\xff\xfe\x00a", "bad utf-8")]


def _mutate_value(data: bytearray, seed_bytes: bytes, lay: Layout, rng, done: list[str]) -> bytearray:
    """Replace one metadata value (type and bytes) by a wrong-typed or out-of-range one, or add
    `general.alignment` with such a value; the file is re-padded so tensor data stays aligned."""
    vtype, blob, label = BAD_VALUES[int(rng.integers(len(BAD_VALUES)))]
    if rng.random() < 0.15:
        key = b"general.alignment"
        done[-1] += f":general.alignment={label}"
        return add_record(data, lay, "kv", _u64(len(key)) + key + _u32(vtype) + blob)
    name, start, end, type_off, vstart = lay.kvs[int(rng.integers(len(lay.kvs)))]
    done[-1] += f":{name}={label}"
    if len(data) < lay.data_start:
        return data
    record = bytes(seed_bytes[start:type_off]) + _u32(vtype) + blob
    head = bytes(data[:start]) + record + bytes(data[end:lay.info_end])
    return bytearray(head + b"\0" * (-len(head) % lay.alignment) + bytes(data[lay.data_start:]))
