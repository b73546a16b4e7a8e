"""Benchmark: LoRA training of a Llama-7B-shaped model on one NVIDIA GPU, llamatune
(`--device cuda`) against PyTorch + PEFT on the same GPU.

Every configuration runs in a fresh process (memory figures are its own):
  llamatune   random-weight GGUF base in Q4_K / Q8_0 (written once into --workdir by
              llamatune's own writer), LoRA r=8, alpha 8 on q,k,v,o,gate,up,down, AdamW with
              gradient clipping, checkpointing modes (--ckpt) layer / selective / none; --modes:
              matmuls in fp32 (CuPy's default cuBLAS sgemm), tf32 (CUPY_TF32=1, tensor cores)
              and/or bf16 (--compute-dtype bf16: the base dequantized to bf16, its products
              through cublasGemmEx on tensor cores with float32 sums; the rest in TF32).
  torch+peft  transformers.LlamaForCausalLM of the same shape, random bf16 / fp32 weights (tf32:
              fp32 weights, TF32 matmuls), peft LoraConfig(r=8, lora_alpha=8, same targets),
              AdamW + clip_grad_norm_, its gradient checkpointing (each decoder layer's input
              kept: llamatune's `layer`) or none; skipped if not installed.
One warm-up step (numba JIT, weight upload), then --steps timed steps, the device synchronized
before each clock reading. Reported: tokens/s; step time; peak GPU memory (CuPy pool bytes or
torch.cuda.max_memory_allocated, and the driver's used memory: CUDA context and other processes
included), and for llamatune the GPU memory estimate finetune prints (`est GB`, to hold against
`alloc GB`); model GFLOP/s (the step's matmuls, recomputation not counted) and its share of the
matmul rate measured on this GPU in the same precision for an (N, C) x (C, F) product.

On a GPU machine (CUDA 12 driver):
    pip install -e ".[cuda]"                   # numba-cuda[cu12], cupy-cuda12x
    pip install torch transformers peft        # optional baseline
    python bench/gpu_finetune.py [--shape 7b|llama3-8b] [--steps 5] [--ctx 512] [--batch 4] [--types q4_k,q8_0]
        [--modes fp32,tf32,bf16] [--ckpt layer,selective,none] [--torch bf16,fp32] [--layers N]
        [--out results.json] [--profile]
The full sizes of #49: `--shape 7b --types q4_k --modes bf16 --ckpt layer` (ctx 512 x 4) and
`--shape llama3-8b` (Llama-3-8B: vocabulary 128k, GQA 8; ctx 4096 x 1, Q4_K, bf16), PyTorch +
PEFT bf16 beside each.
Expected runtime (H100/H200, 16 cores): writing the 7B GGUFs takes ~5-10 min once (3.9 + 7.2 GB
in --workdir); then ~1 min per configuration (load, JIT, 1 + 5 steps): ~15 min for the default
8 llamatune + 4 torch runs. `--layers 4` is a quick check of a few minutes.

Smoke test without a GPU (numba's CUDA simulator, numpy as device memory, tiny Q8_0 model, ~3 min):
    NUMBA_ENABLE_CUDASIM=1 python bench/gpu_finetune.py --shape tiny --steps 1
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

SHAPES = {
    "7b": dict(arch="llama", n_vocab=32000, n_ctx_train=4096, n_embd=4096, n_layer=32, n_ff=11008,
               n_head=32, n_head_kv=32, head_dim=128, n_rot=128, norm_eps=1e-5),
    # Llama-3-8B: vocabulary 128k, GQA 8 (its rope base; the bench's weights are random)
    "llama3-8b": dict(arch="llama", n_vocab=128256, n_ctx_train=8192, n_embd=4096, n_layer=32, n_ff=14336,
                      n_head=32, n_head_kv=8, head_dim=128, n_rot=128, norm_eps=1e-5, rope_freq_base=500000.0),
    # simulator-sized (it runs ~1e3 dequantized values/s): Q8_0 blocks fit, Q4_K's 256 do not
    "tiny": dict(arch="llama", n_vocab=32, n_ctx_train=64, n_embd=32, n_layer=1, n_ff=32,
                 n_head=2, n_head_kv=1, head_dim=16, n_rot=16, norm_eps=1e-5),
}
DEFAULTS = {"7b": dict(ctx=512, batch=4, types="q4_k,q8_0", modes="fp32,tf32"),
            "llama3-8b": dict(ctx=4096, batch=1, types="q4_k", modes="bf16"),
            "tiny": dict(ctx=4, batch=2, types="q8_0", modes="fp32")}
R = 8
TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# --------------------------------------------------------------------------- model files
def build(path: Path, shape: dict, qtype_name: str, seed: int = 0) -> None:
    """Stream a random-weight model to `path`, one tensor in memory at a time: each tensor
    drawn from its own seeded generator (reproducible), quantized by llamatune's writer."""
    if path.exists():
        return
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from llamatune.models.config import ModelConfig
    from llamatune.formats.gguf_io import TensorOut, kv, write_gguf
    from llamatune.models.writer import FILE_TYPE, encode_tensor, fit_type, parse_outtype, tensor_names
    from finetune_step import dummy_vocab       # bench/ is sys.path[0] when run as a script
    cfg, qtype, t0 = ModelConfig(**shape), parse_outtype(qtype_name), time.perf_counter()
    fallback = []

    def lazy(name: str, dims: tuple) -> TensorOut:
        q = Q.F32 if len(dims) == 1 else fit_type(dims[-1], qtype)
        if q != qtype and len(dims) > 1:
            fallback.append(name)

        def make():
            if name.endswith("norm.weight"):
                data = np.ones(dims, np.float32)
            else:
                data = np.random.default_rng([seed, zlib.crc32(name.encode())]).standard_normal(dims, np.float32)
                out_proj = name.endswith(("attn_output.weight", "ffn_down.weight"))
                data *= np.float32(0.02 / np.sqrt(2 * cfg.n_layer) if out_proj else 0.02)
            data = encode_tensor(name, data, q).make()
            if name.endswith("ffn_down.weight") or name == "output.weight":
                print(f"  {name} done, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            return data
        return TensorOut(name, tuple(dims), q, make)

    kvs = [kv("general.type", "model"), kv("general.name", "llamatune gpu bench"),
           *[kv(k, v) for k, v in cfg.metadata().items()], kv("general.file_type", FILE_TYPE.get(qtype, 0)),
           kv("general.quantization_version", 2), *dummy_vocab(cfg.n_vocab)]
    print(f"writing {path} ({qtype.name}, {cfg.n_layer} layers) ...", file=sys.stderr, flush=True)
    write_gguf(path, cfg.arch, kvs, [lazy(n, s) for n, s in tensor_names(cfg).items()])
    if fallback:
        print(f"  note: {len(fallback)} matrices do not fit {qtype.name} blocks: written as Q8_0/F16", file=sys.stderr)
    print(f"  done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def step_flops(s: dict, B: int, T: int) -> float:
    """Matmul FLOPs of one step: forward and backward-dx of the frozen weights, LoRA
    (forward, dA, dB, dx), causal attention (2 products forward, 5 backward), the head."""
    N, C, F = B * T, s["n_embd"], s["n_ff"]
    q, kv = s["n_head"] * s["head_dim"], s["n_head_kv"] * s["head_dim"]
    mats = [(q, C), (kv, C), (kv, C), (C, q), (F, C), (F, C), (C, F)]
    per_layer = sum(2 * N * o * i * 2 + 2 * N * R * (o + i) * 3 for o, i in mats)
    per_layer += 2 * 2 * B * s["n_head"] * T * T * s["head_dim"] / 2 * 3.5
    return s["n_layer"] * per_layer + 2 * N * C * s["n_vocab"] * 2


# --------------------------------------------------------------------------- one configuration
def timed(step, sync, mem, steps: int) -> dict:
    """Warm-up step then `steps` timed steps; memory sampled after each (max kept)."""
    import statistics
    times, losses, peak = [], [], [None, None]
    for i in range(steps + 1):
        sync()
        t = time.perf_counter()
        loss = step(i)
        sync()
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
        peak = [v if p is None else max(p, v) for p, v in zip(peak, mem())]
    return {"step_s": statistics.median(times[1:]), "first_step_s": times[0], "loss": losses[-1],
            "peak_alloc_gb": peak[0] and peak[0] / 2**30, "peak_driver_used_gb": peak[1] and peak[1] / 2**30}


def matmul_gflops(mm, sync, reps: int, flop: float) -> float:
    mm()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        mm()
    sync()
    return reps * flop / (time.perf_counter() - t) / 1e9


def compute_kwargs(dtype: str, backend) -> dict:
    """How the graph and the planner are told the products' precision: the run's compute policy
    (precision.policy, as finetune makes it), or an earlier llamatune's `compute_dtype` (BASE_WHL)."""
    try:
        from llamatune.precision import policy
    except ImportError:
        return {"compute_dtype": dtype}
    return {"policy": policy(dtype, backend.name, capability=backend.capability)}


def run_llamatune(spec: dict) -> dict:
    import llamatune  # noqa: F401  (first: threading policy)
    import numpy as np
    from llamatune.backend import get_backend
    from llamatune.train.step import StepExecutor
    from llamatune.train.lora import init_lora, lora_specs, lora_targets
    from llamatune.models.model import Model
    from llamatune.train.optimizer import optimizer_step
    from llamatune.options import FinetuneOptions
    from llamatune.train.params import ParamBuffer
    from llamatune.models.weights import FrozenBase
    dtype = spec.get("compute_dtype", "f32")
    backend = get_backend("cuda", tf32=spec.get("tf32", False) or dtype == "bf16")   # CuPy's compute type
    xp = backend.xp
    if backend.on_host:                       # the simulator: numpy arrays are the device memory
        sync, mem, gpu = (lambda: None), (lambda: (None, None)), "numba CUDA simulator (numpy)"
    else:
        pool, gpu = xp.get_default_memory_pool(), xp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        sync = xp.cuda.Device().synchronize

        def mem():
            free, total = xp.cuda.runtime.memGetInfo()
            return pool.total_bytes(), total - free
    B, T = spec["batch"], spec["ctx"]
    model = Model(spec["model"])
    cfg = model.config
    targets = lora_targets(cfg, {k: R for k in TARGETS}, float(R), tied=False)
    params = ParamBuffer(lora_specs(targets))
    init_lora(params, targets, np.random.default_rng(0))
    params.to_device(backend)
    base = FrozenBase(model, backend)
    estimate = None
    if not backend.on_host:                   # the GPU memory estimate finetune prints (an earlier
        try:                                  # llamatune has none)
            from llamatune.train.memory import Planner, device_runtime_bytes
            estimate = Planner(cfg, targets, base, device_runtime_bytes(backend), Path(spec["model"]).stat().st_size,
                               model.dequantizer.nbytes, 0.0, device=True,
                               **compute_kwargs(dtype, backend)).estimate(B, T, spec["ckpt"]).total
        except ImportError:
            pass
    executor = StepExecutor(cfg, base, params, targets, B, T, spec["ckpt"], backend=backend, **compute_kwargs(dtype, backend))
    inputs, labels = np.random.default_rng(1).integers(0, cfg.n_vocab, (2, B, T))
    w = np.full((B, T), 1.0 / (B * T), np.float32)
    opts = FinetuneOptions(warmup=1)

    def step(i):
        params.zero_grad()
        loss = executor.step(inputs, labels, w, (0, i, 0))
        optimizer_step(params, i, opts)
        return loss
    res = timed(step, sync, mem, spec["steps"])
    if spec.get("profile"):                      # three more steps split into phases
        from phases import device_clock, profile_steps
        res["profile"] = profile_steps(executor, params, inputs, labels, w, spec["steps"] + 1, opts,
                                       device_clock(sync))
    rng, (N, C, F) = np.random.default_rng(2), (B * T, cfg.n_embd, cfg.n_ff)
    a, wt = (backend.to_device(rng.standard_normal(s, np.float32)) for s in ((N, C), (F, C)))
    out = xp.empty((N, F), np.float32)
    mm = lambda: xp.matmul(a, wt.T, out=out)  # noqa: E731
    if dtype == "bf16":                       # the rate of the products' own bf16 kernel
        a16, w16 = xp.empty(a.shape, np.uint16), xp.empty(wt.shape, np.uint16)
        backend.ops.bf16.to_bf16(a16, a)
        backend.ops.bf16.to_bf16(w16, wt)
        mm = lambda: backend.ops.bf16.gemm_bf16(out, a16, w16.T)  # noqa: E731
    rate = matmul_gflops(mm, sync, 3 if backend.on_host else 20, 2 * N * C * F)
    return res | {"matmul_ref_gflops": rate, "gpu": gpu, "activations_gb": executor.activation_bytes() / 2**30,
                  "estimate_gb": estimate and estimate / 2**30}


def run_torch(spec: dict) -> dict:
    import torch
    if not torch.cuda.is_available():
        return {"skipped": "torch sees no CUDA device"}
    import peft
    import transformers
    s, dt, B, T = spec["shape"], spec["dtype"], spec["batch"], spec["ctx"]
    dtype = torch.bfloat16 if dt == "bf16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = dt == "tf32"
    hf = transformers.LlamaConfig(
        vocab_size=s["n_vocab"], hidden_size=s["n_embd"], intermediate_size=s["n_ff"], num_hidden_layers=s["n_layer"],
        num_attention_heads=s["n_head"], num_key_value_heads=s["n_head_kv"], max_position_embeddings=s["n_ctx_train"],
        rms_norm_eps=s["norm_eps"], rope_theta=s.get("rope_freq_base", 10000.0), tie_word_embeddings=False,
        use_cache=False)
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with torch.device("cuda"):                  # random init on the GPU, straight in `dtype`
        model = transformers.LlamaForCausalLM(hf)
    torch.set_default_dtype(torch.float32)
    if spec["ckpt"] != "none":            # HF checkpointing keeps each layer's input: `layer`
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = peft.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=R, lora_dropout=0.0,
                                                       target_modules=HF_TARGETS, task_type="CAUSAL_LM"))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.1)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids, labels = torch.randint(0, s["n_vocab"], (2, B, T), device="cuda", generator=gen)

    def step(i):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def mem():
        free, total = torch.cuda.mem_get_info()
        return torch.cuda.max_memory_allocated(), total - free
    torch.cuda.reset_peak_memory_stats()
    res = timed(step, torch.cuda.synchronize, mem, spec["steps"])
    N, C, F = B * T, s["n_embd"], s["n_ff"]
    a, wt = torch.randn(N, C, dtype=dtype, device="cuda"), torch.randn(F, C, dtype=dtype, device="cuda")
    rate = matmul_gflops(lambda: a @ wt.T, torch.cuda.synchronize, 20, 2 * N * C * F)
    return res | {"matmul_ref_gflops": rate, "gpu": torch.cuda.get_device_name(),
                  "attn": getattr(model.config, "_attn_implementation", None)}


def run_child(spec: dict, env: dict) -> dict:
    p = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True,
                       env={**os.environ, **env})
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()][-3:]
        return {"error": f"exit {p.returncode}: " + " | ".join(tail)}


# --------------------------------------------------------------------------- driver
MODE_ENV = {"fp32": {}, "tf32": {"CUPY_TF32": "1"}, "bf16": {"CUPY_TF32": "1"}}   # and spec: get_backend sets it
MODE_DTYPE = {"fp32": "f32", "tf32": "tf32", "bf16": "bf16"}
COLS = [("tok/s", "tokens_per_s", "8.1f"), ("step s", "step_s", "7.3f"), ("1st s", "first_step_s", "6.1f"),
        ("est GB", "estimate_gb", "6.2f"), ("alloc GB", "peak_alloc_gb", "8.2f"),
        ("driver GB", "peak_driver_used_gb", "9.2f"),
        ("GFLOP/s", "gflops", "8.4g"), ("mm GFLOP/s", "matmul_ref_gflops", "10.4g"), ("share", "share", "6.1%"),
        ("loss", "loss", "6.3f")]


def row_text(r: dict) -> str:
    head = f"{r['impl']:10} {r['weights']:6} {r['mode']:6} {r['ckpt']:9}"
    if "error" in r or "skipped" in r:
        return f"{head} " + (f"error: {r['error'][:200]}" if "error" in r else f"skipped: {r['skipped']}")
    return " ".join([head] + ["-".rjust(int(f.split(".")[0])) if r.get(k) is None else format(r[k], f)
                              for _, k, f in COLS])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="7b")
    ap.add_argument("--layers", type=int, help="override the layer count (quick checks)")
    ap.add_argument("--ctx", type=int, help="tokens per sample (7b: 512, llama3-8b: 4096, tiny: 4)")
    ap.add_argument("--batch", type=int, help="samples per step (7b: 4, llama3-8b: 1, tiny: 2)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up step")
    ap.add_argument("--types", help="llamatune base quant types (7b: q4_k,q8_0; tiny: q8_0)")
    ap.add_argument("--modes", help="llamatune matmul precision: fp32, tf32, bf16 (7b: fp32,tf32; tiny: fp32)")
    ap.add_argument("--ckpt", default="layer,none",
                    help="checkpointing modes: layer, selective, none (on = selective, off = none); "
                         "torch+peft runs layer (its gradient checkpointing) and none")
    ap.add_argument("--torch", default="bf16,fp32", help="torch+peft dtypes: bf16, fp32, tf32 ('' skips)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llamatune-gpu-bench"))
    ap.add_argument("--out", type=Path, help="JSON results (default: WORKDIR/results-SHAPE.json)")
    ap.add_argument("--profile", action="store_true",
                    help="llamatune rows: where a step's time goes, by phase (device synchronized around each)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    modes = (a.modes or DEFAULTS[a.shape]["modes"]).split(",")
    if a.steps < 1 or any(m not in MODE_ENV for m in modes):
        ap.error("--steps must be >= 1; --modes are fp32, tf32, bf16")
    if a.one:
        spec = json.loads(a.one)
        try:
            res = run_llamatune(spec) if spec["kind"] == "llamatune" else run_torch(spec)
        except Exception as e:  # noqa: BLE001  (OOM and friends become a row, not a crash)
            res = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(res))
        return
    d = DEFAULTS[a.shape]
    shape = dict(SHAPES[a.shape], **({"n_layer": a.layers} if a.layers else {}))
    B, T = a.batch or d["batch"], a.ctx or d["ctx"]
    a.out = a.out or a.workdir / f"results-{a.shape}.json"
    ckpts = [{"on": "selective", "off": "none"}.get(c, c) for c in a.ckpt.split(",") if c]
    if any(c not in ("layer", "selective", "none") for c in ckpts):
        ap.error("--ckpt takes layer, selective, none (on, off)")
    flops = step_flops(shape, B, T)
    gpu = "numba CUDA simulator" if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0") else None
    if gpu is None and shutil.which("nvidia-smi"):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    report = {"gpu": gpu, "shape": shape, "ctx": T, "batch": B, "rank": R, "steps": a.steps,
              "step_gflop": flops / 1e9, "results": []}
    print(f"GPU: {gpu}; model {a.shape} ({shape['n_layer']} layers); LoRA r={R} on {','.join(TARGETS)}; "
          f"ctx {T}, batch {B}; {flops / 1e9:.4g} GFLOP per step (matmuls)", flush=True)
    widths = [n.rjust(int(f.split(".")[0])) for n, _, f in COLS]
    print(" ".join([f"{'impl':10} {'weights':6} {'mode':6} {'ckpt':9}", *widths]), flush=True)

    def record(r: dict, spec: dict, **labels) -> None:
        r = labels | {"ckpt": spec["ckpt"]} | r
        if "step_s" in r:
            r |= {"tokens_per_s": B * T / r["step_s"], "gflops": flops / r["step_s"] / 1e9}
            r["share"] = r["gflops"] / r["matmul_ref_gflops"]
        report["results"].append(r)
        print(row_text(r), flush=True)
        a.out.write_text(json.dumps(report, indent=1))

    common = dict(ctx=T, batch=B, steps=a.steps)
    a.workdir.mkdir(parents=True, exist_ok=True)
    for qtype in (a.types or d["types"]).split(","):
        path = a.workdir / f"{a.shape}-L{shape['n_layer']}.{qtype}.gguf"
        build(path, shape, qtype)
        for mode in modes:
            for ck in ckpts:
                spec = dict(common, kind="llamatune", model=str(path), ckpt=ck, profile=a.profile,
                            tf32=mode == "tf32", compute_dtype=MODE_DTYPE[mode])
                r = run_child(spec, MODE_ENV[mode])
                record(r, spec, impl="llamatune", weights=qtype, mode=mode)
                if "profile" in r:
                    print(r["profile"], flush=True)
    missing = [m for m in ("torch", "transformers", "peft") if importlib.util.find_spec(m) is None]
    dtypes = [t for t in a.torch.split(",") if t]
    if any(t not in ("bf16", "fp32", "tf32") for t in dtypes):
        ap.error(f"--torch takes bf16, fp32, tf32 (or '' to skip), got {a.torch!r}")
    if dtypes and missing:
        print(f"torch+peft baseline skipped: {', '.join(missing)} not installed", flush=True)
    elif dtypes:
        for dt in dtypes:
            for ck in [c for c in ckpts if c != "selective"]:
                spec = dict(common, kind="torch", shape=shape, dtype=dt, ckpt=ck)
                record(run_child(spec, {}), spec, impl="torch+peft", weights=dt, mode=dt)
    print(f"results: {a.out}", flush=True)


if __name__ == "__main__":
    main()
