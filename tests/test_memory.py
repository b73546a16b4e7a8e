"""Memory: the graph allocates exactly the buffers its plan lists (what the estimate
counts), layer mode keeps only one (N, C) input per layer, `auto` picks the fastest
mode that fits, a run that fits in no mode is refused with what would fit, and the
old --use-checkpointing spelling still works."""
from __future__ import annotations

import numpy as np
import pytest

from llamatune.errors import LlamatuneError
from llamatune.models.weights import FrozenBase
from llamatune.train.buffers import buffer_plan, plan_bytes
from llamatune.train.step import StepExecutor
from llamatune.train.params import DenseWeights
from llamatune.train.lora import init_lora, lora_specs, lora_targets
from llamatune.train.memory import Planner, gib
from llamatune.models.model import Model
from llamatune.options import FinetuneOptions, build_options
from llamatune.train.params import ParamBuffer, ParamSpec
from llamatune.models.writer import tensor_names

from conftest import tiny_config

RANKS = {k: 2 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                        "token_embd", "output", "attn_norm")}


def graph_arrays(g: StepExecutor) -> list[np.ndarray]:
    """Every distinct buffer the graph holds, found by walking its attributes (a view,
    e.g. of the shared gradient / logits buffer, counts as the buffer it views)."""
    found: dict[int, np.ndarray] = {}

    def add(v):
        while isinstance(v, np.ndarray) and v.base is not None:
            v = v.base
        if isinstance(v, np.ndarray) and id(v) not in found:
            found[id(v)] = v
    for name, v in vars(g).items():
        if name == "rope_host":                   # the host copy the per-token tables of packed rows come from
            continue
        add(v)
        for w in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else []):
            for a in (w if isinstance(w, tuple) else (w,)):
                add(a)
    for a in g.layers:                            # the layer's stream and each part's activations
        for v in [a.x, a.x_mid, *vars(a.mixer).values(), *vars(a.ffn).values()]:
            add(v)
    return list(found.values())


@pytest.fixture(scope="module")
def model(tiny_model):
    return Model(tiny_model)


@pytest.mark.parametrize("mode", ["layer", "selective", "none"])
def test_allocated_buffers_are_the_plan(model, mode):
    cfg = model.config
    targets = lora_targets(cfg, RANKS, 2.0, tied=False)
    params = ParamBuffer(lora_specs(targets))
    base = FrozenBase(model)
    g = StepExecutor(cfg, base, params, targets, 3, 16, mode)
    plan = buffer_plan(cfg, targets, 3, 16, mode, base.head_rows, False)
    arrays = graph_arrays(g)                      # the arena and the rope tables, nothing else
    assert sum(a.nbytes for a in arrays) == plan_bytes(plan) == g.activation_bytes()
    assert {name: a.shape for name, a in g.buffers.items()} == plan
    ropes = [name for name in plan if name.startswith("rope_")]
    assert len(arrays) == 1 + len(ropes) and all(any(g.buffers[r] is a for a in arrays) for r in ropes)
    spans = sorted((a.__array_interface__["data"][0], a.nbytes) for name, a in g.buffers.items()
                   if name not in ropes)          # the other buffers tile the arena, none overlapping
    start = g.arena.__array_interface__["data"][0]
    assert [s for s, _ in spans] == list(np.cumsum([start] + [n for _, n in spans[:-1]]))
    assert sum(n for _, n in spans) == g.arena.nbytes


def test_dense_graph_allocates_its_plan():
    cfg = tiny_config(n_layer=3)
    params = ParamBuffer([ParamSpec(n, s) for n, s in tensor_names(cfg).items()])
    g = StepExecutor(cfg, DenseWeights(params), params, [], 2, 8, "layer")
    assert sum(a.nbytes for a in graph_arrays(g)) == g.activation_bytes() == \
        plan_bytes(buffer_plan(cfg, [], 2, 8, "layer", cfg.n_vocab, True))


def test_layer_mode_keeps_one_input_per_layer():
    """Only the layer inputs scale with layers x tokens: one more layer costs N*C floats."""
    targets_of = lambda cfg: lora_targets(cfg, RANKS, 2.0, tied=False)  # noqa: E731
    B, T = 2, 32
    sizes = {}
    for L in (2, 5):
        cfg = tiny_config(n_layer=L)
        sizes[L] = {m: plan_bytes(buffer_plan(cfg, targets_of(cfg), B, T, m, 64, False))
                    for m in ("layer", "selective", "none")}
    per_layer = {m: (sizes[5][m] - sizes[2][m]) // 3 for m in sizes[2]}
    cfg = tiny_config()
    assert per_layer["layer"] == B * T * cfg.n_embd * 4
    assert per_layer["layer"] < per_layer["selective"] < per_layer["none"]


def planner(model, runtime=100 << 20):
    cfg = model.config
    targets = lora_targets(cfg, RANKS, 2.0, tied=False)
    return Planner(cfg, targets, FrozenBase(model), runtime, model.path.stat().st_size,
                   model.dequantizer.nbytes, 0.0)


def test_auto_picks_the_fastest_mode_that_fits(model):
    p = planner(model)
    e = {m: p.estimate(4, 64, m) for m in ("none", "selective", "layer")}
    assert e["layer"].total < e["selective"].total < e["none"].total
    assert e["none"].total == e["none"].runtime + e["none"].added
    assert p.choose(4, 64, "auto", e["none"].added).mode == "none"
    assert p.choose(4, 64, "auto", e["none"].added - 1).mode == "selective"
    assert p.choose(4, 64, "auto", e["selective"].added - 1).mode == "layer"
    assert p.choose(4, 64, "auto", 0).mode == "layer"
    assert p.choose(4, 64, "selective", 0).mode == "selective"


def test_refusal_says_what_would_fit(model, tmp_path, monkeypatch):
    p = planner(model)
    need = p.estimate(4, 64, "none").added
    hint = p.what_fits(4, 64, "none", need - 1)
    assert hint.startswith("would fit: --checkpointing layer")
    assert "--ctx 32" in hint and "--batch 3" in hint
    assert p.what_fits(4, 64, "none", 0) == "nothing smaller fits either"

    import llamatune.train.trainer as trainer
    from llamatune.commands.finetune import finetune
    from conftest import TEXT
    data = tmp_path / "d.txt"
    data.write_text(TEXT)
    monkeypatch.setattr(trainer, "free_memory", lambda backend: 20000)
    o = FinetuneOptions(model_base=model.path, train_data=data, ctx=32, batch=2, adam_iter=1,
                        checkpointing="none", checkpoint_out=tmp_path / "c-ITERATION.gguf",
                        lora_out=tmp_path / "a-ITERATION.gguf")
    with pytest.raises(LlamatuneError, match=r"^training needs about [\d.]+ GiB but only 0.00 GiB is available "
                                             r"\(besides [\d.]+ GiB in use; --checkpointing none\): "):
        finetune(o, quiet=True)


def test_dry_run_reports_every_mode_and_writes_nothing(model, tmp_path, monkeypatch):
    """--dry-run: one line per mode (the planner's own estimates), the mode auto takes,
    what a save writes; no step, no file; and when nothing fits, what would."""
    import re
    import llamatune.train.trainer as trainer
    from typer.testing import CliRunner
    from llamatune.cli.main import app
    from conftest import TEXT
    (tmp_path / "d.txt").write_text(TEXT)
    (tmp_path / "m.gguf").write_bytes(model.path.read_bytes())      # its own file: the module's model
    steps = []                                                        # stays the only mapping of that one
    monkeypatch.setattr(StepExecutor, "step", lambda *a, **k: steps.append(1))
    args = ["finetune", "--model-base", str(tmp_path / "m.gguf"), "--train-data", str(tmp_path / "d.txt"), "-c", "32",
            "-b", "2", "--checkpoint-out", str(tmp_path / "out/c-ITERATION.gguf"),
            "--lora-out", str(tmp_path / "out/a-ITERATION.gguf"), "--output-dir", str(tmp_path / "out"), "--dry-run"]
    made = []

    class Seen(Planner):                                              # the run's own planner
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)
    monkeypatch.setattr(trainer, "Planner", Seen)
    free = {}
    monkeypatch.setattr(trainer, "free_memory", lambda backend: free["bytes"])
    free["bytes"] = 1 << 40
    assert CliRunner().invoke(app, args).exit_code == 0
    p = made[-1]
    e = {m: p.estimate(2, 32, m) for m in ("layer", "selective", "none")}
    free["bytes"] = e["selective"].added
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    e = {m: made[-1].estimate(2, 32, m) for m in e}                  # (its runtime measured again)
    assert lines[0] == "dry run: nothing trained or written"
    assert lines[1:4] == [f"  {e['layer'].describe()}  fits", f"  {e['selective'].describe()}  fits",
                          f"  {e['none'].describe()}  does not fit"]
    assert re.fullmatch(r"  available [\d.]+ GiB: --checkpointing auto picks selective", lines[4])
    assert lines[5] == (f"  of the selective estimate: the model file {gib(e['selective'].model)}, mapped and read "
                        f"in place; the run's own memory {gib(e['selective'].total - e['selective'].model)}")
    size = r"[\d.]+ [KM]iB"
    assert re.fullmatch(rf"  each save writes {size}: c-ITERATION.gguf {size}, c-LATEST.gguf {size}, "
                        rf"a-ITERATION.gguf {size}, a-LATEST.gguf {size}, a-ITERATION.imatrix.gguf {size}, "
                        rf"a-LATEST.imatrix.gguf {size}", lines[6])
    assert steps == [] and sorted(f.name for f in tmp_path.iterdir()) == ["d.txt", "m.gguf"]
    free["bytes"] = e["layer"].added - 1
    r = CliRunner().invoke(app, args + ["--checkpointing", "none"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[4].endswith("no mode fits; " + made[-1].what_fits(2, 32, "none", free["bytes"]))
    assert steps == [] and sorted(f.name for f in tmp_path.iterdir()) == ["d.txt", "m.gguf"]


def test_checkpointing_option_and_its_old_spelling(tmp_path):
    assert FinetuneOptions().checkpointing_mode() == "auto"
    assert build_options(FinetuneOptions, {"use_checkpointing": True}).checkpointing_mode() == "selective"
    assert build_options(FinetuneOptions, {"use_checkpointing": False}).checkpointing_mode() == "none"
    assert build_options(FinetuneOptions, {"use_checkpointing": False,
                                           "checkpointing": "layer"}).checkpointing_mode() == "layer"
    preset = tmp_path / "p.toml"
    preset.write_text("use_checkpointing = true\n")              # older presets and checkpoints
    assert build_options(FinetuneOptions, {}, preset).checkpointing_mode() == "selective"
    with pytest.raises(LlamatuneError, match=r"^--checkpointing 'some': choose auto, layer, selective, none$"):
        build_options(FinetuneOptions, {"checkpointing": "some"})


def test_resident_bytes_counts_touched_pages_and_the_model_file(model):
    import mmap
    from llamatune.train.memory import resident_bytes, touch
    region = mmap.mmap(-1, 64 << 20)                         # fresh zero pages: not resident until written
    a = np.frombuffer(region, np.uint8)
    before, _ = resident_bytes()
    touch(a)
    after, _ = resident_bytes()
    assert after - before >= 60 << 20
    t = model.weights.layers[0].mats["attn_q"]
    float(np.asarray(t.data, np.float32).sum())              # read the tensor's pages
    total, in_model = resident_bytes(model.path)
    assert t.nbytes <= in_model <= model.path.stat().st_size + 4096 and total > in_model
    assert resident_bytes(model.path.parent / "elsewhere.gguf")[1] == 0


@pytest.mark.parametrize("arch,dtype", [("llama", "f32"), ("gemma2", "f32"), ("llama", "bf16")])
def test_the_warm_up_compiles_every_kernel_a_run_uses(tmp_path, tiny_vocab, arch, dtype):
    """After compile_kernels, a LoRA step and an evaluation on a quantized model (packed
    rows, read-only memory-mapped weights; gemma2: GeGLU, soft-caps, post norms; bf16:
    the CPU's bf16 products, attention and oneDNN adapter kernels) add no numba
    specialization: nothing is compiled or loaded after the runtime was measured."""
    from gguf import GGMLQuantizationType as QType
    from numba.core.registry import CPUDispatcher
    from conftest import write_tiny_model
    from llamatune import precision
    from llamatune.backend import cpu
    from llamatune.kernels import attention_bf16, bf16, dequant, lora
    from llamatune.train.step import compile_kernels
    if dtype == "bf16" and not (bf16.cpu_bf16_flags() and bf16.available()):
        pytest.skip("this CPU has no native bf16 or oneDNN is not installed")
    policy = precision.policy(dtype)
    family = dict(attn_softcap=1.5, final_softcap=2.5, sliding_window=3, swa_pattern=2) if arch == "gemma2" else {}
    m = Model(write_tiny_model(tmp_path / "q.gguf", tiny_vocab, QType.Q8_0, arch=arch, n_layer=3, **family))
    backend = cpu()
    compile_kernels(backend, FinetuneOptions(pack=True), {t.qtype for t in FrozenBase(m).tensors.values()}, m.config,
                    policy)
    modules = dict(vars(backend.ops), bf16=bf16, attention_bf16=attention_bf16, dequant_bf16=dequant, lora=lora)

    def signatures():
        return {(op, name): len(k.signatures) for op, mod in modules.items()
                for name, k in vars(mod).items() if isinstance(k, CPUDispatcher)}
    before = signatures()
    cfg = m.config
    tied = m.weights.output is m.weights.token_embd
    targets = lora_targets(cfg, {k: r for k, r in RANKS.items() if not tied or k not in ("output", "token_embd")},
                           2.0, tied=tied)
    params = ParamBuffer(lora_specs(targets))
    init_lora(params, targets, np.random.default_rng(0))
    T = 8 if dtype == "f32" else 16                   # bf16: attention_bf16's least rows
    g = StepExecutor(cfg, FrozenBase(m), params, targets, 2, T, "layer", policy=policy)
    ids = np.random.default_rng(1).integers(0, cfg.n_vocab, (2, T))
    w = np.full((2, T), 1 / (2 * T), np.float32)
    half = T // 2
    positions = np.tile(np.r_[0:half, 0:half], (2, 1))
    segments = np.tile(np.r_[[0] * half, [1] * half], (2, 1)).astype(np.int32)
    g.step(ids, ids, w, (0, 1, 0), positions, segments)
    g.loss(ids, ids, w)
    assert signatures() == before
    assert sum(before.values()) > 10


@pytest.mark.parametrize("kernels", ["attention", "attention_bf16"])
@pytest.mark.parametrize("shape", [(8, 256, 8, 4, 64), (2, 128, 14, 2, 64), (3, 40, 6, 2, 16)])
def test_attention_scratch_is_what_its_workers_allocate(kernels, shape, monkeypatch):
    """scratch_bytes (the estimate's attention term) is what attention_forward or
    attention_backward allocates in its workers, the larger of the two: one worker here,
    so tracemalloc's peak of each call is its buffers plus some Python objects (tiles,
    blocks: under 128 KiB)."""
    import importlib
    import tracemalloc
    import numba
    from llamatune.kernels import bf16
    if kernels == "attention_bf16" and not (bf16.cpu_bf16_flags() and bf16.available()):
        pytest.skip("this CPU has no native bf16 or oneDNN is not installed")
    mod = importlib.import_module(f"llamatune.kernels.{kernels}")
    B, T, NH, NKV, HS = shape
    rng = np.random.default_rng(0)
    q, dout = (rng.standard_normal((B, T, NH, HS), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, T, NKV, HS), dtype=np.float32) for _ in range(2))
    out, dq, dk, dv = np.empty_like(q), np.empty_like(q), np.empty_like(k), np.empty_like(v)
    lse = np.empty((B, NH, T), np.float32)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        peaks = []
        for call in (lambda: mod.attention_forward(out, lse, q, k, v, 0),
                     lambda: mod.attention_backward(dq, dk, dv, dout, q, k, v, out, lse)):
            call()                                    # compiled first
            tracemalloc.start()
            call()
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
        est = mod.scratch_bytes(B, T, NH, NKV, HS)
    finally:
        numba.set_num_threads(threads)
    assert est <= max(peaks) <= est + (128 << 10)


def test_gpu_estimate_adds_the_attention_buffers(model):
    """On a GPU the temporaries are the attention's working buffers (scratch_floats),
    and the line says GPU memory; the host's are its own kernels' (scratch_bytes)
    without dropout."""
    from llamatune.kernels import attention
    from llamatune.kernels.cuda.attention import scratch_floats
    host = planner(model)
    gpu = Planner(host.cfg, host.targets, host.weights, 100 << 20, model.path.stat().st_size,
                  model.dequantizer.nbytes, 0.0, device=True)
    cfg = model.config
    for mode in ("none", "selective", "layer"):
        h, g = host.estimate(4, 64, mode), gpu.estimate(4, 64, mode)
        assert h.temporaries == attention.scratch_bytes(4, 64, cfg.n_head, cfg.n_head_kv, cfg.head_dim) > 0
        assert g.temporaries == 4 * scratch_floats(4, 64, cfg.n_head, cfg.n_head_kv, cfg.head_dim) > 0
        assert g.total == h.total - h.temporaries + g.temporaries
    assert "of GPU memory" in gpu.estimate(4, 64, "layer").describe()
    assert "of GPU memory" not in host.estimate(4, 64, "layer").describe()


def test_free_memory_is_the_hosts_on_the_cpu_and_unknown_in_the_simulator(monkeypatch):
    from types import SimpleNamespace
    import llamatune.train.memory as memory
    monkeypatch.setattr(memory, "available_memory", lambda: 12345)
    assert memory.free_memory(SimpleNamespace(name="cpu", on_host=True, gpu=False)) == 12345
    assert memory.free_memory(SimpleNamespace(name="cuda", on_host=True, gpu=False)) is None


def test_free_memory_on_a_gpu_counts_cupys_unused_pool():
    """cudaMemGetInfo's free bytes plus the pool's cached, unused ones (a fake CuPy)."""
    from types import SimpleNamespace
    from llamatune.train.memory import device_runtime_bytes, free_memory
    pool = SimpleNamespace(free_bytes=lambda: 300, used_bytes=lambda: 7000)
    xp = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(memGetInfo=lambda: (5000, 90000))),
                         get_default_memory_pool=lambda: pool)
    gpu = SimpleNamespace(name="cuda", on_host=False, gpu=True, xp=xp)
    assert free_memory(gpu) == 5300
    assert device_runtime_bytes(gpu) == 7000


def test_gpu_bf16_estimate_is_the_f32_one_with_bf16_copies(model):
    """A GPU's bf16 products keep float32 activations (the plan is f32's), dequantize into
    a bf16 scratch (half the f32 one) and keep bf16 copies of the widest operand and of
    the shared input (buffers.gpu_bf16_bytes)."""
    from llamatune.train.buffers import grad_scratch, head_chunk, head_floats
    from llamatune import precision
    from llamatune.train.buffers import gpu_bf16_bytes
    host = planner(model)
    args = (host.cfg, host.targets, host.weights, 100 << 20, model.path.stat().st_size, model.dequantizer.nbytes, 0.0)
    f32, b16 = Planner(*args, device=True), Planner(*args, device=True, policy=precision.policy("bf16", "cuda"))
    cfg = model.config
    for mode in ("none", "selective", "layer"):
        a, b = f32.estimate(4, 64, mode), b16.estimate(4, 64, mode)
        assert b.graph == a.graph
        assert b.scratch == model.dequantizer.nbytes_bf16 == a.scratch // 2
        chunk = head_chunk(256, head_floats(cfg), sum(n * m for n, m in grad_scratch(cfg, 256, mode).values()))
        assert b.temporaries - a.temporaries == gpu_bf16_bytes(cfg, 256, chunk, host.weights.head_rows) > 2 * 256 * cfg.n_ff


@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_the_bf16_warm_up_model_of_a_five_to_one_window_pattern_loads(arch):
    """Gemma 3 / 4 slide on five layers of six: the warm-up's 2-layer model keeps one sliding
    layer and one full (gemma4's loader refuses windows without a period), and the bf16
    warm-up runs on it."""
    from llamatune import precision
    from llamatune.kernels import bf16
    from llamatune.models.config import ModelConfig
    from llamatune.train.step import compile_bf16_kernels, tiny_config
    like = ModelConfig.new(arch, n_vocab=400, n_ctx_train=64, n_embd=32, n_layer=6, n_ff=48, n_head=4, n_head_kv=2,
                           head_dim=8, n_rot=8, norm_eps=1e-6, sliding_window=8, swa_pattern=6, rope_freq_base=1e6,
                           rope_freq_base_swa=10000.0, rope_freq_scale_swa=1.0, final_softcap=30.0)
    tiny = tiny_config(like)
    assert [tiny.is_swa(i) for i in range(tiny.n_layer)] == [True, False]
    if not (bf16.cpu_bf16_flags() and bf16.available()):
        pytest.skip("this CPU has no native bf16 or oneDNN is not installed")
    compile_bf16_kernels(like, precision.policy("bf16"))
