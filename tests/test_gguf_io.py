"""The GGUF layer: round trips, atomic writes, and one clear error per kind of bad file."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from llamatune.models.config import ModelConfig
from llamatune.errors import LlamatuneError
from llamatune.formats.gguf_io import GGUFFile, kv, tensor_out, write_gguf
from llamatune.models.model import Model

from conftest import tiny_config, write_tiny_model


def test_roundtrip_tensors_and_metadata(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    h = np.linspace(-1, 1, 64).astype(np.float16).reshape(2, 32)
    q = np.random.default_rng(0).integers(0, 255, size=(2, 34), dtype=np.uint8)  # 2 rows of one Q8_0 block
    path = tmp_path / "t.gguf"
    write_gguf(path, "llama", [kv("x.int", 7), kv("x.str", "hi"), kv("x.list", [1.5, 2.5]), kv("x.flag", True)],
               [tensor_out("a", a), tensor_out("h", h), tensor_out("q", q, QType.Q8_0)])
    f = GGUFFile(path)
    assert f.metadata["general.architecture"] == "llama"
    assert (f.get("x.int"), f.get("x.str"), f.get("x.list"), f.get("x.flag")) == (7, "hi", [1.5, 2.5], True)
    np.testing.assert_array_equal(f.tensor("a").data, a)
    np.testing.assert_array_equal(f.tensor("h").data, h)
    assert f.tensor("q").shape == (2, 32) and f.tensor("q").qtype == QType.Q8_0
    np.testing.assert_array_equal(f.tensor("q").raw_rows(), q)


def test_write_is_atomic(tmp_path):
    path = tmp_path / "out.gguf"
    path.write_bytes(b"previous")

    def boom():
        raise RuntimeError("producer failed")
    from llamatune.formats.gguf_io import TensorOut
    with pytest.raises(RuntimeError, match="producer failed"):
        write_gguf(path, "llama", [], [TensorOut("x", (4,), QType.F32, boom)])
    assert path.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["out.gguf"]   # no temporary left behind


def test_missing_file(tmp_path):
    with pytest.raises(LlamatuneError, match=r"nope\.gguf: file not found"):
        GGUFFile(tmp_path / "nope.gguf")


def test_directory(tmp_path):
    with pytest.raises(LlamatuneError, match="is a directory"):
        GGUFFile(tmp_path)


def test_empty_file(tmp_path):
    (tmp_path / "e.gguf").write_bytes(b"")
    with pytest.raises(LlamatuneError, match=r"e\.gguf: file is empty"):
        GGUFFile(tmp_path / "e.gguf")


def test_not_gguf(tmp_path):
    (tmp_path / "x.gguf").write_text("hello world, not a model")
    with pytest.raises(LlamatuneError, match=r"x\.gguf: not a GGUF file"):
        GGUFFile(tmp_path / "x.gguf")


def test_truncated_header(tmp_path, tiny_model):
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny_model.read_bytes()[:200])
    with pytest.raises(LlamatuneError, match=r"cut\.gguf: corrupt or truncated GGUF header"):
        GGUFFile(p)


def test_tensor_data_past_end(tmp_path, tiny_model):
    data = tiny_model.read_bytes()
    p = tmp_path / "short.gguf"
    p.write_bytes(data[: len(data) - 1000])
    with pytest.raises(LlamatuneError, match=r"short\.gguf: tensor '.*' data ends at byte \d+ but the file has only"):
        GGUFFile(p)


def test_unknown_tensor_type(tmp_path):
    path = tmp_path / "u.gguf"
    write_gguf(path, "llama", [], [tensor_out("weird", np.zeros((2, 32), np.float32))])
    raw = bytearray(path.read_bytes())
    # tensor info: name len (u64) + "weird" + n_dims (u32) + 2 dims (u64) + type (u32)
    at = raw.index(b"weird") + 5 + 4 + 16
    assert raw[at:at + 4] == (0).to_bytes(4, "little")          # F32
    raw[at:at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(LlamatuneError, match=r"u\.gguf: tensor 'weird' has unknown ggml type id 250"):
        GGUFFile(path)


def test_missing_required_metadata(tmp_path, tiny_model):
    f = GGUFFile(tiny_model)
    kvs = [item for k, item in f.kvs.items() if k != "llama.embedding_length"]
    path = tmp_path / "nometa.gguf"             # the model's tensors: a file without any is a vocabulary
    write_gguf(path, "llama", kvs, [tensor_out(n, np.array(t.data)) for n, t in f.tensors.items()])
    with pytest.raises(LlamatuneError, match=r"nometa\.gguf: missing required metadata key 'llama.embedding_length'"):
        Model(path)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    write_gguf(path, "falcon", [], [tensor_out("token_embd.weight", np.zeros((4, 8), np.float32))])
    with pytest.raises(LlamatuneError, match=r"falcon\.gguf: architecture 'falcon' is not supported"):
        Model(path)


def test_wrong_tensor_shape(tmp_path, tiny_model):
    f = GGUFFile(tiny_model)
    tensors = []
    for name, t in f.tensors.items():
        data = np.array(t.data)
        if name == "blk.1.attn_k.weight":
            data = np.zeros((16, 64), np.float32)
        tensors.append(tensor_out(name, data))
    path = tmp_path / "shape.gguf"
    write_gguf(path, "llama", f.kvs.values(), tensors)
    with pytest.raises(LlamatuneError, match=r"shape\.gguf: tensor 'blk.1.attn_k.weight' has shape \(16, 64\), expected \(32, 64\)"):
        Model(path)


def test_missing_tensor(tmp_path, tiny_model):
    f = GGUFFile(tiny_model)
    path = tmp_path / "missing.gguf"
    write_gguf(path, "llama", f.kvs.values(),
               [tensor_out(n, np.array(t.data)) for n, t in f.tensors.items() if n != "blk.0.ffn_up.weight"])
    with pytest.raises(LlamatuneError, match=r"missing\.gguf: missing tensor 'blk.0.ffn_up.weight'"):
        Model(path)


@pytest.mark.parametrize("field,value,match", [
    ("n_head_kv", 3, "not a multiple of head_count_kv"),
    ("n_rot", 17, "must be even"),
    ("n_embd", 0, "n_embd = 0 must be positive"),
    ("norm_eps", 0.0, "must be positive"),
])
def test_config_validation(field, value, match):
    with pytest.raises(LlamatuneError, match=match):
        tiny_config(**{field: value})


def test_config_from_model(tiny_model):
    m = Model(tiny_model)
    assert m.config == tiny_config()
    assert ModelConfig.from_metadata(m.file.metadata) == m.config
