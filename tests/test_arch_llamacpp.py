"""Agreement with llama.cpp for qwen3, gemma, gemma2, gemma3: llamatune's perplexity of
tiny seeded models (F32 and Q8_0, alone and with a seeded adapter) against the figures
llama-perplexity gave on the same files (`-c 32`, F32 without activation rounding),
recorded in fixtures/arch_llamacpp.json by `checks/arch_crosscheck.py --record`."""
from __future__ import annotations

import json

import pytest

from checks.arch_reference import llamacpp_models
from conftest import REPO, TEXT

RECORDED = json.loads((REPO / "tests" / "fixtures" / "arch_llamacpp.json").read_text())


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return {c.name: c for c in llamacpp_models(tmp_path_factory.mktemp("llamacpp"))}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_perplexity_matches_llama_cpp(cases, name):
    from llamatune.commands.perplexity import perplexity
    from llamatune.formats.adapter import load_runtime_adapters
    from llamatune.models.infer import Runner
    from llamatune.models.model import Model
    case = cases[name]
    model = Model(case.model)
    adapters = load_runtime_adapters(model, [(str(case.adapter), 1.0)]) if case.adapter else None
    ppl = perplexity(Runner(model, adapters), TEXT, 32, 32).ppl
    # F32: llama.cpp computes in f32 too, up to ggml's float16 gelu table (kernels/geglu.py);
    # Q8_0: llama.cpp rounds activations to 8 bits before its dot products
    assert ppl == pytest.approx(RECORDED[name], rel=2e-4 if case.exact else 5e-3)
