"""Shared fixtures: tiny synthetic models written with the project's own writer,
and the paths of the reference files in ../shared (tests using them skip when absent)."""
from __future__ import annotations

import sys
from pathlib import Path

import llamatune  # noqa: F401  (first: its threading policy must precede numpy's OpenBLAS)
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MODELS = SHARED / "models"
VOCAB = SHARED / "vocab"
DATA = SHARED / "data"

TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n\n"
    "First Citizen:\nFirst, you know Caius Marcius is chief enemy to the people.\n\n"
    "All:\nWe know't, we know't.\n\nFirst Citizen:\nLet us kill him, and we'll have corn at our own price.\n"
) * 4


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the long end-to-end tests marked slow")


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` run only with --slow, so the default suite stays fast."""
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow end-to-end test: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    # CUDA kernel tests run in numba's simulator when no GPU is present; this must be
    # decided before anything imports numba.cuda.
    global _SIMULATED
    from conftest_cuda import (enable_simulator_if_no_gpu, make_simulator_refuse_none_arguments,
                               make_simulator_shared_arrays_thread_safe)
    enable_simulator_if_no_gpu()
    from llamatune.kernels.cuda import simulator_enabled
    _SIMULATED = simulator_enabled()
    if _SIMULATED:
        make_simulator_shared_arrays_thread_safe()
        make_simulator_refuse_none_arguments()


_SIMULATED = False  # numba.cuda is the simulator (decided in pytest_configure)


@pytest.fixture(autouse=True)
def _simulator_switch_interval(request):
    """numba's CUDA simulator runs every thread of a block as a Python thread that
    meets the others at each syncthreads(); with the interpreter's default 5 ms GIL
    switch interval a 32-thread reduction waits out one interval per hand-over. A
    50 us interval makes the simulated kernels 5-8x faster on two cores; it changes
    scheduling only, never results. Only for `cuda` tests in the simulator."""
    if not _SIMULATED or request.node.get_closest_marker("cuda") is None:
        yield
        return
    was = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(was)


def need(path: Path) -> Path:
    """Skip the test when a reference file from ../shared is missing."""
    if not path.exists():
        pytest.skip(f"reference file {path} not present (../shared is not checked out beside the repo)")
    return path


def tiny_config(arch: str = "llama", **over):
    from llamatune.models.config import ModelConfig
    base = dict(arch=arch, n_vocab=400, n_ctx_train=64, n_embd=64, n_layer=2, n_ff=96, n_head=4,
                n_head_kv=2, head_dim=16, n_rot=16, norm_eps=1e-5)
    base.update(over)
    return ModelConfig(**base)


@pytest.fixture(scope="session")
def tiny_vocab():
    from llamatune.models.writer import train_spm_vocab
    return train_spm_vocab(TEXT, 400)


def write_tiny_model(path: Path, vocab, outtype=None, seed: int = 0, arch: str = "llama", tied=False, **over) -> Path:
    from gguf import GGMLQuantizationType as QType
    from llamatune.models.writer import random_weights, write_model
    cfg = tiny_config(arch, **over)
    w = random_weights(cfg, seed=seed, std=0.08, tied=tied)
    write_model(path, cfg, w, vocab, outtype or QType.F32)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tiny_vocab) -> Path:
    """A 2-layer GQA llama (F32) with a trained 400-token SentencePiece vocabulary."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-f32.gguf", tiny_vocab)


@pytest.fixture(scope="session")
def qwen_vocab(tmp_path_factory) -> Path:
    """Qwen2.5's vocabulary and chat template (a vocab-only GGUF kept xz-compressed in fixtures/)."""
    import lzma
    path = tmp_path_factory.mktemp("vocab") / "qwen2.5-vocab.gguf"
    path.write_bytes(lzma.decompress((REPO / "tests" / "fixtures" / "qwen2.5-vocab.gguf.xz").read_bytes()))
    return path


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_vocab):
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.models.tokenizer import Tokenizer
    return Tokenizer.from_gguf(GGUFFile(qwen_vocab))
