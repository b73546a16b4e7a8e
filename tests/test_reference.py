"""Agreement with llama.cpp on its own files: perplexity of every model in
../shared/models against the figures llama-perplexity recorded there
(`-c 256 -b 256`, shakespeare-eval.txt; README.md beside the models)."""
from __future__ import annotations

import pytest

from conftest import DATA, MODELS, need

# llama.cpp `Final estimate: PPL` from ../shared/models/README.md
LLAMA_CPP_PPL = {"tiny-Q8_0.gguf": 79.4875, "tiny-Q4_K_M.gguf": 79.5978, "tiny-Q2_K.gguf": 81.8427}


@pytest.mark.parametrize("name", sorted(LLAMA_CPP_PPL))
def test_perplexity_matches_llama_cpp(name):
    from llamatune.models.infer import Runner
    from llamatune.models.model import Model
    from llamatune.commands.perplexity import perplexity
    model = Model(need(MODELS / name))
    text = need(DATA / "shakespeare-eval.txt").read_text(encoding="utf-8")
    res = perplexity(Runner(model), text, 256, 4096)
    assert res.n_windows == 61 and res.n_scored == 61 * 127
    # llama.cpp rounds activations to 8 bits before quantized dot products; we compute in f32
    # on the dequantized weights, so agreement is close but not exact (the issue asks for 0.5 %)
    assert res.ppl == pytest.approx(LLAMA_CPP_PPL[name], rel=0.005)
