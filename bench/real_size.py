"""Benchmark: one LoRA optimizer step on real-size Q4_K models (peak RSS, seconds).

The models are random-weight GGUFs written with llamatune's own writer: Q4_K blocks
of random bytes whose scales are set so the weights are zero-mean with std about
0.02 (quantizing 7-8 billion f32 weights would take longer than the step itself),
F32 norms, a dummy vocabulary.

    llama2-7b     32 layers, embd 4096, 32 heads (MHA), ffn 11008, vocab 32000, Q4_K
    llama3-8b     32 layers, embd 4096, 32/8 heads (GQA), ffn 14336, vocab 128256, Q4_K
    qwen2.5-1.5b  28 layers, embd 1536, 12/2 heads, ffn 8960, vocab 151936, tied head,
                  q/k/v biases, Q4_K_M as llama.cpp mixes it (Q6_K for the tied
                  embedding/head and for attn_v and ffn_down of the layers that get
                  more bits, Q4_K elsewhere)
    qwen3-30b-a3b 48 layers, embd 2048, 32/4 heads of 128, 128 experts of ffn 768, 8
                  active per token, vocab 151936, Q4_K (the router ffn_gate_inp F32, as
                  llama-quantize leaves it); 3-D expert tensors
    qwen3-a3b-dense  its dense twin for speed: the same layers (qwen3's attention) with one
                  SwiGLU of ffn 8 * 768 = 6144, the same active parameters per token
    gpt-oss-20b   24 layers, embd 2880, 64/8 heads of 64, 32 experts of ffn 2880, 4 active per
                  token, vocab 201088, attention sinks, a sliding window of 128 on alternate
                  layers, YaRN rope (factor 32 over 4096, base 150000), biases; as the released
                  MXFP4 file (llama.cpp's converter at q8_0 over the MXFP4 checkpoint): experts
                  MXFP4, the other matrices Q8_0, the router, biases, sinks and norms F32
    gpt-oss-20b-dense  its dense twin for speed: a llama of the same attention shape (no sinks,
                  biases or window) with one SwiGLU of ffn 4 * 2880 = 11520 (the same active
                  parameters per token), the feed-forward MXFP4, the other matrices Q8_0
    qwen3.5-4b    32 layers, embd 2560, ffn 9216, vocab 248320, tied head, Q4_K_M; every 4th layer
                  gated full attention (16/4 heads of 256, output gate, partial rotary 64),
                  the others gated delta-net (16 q/k heads, 32 value heads of 128, conv 4);
                  conv1d, ssm_a and dt bias in F32 as llama.cpp keeps them (write_qwen35)
    gemma-4-e4b   Gemma-4-E4B's text model: 42 layers, embd 2560, ffn 10240, 8/2 heads, vocab
                  262144, tied head; 5 sliding-window layers (window 512, heads of 256) to 1
                  full-attention layer (heads of 512, a quarter rotated: rope_freqs); the last
                  18 layers reuse the keys and values of layers 22 / 23; per-layer embeddings
                  of 256 (a 262144 x 42*256 table); Q4_K_M as llama.cpp mixes it (Q6_K for the
                  tied embedding, the per-layer table and attn_v / ffn_down of the layers that
                  get more bits, counted over the 24 layers with attn_v; per_layer_model_proj
                  left F16, as llama-quantize leaves it). `--layers N`: the first N layers with
                  the last one full attention (HF forces it) and what sharing fits in N

`--layers N` writes and runs the first N layers of a shape only (its own file): the
MoE shape at 2-4 layers fits beside other work, the whole file (about 17 GB for
qwen3-30b-a3b) wants the machine to itself; `--steps 0` prints the estimate alone.

Each (shape, ctx, mode) runs in a fresh process: load, estimate (memory.Planner, as
the trainer computes it), one step (batch 1, LoRA r 8 on q,k,v,o,gate,up,down,
AdamW), peak RSS (VmHWM). The first step is also the first touch of the model's
pages; run it twice (`--steps 2`) to see a warm step, or not at all (`--steps 0`)
for the estimate alone. Beside the wall time, each row gives the step's CPU time (user +
system of the process, its threads summed): on a machine others load, the wall time
counts their share, the CPU time much less.

    python bench/real_size.py [--shapes llama2-7b,llama3-8b,qwen2.5-1.5b] [--ctx 512,2048] [--mode layer]
        [--steps 1] [--compute-dtype f32,bf16] [--workdir /tmp/llamatune-real]
With --compute-dtype f32,bf16 each (shape, ctx) runs once in each dtype, one after the
other (the base's products in bf16 through oneDNN: models/products.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from finetune_step import TARGETS, dummy_vocab, sgemm_gflops  # bench/ is sys.path[0] when run as a script

SHAPES = {
    "llama2-7b": dict(arch="llama", n_vocab=32000, n_ctx_train=4096, n_embd=4096, n_layer=32, n_ff=11008,
                      n_head=32, n_head_kv=32, head_dim=128, n_rot=128, norm_eps=1e-5),
    "llama3-8b": dict(arch="llama", n_vocab=128256, n_ctx_train=8192, n_embd=4096, n_layer=32, n_ff=14336,
                      n_head=32, n_head_kv=8, head_dim=128, n_rot=128, norm_eps=1e-5, rope_freq_base=500000.0),
    "qwen2.5-1.5b": dict(arch="qwen2", n_vocab=151936, n_ctx_train=32768, n_embd=1536, n_layer=28, n_ff=8960,
                         n_head=12, n_head_kv=2, head_dim=128, n_rot=128, norm_eps=1e-6, rope_freq_base=1000000.0),
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_vocab=151936, n_ctx_train=40960, n_embd=2048, n_layer=48, n_ff=6144,
                          n_head=32, n_head_kv=4, head_dim=128, n_rot=128, norm_eps=1e-6, rope_freq_base=1000000.0,
                          n_expert=128, n_expert_used=8, n_ff_exp=768),
    "qwen3-a3b-dense": dict(arch="qwen3", n_vocab=151936, n_ctx_train=40960, n_embd=2048, n_layer=48, n_ff=6144,
                            n_head=32, n_head_kv=4, head_dim=128, n_rot=128, norm_eps=1e-6, rope_freq_base=1000000.0),
    "gpt-oss-20b": dict(arch="gpt-oss", n_vocab=201088, n_ctx_train=131072, n_embd=2880, n_layer=24, n_ff=2880,
                        n_head=64, n_head_kv=8, head_dim=64, n_rot=64, norm_eps=1e-5, rope_freq_base=150000.0,
                        rope_freq_scale=1 / 32, rope_ext_factor=1.0, n_ctx_orig=4096, n_expert=32, n_expert_used=4,
                        n_ff_exp=2880, sliding_window=128, swa_pattern=2),
    "gpt-oss-20b-dense": dict(arch="llama", n_vocab=201088, n_ctx_train=131072, n_embd=2880, n_layer=24, n_ff=11520,
                              n_head=64, n_head_kv=8, head_dim=64, n_rot=64, norm_eps=1e-5, rope_freq_base=150000.0,
                              rope_freq_scale=1 / 32, rope_ext_factor=1.0, n_ctx_orig=4096),
    "qwen3.5-4b": dict(arch="qwen35", n_vocab=248320, n_ctx_train=262144, n_embd=2560, n_layer=32, n_ff=9216,
                       n_head=16, n_head_kv=4, head_dim=256, n_rot=64, norm_eps=1e-6, rope_freq_base=10000000.0,
                       ssm_conv_kernel=4, ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=32,
                       ssm_inner_size=4096, recurrent_layers=tuple(i % 4 != 3 for i in range(32)),
                       full_attention_interval=4, rope_sections=(11, 11, 10, 0)),
    "gemma-4-e4b": dict(arch="gemma4", n_vocab=262144, n_ctx_train=131072, n_embd=2560, n_layer=42, n_ff=10240,
                        n_head=8, n_head_kv=2, head_dim=512, n_rot=512, head_dim_swa=256, n_rot_swa=256,
                        norm_eps=1e-6, rope_freq_base=1000000.0, rope_freq_base_swa=10000.0, rope_freq_scale_swa=1.0,
                        attn_scale=1.0, sliding_window=512, swa_pattern=6, final_softcap=30.0, n_kv_shared=18,
                        n_embd_per_layer=256),
}
EXPERT_TARGETS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
TIED = {"qwen2.5-1.5b", "qwen3.5-4b", "gemma-4-e4b"}
MIXED = {"qwen2.5-1.5b", "qwen3.5-4b", "gemma-4-e4b"}               # Q4_K_M; the others all Q4_K
MXFP4_MOE = {"gpt-oss-20b", "gpt-oss-20b-dense"}      # the feed-forward MXFP4, the other matrices Q8_0
R = 8
MORE_TARGETS = {"qwen35": ("attn_qkv", "attn_gate", "ssm_out")}   # the delta-net layers' in/out projections


def random_q4_k(shape: tuple[int, int], seed: int):
    """(n_rows, row_bytes) uint8 Q4_K blocks of random bytes: w = d*sc*q - dmin*m with
    q 4-bit, sc/m 6-bit uniform; d, dmin chosen for mean 0, std about 0.02."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType
    block, size = GGML_QUANT_SIZES[QType.Q4_K]
    rows, cols = shape
    raw = np.random.default_rng(seed).integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    d = 7.6e-5                                    # std(d*sc*q - dmin*m) ~ 263 d; mean 0 when dmin = 7.5 d
    raw[:, 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    raw[:, 2:4] = np.frombuffer(np.float16(7.5 * d).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def random_q6_k(shape: tuple[int, int], seed: int):
    """(n_rows, row_bytes) uint8 Q6_K blocks of random bytes: w = d*sc*(q - 32) with q
    6-bit uniform, sc int8 in [1, 32]; d chosen for std about 0.02."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType
    block, size = GGML_QUANT_SIZES[QType.Q6_K]
    rows, cols = shape
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    raw[:, 192:208] = rng.integers(1, 33, (raw.shape[0], 16), dtype=np.uint8)   # scales
    d = 5.7e-5                                    # std(sc * (q - 32)) ~ 19 * 18.5
    raw[:, 208:210] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def random_q8_0(shape: tuple[int, int], seed: int):
    """(n_rows, row_bytes) uint8 Q8_0 blocks: w = d*q with q int8 uniform in [-127, 127]
    (std about 73.6) and d chosen for std about 0.02."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType
    block, size = GGML_QUANT_SIZES[QType.Q8_0]
    rows, cols = shape
    raw = np.empty((rows * cols // block, size), np.uint8)
    raw[:, 2:] = np.random.default_rng(seed).integers(-127, 128, (raw.shape[0], block), dtype=np.int8).view(np.uint8)
    raw[:, 0:2] = np.frombuffer(np.float16(0.02 / 73.6).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def random_mxfp4(shape: tuple[int, int], seed: int):
    """(n_rows, row_bytes) uint8 MXFP4 blocks (an E8M0 exponent byte, then 32 E2M1 nibbles)
    of random nibbles: w = kvalue(q) * 2^(e - 128), kvalues +-{0, 1, 2, 3, 4, 6, 8, 12}
    (std about 5.85 over uniform q); e = 120 gives std about 0.023."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType
    block, size = GGML_QUANT_SIZES[QType.MXFP4]
    rows, cols = shape
    raw = np.random.default_rng(seed).integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    raw[:, 0] = 120
    return raw.reshape(rows, -1)


def q4_k_m_type(name: str, n_layer: int, n_attn_v: int = 0):
    """llama.cpp's Q4_K_M choice for a matrix (llama_tensor_get_type): Q6_K for the
    output head (the embeddings, when tied: gemma4's per-layer table too) and for attn_v /
    ffn_down of the first and last eighth of the layers and every third one between
    (attn_v counted over the `n_attn_v` layers that have one, all by default); Q4_K
    elsewhere; gemma4's per_layer_model_proj as converted (F16: llama-quantize leaves it)."""
    from gguf import GGMLQuantizationType as QType
    if name in ("output.weight", "token_embd.weight", "per_layer_token_embd.weight"):
        return QType.Q6_K
    if name == "per_layer_model_proj.weight":
        return QType.F16
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        i = int(name.split(".")[1])
        n = n_attn_v if n_attn_v and name.endswith("attn_v.weight") else n_layer
        more = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
        return QType.Q6_K if more else QType.Q4_K
    return QType.Q4_K


def shape_config(shape: str, layers: int = 0) -> dict:
    """ModelConfig fields of `shape`, cut to its first `layers` layers (0: all)."""
    cut = {"n_layer": layers} if layers else {}
    if layers and "recurrent_layers" in SHAPES[shape]:          # qwen35: the kinds of the layers kept
        cut["recurrent_layers"] = SHAPES[shape]["recurrent_layers"][:layers]
    if layers and SHAPES[shape]["arch"] == "gemma4":            # the last layer full attention; the
        full = SHAPES[shape]                                    # shared ones that fit
        cut |= {"swa_pattern": min(full["swa_pattern"], layers),
                "n_kv_shared": max(0, full["n_kv_shared"] - (full["n_layer"] - layers))}
    return SHAPES[shape] | cut


def model_path(workdir: Path, shape: str, layers: int) -> Path:
    cut = f"-{layers}l" if layers else ""
    kind = "Q4_K_M" if shape in MIXED else "MXFP4_MOE" if shape in MXFP4_MOE else "Q4_K"
    return workdir / f"random-{shape}{cut}.{kind}.gguf"


def build(path: Path, shape: str, layers: int = 0) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType as QType
    from llamatune.models.config import ModelConfig
    from llamatune.formats.gguf_io import TensorOut, kv, write_gguf
    from llamatune.models.writer import tensor_names
    if path.exists():
        return
    cfg = ModelConfig(**shape_config(shape, layers))
    if cfg.arch == "qwen35":
        return write_qwen35(path, shape, cfg)
    if shape in MXFP4_MOE:
        return write_mxfp4_moe(path, shape, cfg)
    tensors = []
    if cfg.arch == "gemma4":                                  # the full-attention layers' proportional rope
        quarter = cfg.n_rot // 8
        tensors.append(TensorOut("rope_freqs.weight", (cfg.n_rot // 2,), QType.F32, lambda: np.float32(
            [1.0] * quarter + [1e30] * (cfg.n_rot // 2 - quarter))))
    n_attn_v = cfg.n_layer - cfg.n_kv_shared
    for i, (name, s) in enumerate(tensor_names(cfg, tied=shape in TIED).items()):
        if len(s) == 1:
            fill = 0.0 if name.endswith(".bias") else 1.0
            tensors.append(TensorOut(name, s, QType.F32, lambda s=s, v=fill: np.full(s, v, np.float32)))
        elif name.endswith("ffn_gate_inp.weight"):            # the router: F32 (llama-quantize leaves it)
            tensors.append(TensorOut(name, s, QType.F32, lambda s=s, i=i: np.random.default_rng(i).normal(
                0.0, 0.02, s).astype(np.float32)))
        elif len(s) == 3:                                     # experts (E, n_out, n_in): E * n_out rows
            tensors.append(TensorOut(name, s, QType.Q4_K, lambda s=s, i=i: random_q4_k((s[0] * s[1], s[2]), i)))
        else:
            q = q4_k_m_type(name, cfg.n_layer, n_attn_v) if shape in MIXED else QType.Q4_K
            if q == QType.F16:
                tensors.append(TensorOut(name, s, q, lambda s=s, i=i: np.random.default_rng(i).normal(
                    0.0, 0.02, s).astype(np.float16)))
                continue
            make = random_q6_k if q == QType.Q6_K else random_q4_k
            tensors.append(TensorOut(name, s, q, lambda s=s, i=i, make=make: make(s, i)))
    file_type = 15 if shape in MIXED else 14        # llama.cpp's MOSTLY_Q4_K_M / MOSTLY_Q4_K_S
    kvs = [kv("general.type", "model"), kv("general.name", f"random {shape}")]
    kvs += [kv(k, v) for k, v in cfg.metadata().items()] + [kv("general.file_type", file_type)] + dummy_vocab(cfg.n_vocab)
    write_gguf(path, cfg.arch, kvs, tensors)


def write_qwen35(path: Path, shape: str, cfg) -> None:
    """A random qwen35 GGUF as llama.cpp's Q4_K_M makes one: matrices Q4_K, Q6_K for the tied
    embedding and for the attention-v-like matrices (attn_v, and attn_qkv of the delta-net
    layers: one a layer) and ffn_down of the layers that get more bits; F32 norms, the
    conv1d (never quantized), ssm_a = -exp(A_log) (A_log ~ log U(1, 16), HF's init) and the
    dt bias (1, HF's init); conv taps U(-0.5, 0.5) (a depthwise conv's default init)."""
    import numpy as np
    from gguf import GGMLQuantizationType as QType
    from llamatune.formats.gguf_io import TensorOut, kv, write_gguf
    from llamatune.models.writer import tensor_names

    def f32(s, i, name):
        rng = np.random.default_rng(i)
        if name.endswith("ssm_a"):
            return -rng.uniform(1.0, 16.0, s).astype(np.float32)
        if name.endswith("ssm_conv1d.weight"):
            return rng.uniform(-0.5, 0.5, s).astype(np.float32)
        return np.full(s, 0.0 if name.endswith(".bias") and "ssm_dt" not in name else 1.0, np.float32)
    tensors = []
    for i, (name, s) in enumerate(tensor_names(cfg, tied=True).items()):
        if len(s) == 1 or name.endswith("ssm_conv1d.weight"):
            tensors.append(TensorOut(name, s, QType.F32, lambda s=s, i=i, name=name: f32(s, i, name)))
            continue
        q = q4_k_m_type(name.replace("attn_qkv.", "attn_v."), cfg.n_layer)
        make = random_q6_k if q == QType.Q6_K else random_q4_k
        tensors.append(TensorOut(name, s, q, lambda s=s, i=i, make=make: make(s, i)))
    kvs = [kv("general.type", "model"), kv("general.name", f"random {shape}")]
    kvs += [kv(k, v) for k, v in cfg.metadata().items()] + [kv("general.file_type", 15)] + dummy_vocab(cfg.n_vocab)
    write_gguf(path, cfg.arch, kvs, tensors)


def write_mxfp4_moe(path: Path, shape: str, cfg) -> None:
    """A random GGUF in the released gpt-oss MXFP4 file's types (llama.cpp's converter
    with --outtype q8_0 over the MXFP4 checkpoint: file type MOSTLY_MXFP4_MOE): the expert
    matrices (the dense twin: its feed-forward) MXFP4, the embedding, head and attention
    matrices Q8_0; F32 the router (ffn_gate_inp, which the converter never quantizes),
    every bias (the experts' 2-D ones too), the sinks and the norms. Norms 1, biases 0,
    sinks 0 (a softmax's denominator one larger), router N(0, 0.02)."""
    import numpy as np
    from gguf import GGMLQuantizationType as QType
    from llamatune.formats.gguf_io import TensorOut, kv, write_gguf
    from llamatune.models.writer import tensor_names

    def f32(s, i, name):
        if name.endswith("ffn_gate_inp.weight"):
            return np.random.default_rng(i).normal(0.0, 0.02, s).astype(np.float32)
        return np.full(s, 1.0 if name.endswith("norm.weight") else 0.0, np.float32)
    tensors = []
    for i, (name, s) in enumerate(tensor_names(cfg).items()):
        if len(s) == 1 or name.endswith(".bias") or name.endswith("ffn_gate_inp.weight"):
            tensors.append(TensorOut(name, s, QType.F32, lambda s=s, i=i, name=name: f32(s, i, name)))
        elif len(s) == 3:                                     # experts (E, n_out, n_in): E * n_out rows
            tensors.append(TensorOut(name, s, QType.MXFP4, lambda s=s, i=i: random_mxfp4((s[0] * s[1], s[2]), i)))
        elif name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")):    # the dense twin's
            tensors.append(TensorOut(name, s, QType.MXFP4, lambda s=s, i=i: random_mxfp4(s, i)))
        else:
            tensors.append(TensorOut(name, s, QType.Q8_0, lambda s=s, i=i: random_q8_0(s, i)))
    kvs = [kv("general.type", "model"), kv("general.name", f"random {shape}")]
    kvs += [kv(k, v) for k, v in cfg.metadata().items()] + [kv("general.file_type", 38)] + dummy_vocab(cfg.n_vocab)
    write_gguf(path, cfg.arch, kvs, tensors)


def run_one(path: Path, ctx: int, mode: str, steps: int, dtype: str = "f32", expert_rank: int = R) -> dict:
    import llamatune  # noqa: F401  (first: threading policy before numpy loads)
    import numpy as np
    from llamatune.backend import cpu
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    from llamatune.train.lora import init_lora, lora_specs, lora_targets
    from llamatune.train.step import compile_kernels
    from llamatune.train.memory import Planner, measure_runtime, peak_resident_bytes
    from llamatune.models.model import Model
    from llamatune.train.optimizer import optimizer_step
    from llamatune.options import FinetuneOptions
    from llamatune.precision import policy
    from llamatune.train.params import ParamBuffer
    t_load = time.perf_counter()
    model = Model(path)
    cfg = model.config
    tied = model.weights.output is model.weights.token_embd
    more = MORE_TARGETS.get(cfg.arch, ())
    ranks = {k: R for k in TARGETS + more} | {k: expert_rank for k in EXPERT_TARGETS if cfg.n_expert and expert_rank}
    targets = lora_targets(cfg, ranks, float(R), tied=tied)
    params = ParamBuffer(lora_specs(targets))
    init_lora(params, targets, np.random.default_rng(0))
    opts = FinetuneOptions(warmup=1)
    base = FrozenBase(model)
    compile_kernels(cpu(), opts, {t.qtype for t in base.tensors.values()}, cfg, policy(dtype))
    planner = Planner(cfg, targets, base, measure_runtime(params, model.path), model.path.stat().st_size,
                      model.dequantizer.nbytes, 0.0, policy=policy(dtype))
    est = planner.estimate(1, ctx, mode)
    executor = StepExecutor(cfg, base, params, targets, 1, ctx, mode, policy=policy(dtype))
    rng = np.random.default_rng(1)
    inputs, tg = rng.integers(0, cfg.n_vocab, (1, ctx)), rng.integers(0, cfg.n_vocab, (1, ctx))
    w = np.full((1, ctx), 1.0 / ctx, np.float32)
    load_s = time.perf_counter() - t_load
    times, cpu, loss = [], [], float("nan")
    for i in range(steps):
        t, c = time.perf_counter(), time.process_time()
        params.zero_grad()
        loss = executor.step(inputs, tg, w, (0, i, 0))
        optimizer_step(params, i, opts)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return {"estimate": est.total, "runtime": est.runtime, "graph": est.graph, "model": est.model,
            "scratch": est.scratch, "peak": peak_resident_bytes(), "step_s": times, "cpu_s": cpu, "load_s": load_s, "loss": loss,
            "sgemm_gflops": sgemm_gflops()}


def step_gflop(cfg: dict, ctx: int, mode: str) -> float:
    """Matmul GFLOP of one step: forward, backward to inputs (frozen weights), recompute in layer mode, head."""
    C, F, L, V = cfg["n_embd"], cfg["n_ff"], cfg["n_layer"], cfg["n_vocab"]
    if cfg.get("n_expert"):                                              # the experts a token uses, its router
        F = cfg["n_expert_used"] * cfg["n_ff_exp"] + cfg["n_expert"] / 3
    head = cfg["head_dim"]
    if cfg.get("head_dim_swa"):                                          # gemma4: the layers' mean head size
        n = cfg["swa_pattern"]
        head = ((n - 1) * cfg["head_dim_swa"] + cfg["head_dim"]) / n
    Ckv = cfg["n_head_kv"] * head
    Cq = cfg["n_head"] * head
    per_token = 2 * (2 * C * Cq + 2 * C * Ckv + 3 * C * F)              # one forward of a layer
    passes = 3 if mode == "layer" else 2
    attn = 2 * 2 * cfg["n_head"] * ctx * ctx * head / 2 * (passes + 1.5) * L
    return (ctx * per_token * L * passes + attn + 2 * 2 * ctx * C * V) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama2-7b,llama3-8b")
    ap.add_argument("--ctx", default="512,2048")
    ap.add_argument("--mode", default="layer")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llamatune-real"))
    ap.add_argument("--compute-dtype", default="f32", help="f32, bf16, or both alternately (f32,bf16)")
    ap.add_argument("--layers", type=int, default=0, help="write and run only the first N layers (0: all)")
    ap.add_argument("--rounds", type=int, default=1, help="run the (shape, dtype) list this many times, "
                    "alternating (timings on a shared machine)")
    ap.add_argument("--expert-rank", type=int, default=R, help="rank of the per-expert adapters of an MoE shape "
                    "(0: none, as --no-lora-experts)")
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(Path(a.one[0]), int(a.one[1]), a.one[2], a.steps, a.one[3], a.expert_rank)))
        return
    a.workdir.mkdir(parents=True, exist_ok=True)
    print(f"batch 1, LoRA r {R} on {','.join(TARGETS)}, experts r {a.expert_rank}, mode {a.mode}; {os.cpu_count()} CPUs; GiB, seconds")
    print(f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"{'shape':12} {'ctx':>5} {'dtype':4} {'estimate':>8} {'peak RSS':>8} {'est/peak':>8} {'s/step':>12} {'tok/s':>6} "
          f"{'GFLOP/s':>8} {'sgemm':>6} {'share':>6}")
    paths = {}
    for shape in a.shapes.split(","):
        paths[shape] = model_path(a.workdir, shape, a.layers)
        t = time.perf_counter()
        build(paths[shape], shape, a.layers)
        print(f"# {paths[shape]} ready ({time.perf_counter() - t:.0f} s)", flush=True)
    for _ in range(a.rounds):
        for ctx in map(int, a.ctx.split(",")):
            for dtype in a.compute_dtype.split(","):
                for shape, path in paths.items():
                    report(a, shape, path, ctx, dtype)


def report(a, shape: str, path: Path, ctx: int, dtype: str) -> None:
    out = subprocess.run([sys.executable, __file__, "--steps", str(a.steps), "--expert-rank", str(a.expert_rank), "--one", str(path), str(ctx), a.mode,
                          dtype], capture_output=True, text=True)
    if out.returncode:
        print(f"{shape:12} {ctx:5} {dtype} failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)
        return
    r = json.loads(out.stdout.strip().splitlines()[-1])
    g = 2**30
    if not r["step_s"]:                     # --steps 0: the estimate alone
        print(f"{shape:12} {ctx:5} {dtype:4} {r['estimate'] / g:8.2f}  (runtime {r['runtime'] / g:.2f}, "
              f"graph {r['graph'] / g:.2f}, model {r['model'] / g:.2f}; no step run)", flush=True)
        return
    steps = "/".join(f"{s:.0f}" for s in r["step_s"])
    rate = step_gflop(shape_config(shape, a.layers), ctx, a.mode) / r["step_s"][-1]
    print(f"{shape:12} {ctx:5} {dtype:4} {r['estimate'] / g:8.2f} {r['peak'] / g:8.2f} {r['estimate'] / r['peak']:8.1%} "
          f"{steps:>12} {ctx / r['step_s'][-1]:6.1f} {rate:8.1f} {r['sgemm_gflops']:6.1f} "
          f"{rate / r['sgemm_gflops']:6.1%}  "
          f"(runtime {r['runtime'] / g:.2f}, graph {r['graph'] / g:.2f}, model {r['model'] / g:.2f}, "
          f"CPU {r['cpu_s'][-1]:.1f} s/step ({ctx / r['cpu_s'][-1]:.1f} tok per CPU-s), load {r['load_s']:.0f} s, loss {r['loss']:.3f}, load average {os.getloadavg()[0]:.1f})", flush=True)

if __name__ == "__main__":
    main()
