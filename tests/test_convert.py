"""convert-checkpoint: every input kind against hand-built files.

The 2023 checkpoints, ggla files and PEFT directories are written here with
gguf-py / struct / safetensors directly, following /shared/FORMATS.md, so the
converter is checked against the formats and not against itself. LoRA layouts
are checked through their effect (scale·B·A against the 2023 ΔW = b·aᵀ, and
logits against a model with the deltas merged by hand).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as V
from safetensors.numpy import load_file, save_file

from llamatune.train import checkpoint as ckpt
from llamatune.formats.adapter import load_runtime_adapters, read_adapter
from llamatune.commands.convert import convert
from llamatune.formats.llamacpp2023 import ORDER_LABELS, choose_order, param_orders
from llamatune.errors import LlamatuneError
from llamatune.commands.finetune import finetune
from llamatune.formats.gguf_io import GGUFFile, kv
from llamatune.models.infer import Runner
from llamatune.models.arch import tensor_shape
from llamatune.models.model import Model
from llamatune.models.writer import random_weights, tensor_names, vocab_kvs, write_model
from llamatune.options import FinetuneOptions
from llamatune.train.params import ParamBuffer, ParamSpec

from conftest import TEXT, tiny_config, write_tiny_model

KINDS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_down", "ffn_up")
TOKENS = np.array([[1, 17, 250, 33, 8, 399, 41, 5]])


# --------------------------------------------------------------------------- helpers

def gguf_file(path: Path, arch: str, kvs, tensors) -> Path:
    """A GGUF written with gguf-py directly: kvs (key, value, type[, sub_type]), tensors (name, numpy array)."""
    w = gguf.GGUFWriter(str(path), arch)
    for item in kvs:
        w.add_key_value(*item)
    for name, arr in tensors:
        w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tensors_of(path: Path) -> dict[str, np.ndarray]:
    f = GGUFFile(path)
    return {n: np.array(t.data).reshape(t.shape) for n, t in f.tensors.items()}


def weights_of(path: Path) -> dict[str, np.ndarray]:
    return {n: a.astype(np.float32) for n, a in tensors_of(path).items()}


def logits(model_path: Path, adapters=()) -> np.ndarray:
    model = Model(model_path)
    return Runner(model, load_runtime_adapters(model, [(str(p), 1.0) for p in adapters])).forward(TOKENS)


def delta(adapter_path: Path, base: Path) -> dict[str, np.ndarray]:
    """scale·ΔW of every tensor of a GGUF adapter, in the base weight's shape."""
    ad = read_adapter(adapter_path, GGUFFile(base))
    out = {}
    for name, (a, b) in ad.pairs.items():
        d = a @ b.T if name == "token_embd.weight" else b @ a
        out[name] = ad.scale(name) * d
    return out


def hf_to_gguf_rows(n_rows: int, n_head: int) -> np.ndarray:
    """By hand: GGUF row 2i+j of a head is HF row j·hd/2 + i of that head (llama.cpp's q/k permute)."""
    hd = n_rows // n_head
    idx = np.empty(n_rows, np.int64)
    for h in range(n_head):
        for i in range(hd // 2):
            for j in range(2):
                idx[h * hd + 2 * i + j] = h * hd + j * (hd // 2) + i
    return idx


def hand_order(n_layer: int, lora: bool, rtl: bool) -> list[str]:
    """2023 graph parameter order, derived by hand from finetune.cpp / train-text-from-scratch.cpp
    (flash attention on) walking ggml_visit_parents left-to-right or right-to-left."""
    def p(w):
        names = [w + ".lora_a", w + ".lora_b"] if lora else [w]
        return names[::-1] if rtl else names

    def layer(i):
        def W(k):
            return p(f"blk.{i}.{k}.weight")
        prev = layer(i - 1) if i > 0 else p("token_embd.weight")
        if not rtl:
            return (W("ffn_down") + W("ffn_gate") + W("ffn_norm") + W("attn_output") + W("attn_q") + W("attn_norm")
                    + prev + W("attn_k") + W("attn_v") + W("ffn_up"))
        return (prev + W("attn_v") + W("attn_norm") + W("attn_k") + W("attn_q") + W("attn_output") + W("ffn_norm")
                + W("ffn_up") + W("ffn_gate") + W("ffn_down"))
    top = layer(n_layer - 1)
    if rtl:
        return top + p("output_norm.weight") + p("output.weight")
    return p("output.weight") + p("output_norm.weight") + top


def moments_for(order: list[str], tensors: dict[str, np.ndarray], seed: int):
    """Flat Adam moments with a distinct magnitude per tensor (as real gradients have)."""
    rng = np.random.default_rng(seed)
    m, v = [], []
    for n in order:
        size = tensors[n].size
        scale = 10.0 ** rng.uniform(-9, -2)
        vv = (scale * rng.uniform(0.5, 1.5, size)).astype(np.float32)
        v.append(vv)
        m.append((np.sqrt(vv) * rng.uniform(-1, 1, size)).astype(np.float32))
    return np.concatenate(m), np.concatenate(v)


def hparam_kvs(cfg, with_kv_heads=True, scale_linear=1.0):
    kvs = [("general.file_type", 0, V.UINT32),
           ("llama.context_length", cfg.n_ctx_train, V.UINT32), ("llama.embedding_length", cfg.n_embd, V.UINT32),
           ("llama.feed_forward_length", cfg.n_ff, V.UINT32), ("llama.attention.head_count", cfg.n_head, V.UINT32)]
    if with_kv_heads:
        kvs.append(("llama.attention.head_count_kv", cfg.n_head_kv, V.UINT32))
    kvs += [("llama.block_count", cfg.n_layer, V.UINT32), ("llama.rope.dimension_count", cfg.n_rot, V.UINT32),
            ("llama.attention.layer_norm_rms_epsilon", cfg.norm_eps, V.FLOAT32),
            ("llama.rope.freq_base", cfg.rope_freq_base, V.FLOAT32),
            ("llama.rope.scale_linear", scale_linear, V.FLOAT32)]
    return kvs


def state_kvs(iteration, nx, opt_type="adam"):
    kvs = [("training.file_version", 1, V.UINT32), ("training.iteration_count", iteration, V.UINT64),
           ("training.sample_count", 8 * iteration, V.UINT64), ("training.token_count", 64 * iteration, V.UINT64),
           ("training.epoch_count", 0, V.UINT64), ("training.shuffle.samples_hash", 12345, V.UINT64),
           ("training.shuffle.rng_state", "5489 1 2 3", V.STRING), ("training.shuffle.sample_count", 100, V.UINT64),
           ("training.shuffle.next_sample", 8, V.UINT64),
           ("optimizer.file_version", 0, V.UINT32), ("optimizer.convergence_past_count", 0, V.UINT32),
           ("optimizer.parameter_count", nx, V.UINT64), ("optimizer.iteration_count", iteration, V.UINT32),
           ("optimizer.just_initialized", False, V.BOOL), ("optimizer.type", opt_type, V.STRING)]
    if opt_type == "adam":
        kvs += [("optimizer.adam.best_loss", 5.0, V.FLOAT32), ("optimizer.adam.previous_loss", 5.5, V.FLOAT32),
                ("optimizer.adam.no_improvement_count", 0, V.UINT32)]
    return kvs


def legacy_lora_tensors(cfg, ranks: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    """2023 LoRA tensors in numpy order: a (n_in, r), b (n_out, r); norms a (C, r), b stored 1-D (r,)."""
    rng = np.random.default_rng(seed)
    C, V_, F = cfg.n_embd, cfg.n_vocab, cfg.n_ff
    shapes = {"token_embd": (V_, C), "output": (V_, C), "output_norm": (1, C), "attn_norm": (1, C), "ffn_norm": (1, C),
              "attn_q": (cfg.n_embd_q, C), "attn_k": (cfg.n_embd_kv, C), "attn_v": (cfg.n_embd_kv, C),
              "attn_output": (C, cfg.n_embd_q), "ffn_gate": (F, C), "ffn_up": (F, C), "ffn_down": (C, F)}
    names = ["token_embd", "output_norm", "output"] + [f"blk.{i}.{k}" for i in range(cfg.n_layer) for k in KINDS]
    out = {}
    for n in names:
        kind = n.split(".")[-1]
        r = ranks[kind]
        n_out, n_in = shapes[kind]
        out[f"{n}.weight.lora_a"] = rng.normal(0, 0.3, (n_in, r)).astype(np.float32)
        b = rng.normal(0, 0.3, (n_out, r)).astype(np.float32)
        out[f"{n}.weight.lora_b"] = b.reshape(r) if n_out == 1 else b
    return out


def legacy_delta(t: dict[str, np.ndarray], weight: str) -> np.ndarray:
    """The 2023 ΔW = mul_mat(a, b): numpy b·aᵀ, in the base weight's numpy shape."""
    a, b = t[weight + ".lora_a"], t[weight + ".lora_b"]
    d = b.reshape(-1, a.shape[1]) @ a.T
    return d[0] if weight.endswith("norm.weight") else d


RANKS_2023 = {"token_embd": 4, "output": 4, "output_norm": 1, "attn_norm": 1, "ffn_norm": 1, "attn_q": 4, "attn_k": 4,
              "attn_v": 4, "attn_output": 4, "ffn_gate": 4, "ffn_up": 4, "ffn_down": 4}


def write_finetune_2023(path: Path, cfg, t: dict[str, np.ndarray], order: list[str], iteration=2, seed=0,
                        opt_type="adam") -> tuple[np.ndarray, np.ndarray]:
    nx = sum(a.size for a in t.values())
    m, v = moments_for(order, t, seed)
    kvs = [("training.type", "finetune_lora", V.STRING)] + hparam_kvs(cfg)
    kvs += [(f"training.lora.rank.{k}", r, V.UINT32) for k, r in RANKS_2023.items()]
    kvs += state_kvs(iteration, nx, opt_type)
    tensors = list(t.items()) + ([("optimizer.adam.first_moments", m), ("optimizer.adam.second_moments", v)]
                                 if opt_type == "adam" else [])
    gguf_file(path, "llama", kvs, tensors)
    return m, v


def write_ggla(path: Path, r: int, alpha: int, t: dict[str, np.ndarray], f16: set[str] = frozenset()) -> Path:
    """ggla per FORMATS.md (b): header, then records padded to 32-byte file offsets; one absent-tensor record."""
    buf = bytearray(struct.pack("<4I", 0x67676C61, 1, r, alpha))

    def pad():
        buf.extend(b"\0" * (-len(buf) & 31))
    buf += struct.pack("<3I", 0, 0, 0)          # what finetune writes for a NULL tensor
    pad()
    for name, arr in t.items():
        gname = name.replace(".lora_a", ".loraA").replace(".lora_b", ".loraB")
        data = arr.astype(np.float16 if name in f16 else np.float32)
        ne = list(reversed(data.shape))
        buf += struct.pack(f"<3I{len(ne)}I", len(ne), len(gname), 1 if name in f16 else 0, *ne) + gname.encode()
        pad()
        buf += data.tobytes()
    path.write_bytes(bytes(buf))
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_vocab):
    d = tmp_path_factory.mktemp("convert")
    base = write_tiny_model(d / "base.gguf", tiny_vocab)
    text = d / "train.txt"
    text.write_text(TEXT)
    finetune(FinetuneOptions(model_base=base, train_data=text, ctx=8, batch=2, adam_iter=2, save_every=0,
                             checkpoint_out=d / "chk-ITERATION.gguf", lora_out=d / "a-ITERATION.gguf", warmup=1),
             quiet=True)
    cfg = tiny_config()
    return SimpleNamespace(d=d, base=base, text=text, chk=d / "chk-2.gguf", lora=d / "a-2.gguf", cfg=cfg,
                           vocab=tiny_vocab)


# --------------------------------------------------------------------------- llamatune checkpoints, GGUF and PEFT

def test_checkpoint_to_gguf_adapter_is_finetunes_lora_out(env):
    out = env.d / "conv.gguf"
    text = convert(env.chk, out)                       # default --to gguf-adapter, base name from the options
    assert "gguf-adapter" in text and str(out) in text
    assert out.read_bytes() == env.lora.read_bytes()  # the training-data record included (export-lora's default)
    out2 = env.d / "conv-checked.gguf"
    assert "checked against base.gguf" in convert(env.chk, out2, "gguf-adapter", env.base)
    assert out2.read_bytes() == out.read_bytes()


def test_checkpoint_peft_gguf_roundtrip_and_logits(env):
    peft = env.d / "peft-from-chk"
    convert(env.chk, peft, "peft", env.base)
    config = json.loads((peft / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == \
        ("LORA", "CAUSAL_LM", 4, 4.0)
    assert config["base_model_name_or_path"] == "llamatune"
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj"])
    st = load_file(str(peft / "adapter_model.safetensors"))
    assert st["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (4, env.cfg.n_ff)
    back = env.d / "peft-back.gguf"
    assert "PEFT" in convert(peft, back, model_base=env.base)
    want, got = tensors_of(env.lora), tensors_of(back)
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    assert GGUFFile(back).get("adapter.lora.alpha") == GGUFFile(env.lora).get("adapter.lora.alpha")
    ref = logits(env.base, [env.lora])
    np.testing.assert_array_equal(logits(env.base, [back]), ref)
    assert not np.allclose(ref, logits(env.base))           # the adapter does something


def test_gguf_peft_gguf_identical_and_qk_rows_permuted(env):
    peft, back = env.d / "peft-from-gguf", env.d / "gguf-back.gguf"
    assert "GGUF LoRA adapter" in convert(env.lora, peft, model_base=env.base)   # default --to peft
    convert(peft, back, "gguf-adapter", env.base)
    want, got = tensors_of(env.lora), tensors_of(back)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    st = load_file(str(peft / "adapter_model.safetensors"))
    for kind, module, n_head in (("attn_q", "q_proj", env.cfg.n_head), ("attn_k", "k_proj", env.cfg.n_head_kv),
                                 ("attn_v", "v_proj", None)):
        b_gguf = want[f"blk.0.{kind}.weight.lora_b"]
        b_hf = st[f"base_model.model.model.layers.0.self_attn.{module}.lora_B.weight"]
        np.testing.assert_array_equal(st[f"base_model.model.model.layers.0.self_attn.{module}.lora_A.weight"],
                                      want[f"blk.0.{kind}.weight.lora_a"])
        if n_head is None:
            np.testing.assert_array_equal(b_hf, b_gguf)
        else:
            np.testing.assert_array_equal(b_gguf, b_hf[hf_to_gguf_rows(b_hf.shape[0], n_head)])
            assert not np.array_equal(b_gguf, b_hf)


def write_peft(path: Path, cfg, seed=0, r=4, alpha=8.0) -> dict:
    """A PEFT directory with every supported module, one module at rank 2 (rank_pattern) and one with its
    own alpha (alpha_pattern). Returns the HF-layout (A, B, scale) per GGUF weight."""
    rng = np.random.default_rng(seed)
    path.mkdir()
    # module -> (GGUF weight, n_in, n_out); the embedding's "n_in" is the vocabulary (lora_embedding_A is (r, V))
    modules = {"model.embed_tokens": ("token_embd.weight", cfg.n_vocab, cfg.n_embd),
               "lm_head": ("output.weight", cfg.n_embd, cfg.n_vocab)}
    hf = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
    for i in range(cfg.n_layer):
        for kind, mod in hf.items():
            n_out, n_in = tensor_shape(cfg, kind)
            modules[f"model.layers.{i}.{mod}"] = (f"blk.{i}.{kind}.weight", n_in, n_out)
    tensors, truth = {}, {}
    for mod, (weight, n_in, n_out) in modules.items():
        rr = 2 if mod == "model.layers.1.self_attn.k_proj" else r
        aa = 2.0 if mod == "model.layers.0.mlp.up_proj" else alpha
        a = rng.normal(0, 0.2, (rr, n_in)).astype(np.float32)
        b = rng.normal(0, 0.2, (n_out, rr)).astype(np.float32)
        if mod == "model.embed_tokens":
            tensors[f"base_model.model.{mod}.lora_embedding_A"] = a
            tensors[f"base_model.model.{mod}.lora_embedding_B"] = b
        else:
            tensors[f"base_model.model.{mod}.lora_A.weight"], tensors[f"base_model.model.{mod}.lora_B.weight"] = a, b
        truth[weight] = (a, b, aa / rr)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "target_modules": ["q_proj"],
        "rank_pattern": {"model.layers.1.self_attn.k_proj": 2}, "alpha_pattern": {"layers.0.mlp.up_proj": 2.0},
        "use_rslora": False}))
    return truth


def test_peft_to_gguf_effects_and_logits(env):
    peft = env.d / "handmade-peft"
    truth = write_peft(peft, env.cfg)
    out = env.d / "handmade.gguf"
    text = convert(peft, out, model_base=env.base)
    assert "rescaled" in text                                  # the alpha_pattern module
    got = delta(out, env.base)
    merged = weights_of(env.base)
    for weight, (a, b, s) in truth.items():
        if weight == "token_embd.weight":
            want = s * (a.T @ b.T)                             # PEFT: embedding(x, A.T) @ B.T
        else:
            want = s * (b @ a)
            kind = weight.split(".")[-2]
            if kind in ("attn_q", "attn_k"):
                want = want[hf_to_gguf_rows(want.shape[0], env.cfg.n_head if kind == "attn_q" else env.cfg.n_head_kv)]
        np.testing.assert_allclose(got[weight], want, rtol=1e-5, atol=1e-6)
        merged[weight] = merged[weight] + want
    assert GGUFFile(out).tensors["blk.1.attn_k.weight.lora_b"].shape == (env.cfg.n_embd_kv, 2)
    write_model(env.d / "merged-peft.gguf", env.cfg, merged, env.vocab)
    np.testing.assert_allclose(logits(env.base, [out]), logits(env.d / "merged-peft.gguf"), rtol=1e-4, atol=1e-4)
    # and back to PEFT: rank_pattern kept, same effect
    again = env.d / "handmade-peft-again"
    convert(out, again, model_base=env.base)
    cfg2 = json.loads((again / "adapter_config.json").read_text())
    assert cfg2["rank_pattern"] == {"model.layers.1.self_attn.k_proj": 2} and cfg2["lora_alpha"] == 8.0
    back = env.d / "handmade-back.gguf"
    convert(again, back, model_base=env.base)
    for name, arr in tensors_of(out).items():
        np.testing.assert_array_equal(tensors_of(back)[name], arr)


def test_peft_bf16_and_rslora(env):
    peft = env.d / "bf16-peft"
    truth = write_peft(peft, env.cfg, seed=11)
    tensors = load_file(str(peft / "adapter_model.safetensors"))
    header, blob = {}, b""
    for name, arr in tensors.items():                # rewrite as BF16 (numpy has none: truncate the f32 bits)
        raw = (arr.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(arr.shape), "data_offsets": [len(blob), len(blob) + len(raw)]}
        blob += raw
    head = json.dumps(header).encode()
    (peft / "adapter_model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + blob)
    config = json.loads((peft / "adapter_config.json").read_text())
    (peft / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True, "alpha_pattern": {}}))
    out = env.d / "bf16.gguf"
    convert(peft, out, model_base=env.base)
    got = delta(out, env.base)

    def bf16(x):
        return (x.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    for weight, (a, b, _) in truth.items():
        s = 8.0 / np.sqrt(a.shape[0])                  # rslora: lora_alpha / sqrt(r)
        a, b = bf16(a), bf16(b)
        if weight == "token_embd.weight":
            want = s * (a.T @ b.T)
        else:
            want = s * (b @ a)
            if weight.endswith((".attn_q.weight", ".attn_k.weight")):
                n_head = env.cfg.n_head if ".attn_q." in weight else env.cfg.n_head_kv
                want = want[hf_to_gguf_rows(want.shape[0], n_head)]
        np.testing.assert_allclose(got[weight], want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- 2023 finetune checkpoints

@pytest.mark.parametrize("rtl", [False, True], ids=["left-to-right", "right-to-left"])
def test_finetune_2023_to_checkpoint_and_resume(env, rtl):
    t = legacy_lora_tensors(env.cfg, RANKS_2023, seed=1)
    src = env.d / f"ft2023-{rtl}.gguf"
    order = hand_order(env.cfg.n_layer, lora=True, rtl=rtl)
    m2023, v2023 = write_finetune_2023(src, env.cfg, t, order, iteration=2)
    out = env.d / f"ft2023-{rtl}-conv.gguf"
    text = convert(src, out)                                   # default --to checkpoint, no base needed
    expected_order = "flash attention, right-to-left" if rtl else "flash attention, left-to-right"
    assert f"'{expected_order}' (detected" in text
    for flag in ("--rank-tok-embd 4", "--rank-out 4", "--rank-att-norm 1", "--rank-ffn-norm 1", "--rank-out-norm 1"):
        assert flag in text
    c = ckpt.load(out)
    assert (c.kind, c.state.iteration, c.state.sample_count, c.state.token_count) == (ckpt.KIND_LORA, 2, 16, 128)
    f = c.file
    p = {n: np.array(x.data).reshape(x.shape) for n, x in f.tensors.items() if not n.startswith("optimizer.")}
    alpha = f.get("training.lora.alpha")
    assert alpha == 4.0
    for w in {n.rsplit(".", 1)[0] for n in t}:
        A, B = p[w + ".lora_a"], p[w + ".lora_b"]
        s = alpha / B.shape[-1]
        ours = s * (A @ B.T if w == "token_embd.weight" else B @ A)
        np.testing.assert_allclose(ours.reshape(legacy_delta(t, w).shape), legacy_delta(t, w), rtol=1e-5, atol=1e-6)
    # moments: our flat vectors follow the checkpoint's tensor order; check one transposed A, one rescaled norm B
    offsets, off = {}, 0
    for n, arr in p.items():
        offsets[n] = (off, off + arr.size)
        off += arr.size
    m_ours, v_ours = f.tensors["optimizer.adam.first_moments"].data, f.tensors["optimizer.adam.second_moments"].data
    pos, o2023 = 0, {}
    for n in order:
        o2023[n] = (pos, pos + t[n].size)
        pos += t[n].size

    def chunk(flat, n, table):
        lo, hi = table[n]
        return flat[lo:hi]
    a_name = "blk.1.attn_q.weight.lora_a"                      # 2023 (n_in, r) -> ours (r, n_in)
    np.testing.assert_array_equal(chunk(m_ours, a_name, offsets),
                                  chunk(m2023, a_name, o2023).reshape(t[a_name].shape).T.reshape(-1))
    b_name = "blk.0.ffn_norm.weight.lora_b"                    # rank 1 vs alpha 4: B' = B/4, m' = 4m, v' = 16v
    np.testing.assert_allclose(chunk(m_ours, b_name, offsets), 4 * chunk(m2023, b_name, o2023), rtol=1e-6)
    np.testing.assert_allclose(chunk(v_ours, b_name, offsets), 16 * chunk(v2023, b_name, o2023), rtol=1e-6)
    te = "token_embd.weight"                                   # flipped: 2023 b -> our lora_a, 2023 a -> our lora_b
    np.testing.assert_array_equal(chunk(v_ours, te + ".lora_a", offsets), chunk(v2023, te + ".lora_b", o2023))
    if rtl:
        return
    result = finetune(FinetuneOptions(
        model_base=env.base, train_data=env.text, ctx=8, batch=2, adam_iter=3, save_every=0, checkpoint_in=out,
        checkpoint_out=env.d / "resumed-ITERATION.gguf", lora_out=env.d / "resumed-a-ITERATION.gguf", warmup=1,
        rank_tok_embd=4, rank_out=4, rank_att_norm=1, rank_ffn_norm=1, rank_out_norm=1), quiet=True)
    assert result.state.iteration == 3 and len(result.losses) == 1 and np.isfinite(result.losses[0])


def test_finetune_2023_to_gguf_adapter_and_peft(env):
    t = legacy_lora_tensors(env.cfg, RANKS_2023, seed=2)
    src = env.d / "ft2023-b.gguf"
    write_finetune_2023(src, env.cfg, t, hand_order(env.cfg.n_layer, True, False), opt_type="lbfgs")
    out = env.d / "ft2023-b.adapter.gguf"
    text = convert(src, out, "gguf-adapter", env.base)
    assert "norm adapters that llama.cpp skips" in text
    got = delta(out, env.base)
    merged = weights_of(env.base)
    for w in got:
        np.testing.assert_allclose(got[w].reshape(legacy_delta(t, w).shape), legacy_delta(t, w), rtol=1e-5, atol=1e-6)
        if not w.endswith("norm.weight"):                      # run time skips norm adapters, so merge only the rest
            merged[w] = merged[w] + legacy_delta(t, w)
    write_model(env.d / "merged-2023.gguf", env.cfg, merged, env.vocab)
    np.testing.assert_allclose(logits(env.base, [out]), logits(env.d / "merged-2023.gguf"), rtol=1e-4, atol=1e-4)
    # to PEFT straight from the checkpoint (head counts from its own llama.* keys), back to GGUF: same effect
    peft = env.d / "ft2023-b.peft"
    assert "norm adapter(s) left out" in convert(src, peft, "peft")
    back = env.d / "ft2023-b.back.gguf"
    convert(peft, back, model_base=env.base)
    back_delta = delta(back, env.base)
    assert set(back_delta) == {w for w in got if not w.endswith("norm.weight")}
    for w, d in back_delta.items():
        np.testing.assert_allclose(d, got[w], rtol=1e-5, atol=1e-7)
    # a checkpoint without Adam moments still converts, with zero moments
    text = convert(src, env.d / "ft2023-b.chk.gguf")
    assert "start at zero" in text
    assert not ckpt.load(env.d / "ft2023-b.chk.gguf").file.tensors["optimizer.adam.second_moments"].data.any()


# --------------------------------------------------------------------------- ggla

def test_ggla_to_gguf_adapter(env):
    t = legacy_lora_tensors(env.cfg, RANKS_2023, seed=3)
    src = write_ggla(env.d / "lora.bin", r=4, alpha=8, t=t, f16={"blk.0.attn_v.weight.lora_a"})
    out = env.d / "from-ggla.gguf"
    text = convert(src, out, model_base=env.base)
    assert "ggla" in text and "checked against base.gguf" in text
    got = delta(out, env.base)
    assert len(got) == len(t) // 2
    for w in got:
        tw = dict(t)
        if w == "blk.0.attn_v.weight":
            tw[w + ".lora_a"] = tw[w + ".lora_a"].astype(np.float16).astype(np.float32)
        np.testing.assert_allclose(got[w].reshape(legacy_delta(tw, w).shape), 2.0 * legacy_delta(tw, w),
                                   rtol=1e-5, atol=1e-6)       # applied with alpha/r = 8/4
    peft = env.d / "from-ggla.peft"
    convert(src, peft, "peft", env.base)
    assert json.loads((peft / "adapter_config.json").read_text())["lora_alpha"] == 8.0


# --------------------------------------------------------------------------- full models

def write_train_2023(path: Path, cfg, vocab, order_rtl: bool):
    """A train-text-from-scratch checkpoint; returns (weights, m, v, 2023 moment offsets by name)."""
    w = random_weights(cfg, seed=5, std=0.08)
    order = hand_order(cfg.n_layer, lora=False, rtl=order_rtl)
    m, v = moments_for(order, w, seed=6)
    kvs = [("training.type", "train_model", V.STRING), ("general.name", "llama", V.STRING)]
    kvs += hparam_kvs(cfg, with_kv_heads=False) + [(k.key, k.value, k.vtype, k.sub_type) for k in vocab]
    kvs += state_kvs(7, sum(a.size for a in w.values()))
    gguf_file(path, "llama", kvs, [(n, w[n]) for n in tensor_names(cfg)] + [
        ("optimizer.adam.first_moments", m), ("optimizer.adam.second_moments", v)])
    offs, pos = {}, 0
    for n in order:
        offs[n] = (pos, pos + w[n].size)
        pos += w[n].size
    return w, m, v, offs


def test_train_2023_to_model_and_checkpoint(env):
    cfg = tiny_config(n_head_kv=4)                             # the 2023 trainer had no GQA
    src = env.d / "train2023.gguf"
    w, m, v, offs = write_train_2023(src, cfg, env.vocab, order_rtl=False)
    model = env.d / "train2023-model.gguf"
    assert "model" in convert(src, model)                      # default --to model
    got = weights_of(model)
    for n, arr in w.items():
        np.testing.assert_array_equal(got[n], arr)
    ref = env.d / "train2023-ref.gguf"
    write_model(ref, cfg, w, env.vocab)
    np.testing.assert_array_equal(logits(model), logits(ref))
    assert Model(model).tokenizer.encode("First Citizen") == Model(ref).tokenizer.encode("First Citizen")

    out = env.d / "train2023-chk.gguf"
    assert "left-to-right" in convert(src, out, "checkpoint")
    c = ckpt.load(out)
    assert c.kind == ckpt.KIND_FULL and c.state.iteration == 7
    assert c.options == {"embd": 64, "head": 4, "head_kv": None, "layer": 2, "ff": 96, "norm_rms_eps": 1e-05,
                         "rope_freq_base": 10000.0}
    params = ParamBuffer([ParamSpec(n, s) for n, s in tensor_names(cfg).items()])
    c.load_into(params)
    for n, arr in w.items():
        np.testing.assert_array_equal(params[n], arr)
        lo, hi = offs[n]
        np.testing.assert_array_equal(params.m[params.offsets[n][0]:params.offsets[n][1]], m[lo:hi])
        np.testing.assert_array_equal(params.v[params.offsets[n][0]:params.offsets[n][1]], v[lo:hi])


def test_llamatune_train_checkpoint_to_model(env):
    cfg = env.cfg
    w = random_weights(cfg, seed=9, std=0.08)
    params = ParamBuffer([ParamSpec(n, s) for n, s in tensor_names(cfg).items()])
    for n, arr in w.items():
        params[n][...] = arr
    src = env.d / "ours-full.gguf"
    ckpt.save(src, ckpt.KIND_FULL, cfg.arch, FinetuneOptions(), params, ckpt.TrainState(iteration=3),
              [kv(k, val) for k, val in cfg.metadata().items()] + list(env.vocab))
    out = env.d / "ours-full-model.gguf"
    assert "train-from-scratch or full-finetune checkpoint" in convert(src, out)
    got = weights_of(out)
    for n, arr in w.items():
        np.testing.assert_array_equal(got[n], arr)


# --------------------------------------------------------------------------- errors

def test_errors(env, tmp_path):
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    with pytest.raises(LlamatuneError, match=r"unknown file type .*supported inputs"):
        convert(junk, tmp_path / "o.gguf")
    with pytest.raises(LlamatuneError, match="not found"):
        convert(tmp_path / "missing.gguf", tmp_path / "o.gguf")
    with pytest.raises(LlamatuneError, match=r"is a GGUF LoRA adapter, which converts to peft, not checkpoint"):
        convert(env.lora, tmp_path / "o.gguf", "checkpoint")
    with pytest.raises(LlamatuneError, match=r"--to 'onnx': choose one of"):
        convert(env.lora, tmp_path / "o.gguf", "onnx")
    with pytest.raises(LlamatuneError, match=r"finetune checkpoint, which converts to gguf-adapter or peft, not model"):
        convert(env.chk, tmp_path / "o.gguf", "model")
    with pytest.raises(LlamatuneError, match=r"--model-base is required.*head counts"):
        convert(env.chk, tmp_path / "p", "peft")
    with pytest.raises(LlamatuneError, match=r"a llama model GGUF \(as llama.cpp's llama-finetune writes\), nothing "
                                             r"to convert: use it as it is \(--model-base of finetune"):
        convert(env.base, tmp_path / "o.gguf")
    empty = tmp_path / "dir"
    empty.mkdir()
    with pytest.raises(LlamatuneError, match="not a PEFT adapter"):
        convert(empty, tmp_path / "o.gguf")
    peft = tmp_path / "peft"
    write_peft(peft, env.cfg)
    with pytest.raises(LlamatuneError, match=r"--model-base is required to convert a Hugging Face PEFT"):
        convert(peft, tmp_path / "o.gguf")
    with pytest.raises(LlamatuneError, match="safetensors file"):
        convert(peft / "adapter_model.safetensors", tmp_path / "o.gguf")
    cfg = json.loads((peft / "adapter_config.json").read_text())
    (peft / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(LlamatuneError, match="use_dora"):
        convert(peft, tmp_path / "o.gguf", model_base=env.base)
    t = legacy_lora_tensors(env.cfg, RANKS_2023, seed=4)
    ggla = write_ggla(tmp_path / "x.bin", 4, 4, t)
    with pytest.raises(LlamatuneError, match=r"--model-base is required to convert a llama.cpp 2023 ggla"):
        convert(ggla, tmp_path / "o.gguf")
    other = write_tiny_model(tmp_path / "other.gguf", env.vocab, n_embd=32, head_dim=8, n_rot=8)
    write_finetune_2023(tmp_path / "ft.gguf", env.cfg, t, hand_order(2, True, False))
    with pytest.raises(LlamatuneError, match=r"does not fit the base model other.gguf: n_embd 64 vs 32"):
        convert(tmp_path / "ft.gguf", tmp_path / "o.gguf", model_base=other)
    with pytest.raises(LlamatuneError, match=r"--model-base must be a model"):
        convert(env.chk, tmp_path / "o.gguf", model_base=env.lora)
    with pytest.raises(LlamatuneError, match=r"x.bin does not fit the base model other.gguf: 'token_embd.weight'"):
        convert(ggla, tmp_path / "o.gguf", model_base=other)
    (tmp_path / "o.gguf").write_bytes(b"keep")
    write_peft(tmp_path / "peft2", env.cfg)
    with pytest.raises(LlamatuneError, match=r"adapter does not fit other.gguf"):   # read_adapter, before replacing
        convert(tmp_path / "peft2", tmp_path / "o.gguf", model_base=other)
    assert (tmp_path / "o.gguf").read_bytes() == b"keep" and not list(tmp_path.glob(".o.gguf*"))
    not_peft = tmp_path / "stuff"
    not_peft.mkdir()
    (not_peft / "x").write_text("x")
    with pytest.raises(LlamatuneError, match="not a PEFT adapter; will not replace it"):
        convert(env.lora, not_peft, model_base=env.base)


def test_graph_orders_match_hand_derivation_and_are_told_apart(env):
    for lora in (True, False):
        orders = param_orders(2, lora)
        assert orders[(True, True)] == hand_order(2, lora, rtl=False)
        assert orders[(True, False)] == hand_order(2, lora, rtl=True)
        assert all(sorted(o) == sorted(orders[(True, True)]) for o in orders.values())
    t = legacy_lora_tensors(env.cfg, RANKS_2023, seed=7)
    sizes = {n: a.size for n, a in t.items()}
    for key, order in param_orders(env.cfg.n_layer, True).items():    # GQA sizes: all four orders differ
        _, v = moments_for(order, t, seed=8)
        assert choose_order(param_orders(env.cfg.n_layer, True), sizes, v) == (key, "detected from the moments"), \
            ORDER_LABELS[key]
    assert choose_order(param_orders(2, True), sizes, np.zeros(sum(sizes.values()), np.float32)) == \
        ((True, True), "assumed: the moments do not tell the orders apart")


# --------------------------------------------------------------------------- phi3: fused PEFT modules

PHI3_MODULES = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
                "ffn_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def phi3_base(tmp_path_factory, tiny_vocab):
    cfg = tiny_config("phi3", n_embd=32, n_ff=48, head_dim=8, n_rot=8)
    path = tmp_path_factory.mktemp("phi3") / "phi3.gguf"
    write_model(path, cfg, random_weights(cfg, seed=2, std=0.1), tiny_vocab, gguf.GGMLQuantizationType.F32)
    return SimpleNamespace(path=path, cfg=cfg)


def test_phi3_fused_peft_modules_map_as_they_are_both_ways(phi3_base, tmp_path):
    """HF Phi-3's qkv_proj (q | k | v rows) and gate_up_proj (gate | up rows) are llama.cpp's attn_qkv
    and ffn_up as convert_hf_to_gguf.py copies them: the adapter converts without reordering, has the
    effect of W + s·B·A on the fused weights, and comes back identical."""
    cfg, rng = phi3_base.cfg, np.random.default_rng(4)
    peft = tmp_path / "phi3-peft"
    peft.mkdir()
    tensors, merged = {}, weights_of(phi3_base.path)
    for i in range(cfg.n_layer):
        for kind, module in PHI3_MODULES.items():
            n_out, n_in = tensor_shape(cfg, kind)
            a = rng.normal(0, 0.2, (4, n_in)).astype(np.float32)
            b = rng.normal(0, 0.2, (n_out, 4)).astype(np.float32)
            key = f"base_model.model.model.layers.{i}.{module}"
            tensors[key + ".lora_A.weight"], tensors[key + ".lora_B.weight"] = a, b
            merged[f"blk.{i}.{kind}.weight"] += 2.0 * (b @ a)            # lora_alpha 8 / r 4
    save_file(tensors, str(peft / "adapter_model.safetensors"), metadata={"format": "pt"})
    (peft / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8.0}))
    out = tmp_path / "phi3-adapter.gguf"
    convert(peft, out, model_base=phi3_base.path)
    got = tensors_of(out)
    assert got["blk.0.attn_qkv.weight.lora_b"].shape == (64, 4) and got["blk.1.ffn_up.weight.lora_b"].shape == (96, 4)
    np.testing.assert_array_equal(got["blk.0.attn_qkv.weight.lora_b"],
                                  tensors["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"])
    hand = tmp_path / "phi3-merged.gguf"
    write_model(hand, cfg, merged, vocab_kvs(GGUFFile(phi3_base.path)), gguf.GGMLQuantizationType.F32)
    np.testing.assert_allclose(logits(phi3_base.path, [out]), logits(hand), rtol=1e-4, atol=1e-4)

    back = tmp_path / "phi3-peft-back"
    convert(out, back, "peft")                                  # no base needed: the adapter names phi3
    config = json.loads((back / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    st = load_file(str(back / "adapter_model.safetensors"))
    assert st.keys() == tensors.keys()
    for key in tensors:
        np.testing.assert_array_equal(st[key], tensors[key])


def test_phi3_peft_with_separate_q_k_v_modules_is_refused(phi3_base, tmp_path):
    """A Phi-3 HF model has no q_proj (only the fused qkv_proj): such an adapter belongs to another model."""
    peft = tmp_path / "qproj"
    peft.mkdir()
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((2, 32), np.float32),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((32, 2), np.float32)},
              str(peft / "adapter_model.safetensors"))
    (peft / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
    with pytest.raises(LlamatuneError, match=r"module 'model\.layers\.0\.self_attn\.q_proj' has no llama\.cpp tensor "
                                             r"in a phi3 model \(its modules: qkv_proj, o_proj, gate_up_proj, "
                                             r"down_proj, embed_tokens, lm_head\)"):
        convert(peft, tmp_path / "x.gguf", model_base=phi3_base.path)
