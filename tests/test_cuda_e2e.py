"""The CUDA backend end to end: inference logits, a full training step (and its
forward-only evaluation loss), and a finetune run whose checkpoint resumes on the
CPU. Without a GPU these run in numba's CUDA simulator (enabled by conftest), on a
deliberately tiny model."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import TEXT, write_tiny_model

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def cuda():
    from llamatune.backend import get_backend
    from llamatune.errors import LlamatuneError
    try:
        return get_backend("cuda")
    except LlamatuneError as e:
        pytest.skip(f"no CUDA device or simulator: {e}")


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory, tiny_vocab):
    # F32 so the simulator spends its time on the ops, not on dequantizing big matrices
    return write_tiny_model(tmp_path_factory.mktemp("cuda") / "micro.gguf", tiny_vocab, n_embd=16, n_ff=24,
                            head_dim=4, n_rot=4, n_layer=1)


def test_set_tf32_sets_cupys_float32_compute_type(monkeypatch):
    """set_tf32 switches CuPy's float32 matmuls between TF32 and its default, and does
    nothing for numpy (a fake CuPy here; the GPU test below runs the real one)."""
    import sys
    from types import ModuleType, SimpleNamespace
    from llamatune.backend import set_tf32
    calls = []
    linalg = SimpleNamespace(COMPUTE_TYPE_DEFAULT=1, COMPUTE_TYPE_TF32=7,
                             set_compute_type=lambda dtype, kind: calls.append((np.dtype(dtype), kind)))
    core = ModuleType("cupy._core")
    core._routines_linalg = linalg
    for name, mod in (("cupy", ModuleType("cupy")), ("cupy._core", core), ("cupy._core._routines_linalg", linalg)):
        monkeypatch.setitem(sys.modules, name, mod)
    set_tf32(object(), True)
    set_tf32(object(), False)
    set_tf32(np, True)
    assert calls == [(np.dtype(np.float32), 7), (np.dtype(np.float32), 1)]


def test_launch_without_sync_turns_off_numbas_stream_wait(monkeypatch):
    """The CUDA backend lets numba launch on CuPy arrays without synchronizing their
    stream first: the variable (read again on a config reload) and the loaded config."""
    import os
    from llamatune.kernels import cuda as kc
    try:
        from numba.cuda.core import config
    except ImportError:
        from numba.core import config
    monkeypatch.setattr(config, "CUDA_ARRAY_INTERFACE_SYNC", True)
    monkeypatch.setenv("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "1")
    kc.launch_without_sync()
    assert config.CUDA_ARRAY_INTERFACE_SYNC is False
    assert os.environ["NUMBA_CUDA_ARRAY_INTERFACE_SYNC"] == "0"


def test_cuda_backend_launches_without_sync(cuda):
    """On a GPU, get_backend("cuda") has switched numba's wait off."""
    if cuda.on_host:
        pytest.skip("the simulator has no streams")
    try:
        from numba.cuda.core import config
    except ImportError:
        from numba.core import config
    assert config.CUDA_ARRAY_INTERFACE_SYNC is False


def test_tf32_matmuls_round_on_a_gpu(cuda):
    """On a GPU, --tf32 products differ from float32 ones by TF32's rounding (about 1e-4
    relative on random data), and switching back restores float32 exactly."""
    if cuda.on_host:
        pytest.skip("the simulator multiplies with numpy: TF32 is a GPU setting")
    from llamatune.backend import set_tf32
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((2, 512, 512), np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    da, db = cuda.to_device(a), cuda.to_device(b)

    def err(on):
        set_tf32(cuda.xp, on)
        got = cuda.to_host(cuda.xp.matmul(da, db)).astype(np.float64)
        return np.linalg.norm(got - want) / np.linalg.norm(want)
    try:
        fp32, tf32, back = err(False), err(True), err(False)
    finally:
        set_tf32(cuda.xp, False)
    assert fp32 < 1e-6 and back == fp32
    assert 3e-5 < tf32 < 3e-3


def test_runner_logits_match_cpu(cuda, micro_model):
    from llamatune.models.infer import Runner
    from llamatune.models.model import Model
    model = Model(micro_model)
    tokens = np.array([[1, 5, 9, 33, 7]])
    want = Runner(model).forward(tokens)
    got = cuda.to_host(Runner(model, backend=cuda).forward(tokens))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# packed: two samples and a padding token in the row, positions restarting at 0 for each
PACKED = dict(positions=np.array([[0, 1, 2, 0, 1, 0]]), segments=np.array([[0, 0, 0, 1, 1, -1]]))


@pytest.mark.parametrize("packing", [{}, PACKED, "answer"], ids=["rows", "packed", "answer"])
def test_training_step_matches_cpu(cuda, micro_model, packing, monkeypatch):
    """answer: targets in columns 1-3 only, so the head gathers its rows and the step
    runs on the first 4 columns (TRIM_TOKENS 2 here) on both backends."""
    from llamatune.train import step as graph_module
    from llamatune.train.step import StepExecutor
    from llamatune.backend import cpu
    from llamatune.train.lora import init_lora, lora_specs, lora_targets
    from llamatune.models.model import Model
    from llamatune.train.params import ParamBuffer
    from llamatune.models.weights import FrozenBase
    model = Model(micro_model)
    cfg = model.config
    ranks = {k: 2 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    targets = lora_targets(cfg, ranks, 2.0, tied=False)
    rng = np.random.default_rng(0)
    inputs, labels = rng.integers(0, cfg.n_vocab, (1, 6)), rng.integers(0, cfg.n_vocab, (1, 6))
    w = np.full((1, 6), 1 / 6, np.float32)
    if packing == "answer":
        monkeypatch.setattr(graph_module, "TRIM_TOKENS", 2)
        labels[0, [0, 4, 5]] = -1
        w = (labels >= 0) / np.float32(3)
        packing = {}
    results = []
    for backend in (cpu(), cuda):
        params = ParamBuffer(lora_specs(targets))
        init_lora(params, targets, np.random.default_rng(1))
        params.data += np.random.default_rng(2).normal(0, 0.05, params.size).astype(np.float32)
        if backend is not cpu():
            params.to_device(backend)
        g = StepExecutor(cfg, FrozenBase(model, backend), params, targets, 1, 6, backend=backend)
        evaluated = g.loss(inputs, labels, w, **packing)      # forward only: no gradient
        assert not params.host(params.grad).any()
        loss = g.step(inputs, labels, w, **packing)
        assert loss == pytest.approx(evaluated, rel=1e-6)
        assert list(g._trimmed_executors) == ([4] if (labels < 0).any() else [])
        results.append((loss, params.host(params.grad).copy()))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-3, atol=1e-6)


def test_finetune_on_cuda_resumes_on_cpu(cuda, micro_model, tmp_path):
    from llamatune.commands.finetune import finetune
    from llamatune.options import FinetuneOptions
    (tmp_path / "t.txt").write_text(TEXT)
    common = dict(model_base=micro_model, train_data=tmp_path / "t.txt", ctx=6, batch=1, lora_r=2, warmup=1,
                  save_every=0, checkpoint_out=tmp_path / "chk-ITERATION.gguf",
                  lora_out=tmp_path / "adapter-ITERATION.gguf")
    gpu = finetune(FinetuneOptions(device="cuda", adam_iter=2, **common), quiet=True)
    assert gpu.state.iteration == 2
    res = finetune(FinetuneOptions(device="cpu", adam_iter=3, checkpoint_in=tmp_path / "chk-LATEST.gguf", **common),
                   quiet=True)
    assert res.state.iteration == 3 and np.isfinite(res.losses[-1])


def test_backend_gpu_is_a_real_gpu_only(cuda):
    from llamatune.backend import cpu
    assert cpu().gpu is False
    assert cuda.gpu is (not cuda.simulated)
