"""train-from-scratch: a model llamatune and llama.cpp load, vocabularies, outtypes,
continuing from a model file, exact resume."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from llamatune.errors import LlamatuneError
from llamatune.formats.gguf_io import GGUFFile
from llamatune.models.arch import get_arch, supported
from llamatune.models.model import Model
from llamatune.options import ScratchOptions
from llamatune.commands.scratch import llama_ff, train_from_scratch

from conftest import TEXT


def options(tmp, **over):
    (tmp / "t.txt").write_text(TEXT)
    base = dict(train_data=tmp / "t.txt", vocab_size=300, embd=32, head=2, layer=1, ff=64, ctx=16, batch=2,
                adam_iter=3, warmup=1, save_every=0, adam_alpha=1e-2, checkpoint_out=tmp / "chk-ITERATION.gguf",
                model_out=tmp / "model-ITERATION.gguf")
    base.update(over)
    return ScratchOptions(**base)


def test_trained_vocabulary_model_loads_and_scores(tmp_path):
    res = train_from_scratch(options(tmp_path, adam_iter=20), quiet=True)
    assert np.mean(res.losses[-3:]) < res.losses[0]
    m = Model(tmp_path / "model-LATEST.gguf")
    assert (m.config.n_embd, m.config.n_layer, m.config.n_vocab) == (32, 1, 300)
    ids = m.tokenizer.encode("First Citizen:", add_special=False)
    assert m.tokenizer.decode(ids) == "First Citizen:"
    from llamatune.models.infer import Runner
    from llamatune.commands.perplexity import perplexity
    assert np.isfinite(perplexity(Runner(m), TEXT, 16, 64).ppl)


def test_special_tokens_are_control_tokens_of_the_trained_vocabulary(tmp_path):
    train_from_scratch(options(tmp_path, special_tokens="<|im_start|>, <|im_end|>"), quiet=True)
    f = GGUFFile(tmp_path / "model-LATEST.gguf")
    tokens, types = f.get("tokenizer.ggml.tokens"), f.get("tokenizer.ggml.token_type")
    assert tokens[:5] == ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"] and types[:5] == [2, 3, 3, 3, 3]
    assert len(tokens) == 300 and tokens.count("<|im_end|>") == 1
    tok = Model(tmp_path / "model-LATEST.gguf").tokenizer
    text = "<|im_start|>user\nFirst<|im_end|>\n"
    ids = tok.encode(text, add_special=False, parse_special=True)
    assert ids[0] == 3 and ids.count(4) == 1
    assert tok.decode(ids) == " user\nFirst \n"     # control tokens render empty; llama.cpp's SPM space after each
    assert 3 not in tok.encode(text, add_special=False)                                  # plain text without parsing
    assert 4 in tok.eog_ids and 3 not in tok.eog_ids                                      # generation ends at <|im_end|>


@pytest.mark.parametrize("over, match", [
    (dict(special_tokens="<a>,<a>"), "give distinct tokens without spaces"),
    (dict(special_tokens="<a>,,<b>"), "give distinct tokens without spaces"),
    (dict(special_tokens="<a b>"), "give distinct tokens without spaces"),
])
def test_bad_special_tokens(tmp_path, over, match):
    with pytest.raises(LlamatuneError, match=match):
        train_from_scratch(options(tmp_path, **over), quiet=True)


def test_special_tokens_need_a_trained_vocabulary(tmp_path, tiny_model):
    with pytest.raises(LlamatuneError, match="--vocab-model brings its own"):
        train_from_scratch(options(tmp_path, vocab_model=tiny_model, special_tokens="<|im_end|>"), quiet=True)


def test_vocab_model_is_copied(tmp_path, tiny_model):
    train_from_scratch(options(tmp_path, vocab_model=tiny_model), quiet=True)
    a, b = GGUFFile(tiny_model), GGUFFile(tmp_path / "model-LATEST.gguf")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        assert a.get(key) == b.get(key)


def test_outtype_q8_0(tmp_path):
    train_from_scratch(options(tmp_path, outtype="q8_0"), quiet=True)
    f = GGUFFile(tmp_path / "model-LATEST.gguf")
    assert f.tensor("blk.0.attn_q.weight").qtype == QType.Q8_0
    assert f.tensor("blk.0.attn_norm.weight").qtype == QType.F32
    assert f.get("general.file_type") == 7


def test_resume_is_exact(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    train_from_scratch(options(one, adam_iter=4), quiet=True)
    train_from_scratch(options(two, adam_iter=2), quiet=True)
    train_from_scratch(options(two, adam_iter=4, checkpoint_in=two / "chk-LATEST.gguf"), quiet=True)
    a, b = GGUFFile(one / "chk-4.gguf"), GGUFFile(two / "chk-4.gguf")
    for name, t in a.tensors.items():
        np.testing.assert_array_equal(np.array(t.data), np.array(b.tensors[name].data), err_msg=name)


def test_continue_from_a_model_file(tmp_path):
    train_from_scratch(options(tmp_path, adam_iter=2), quiet=True)
    start = Model(tmp_path / "model-LATEST.gguf")
    w0 = np.array(start.file.tensor("blk.0.ffn_up.weight").data)
    res = train_from_scratch(options(tmp_path, adam_iter=1, checkpoint_in=tmp_path / "model-LATEST.gguf",
                                     model_out=tmp_path / "next-ITERATION.gguf", adam_alpha=1e-6), quiet=True)
    assert res.state.iteration == 1
    w1 = np.array(GGUFFile(tmp_path / "next-LATEST.gguf").tensor("blk.0.ffn_up.weight").data)
    assert np.abs(w1 - w0).max() < 1e-4          # started from the file's weights, not a fresh init


def test_llama_ff_rule():
    assert llama_ff(256) == 768 and llama_ff(4096) == 11008


def test_embd_not_multiple_of_head(tmp_path):
    with pytest.raises(LlamatuneError, match="--embd 30 is not a multiple of --head 4"):
        train_from_scratch(options(tmp_path, embd=30, head=4), quiet=True)


@pytest.mark.parametrize("arch", [a for a in supported() if get_arch(a).scratch])
def test_arch_option_builds_every_declared_family(tmp_path, arch):
    """--arch reads the declared architectures: each writes the tensors its declaration lists
    (the tied head left out where the family ties it) and the keys its family keeps."""
    from llamatune.models.writer import tensor_names
    res = train_from_scratch(options(tmp_path, arch=arch, embd=32, head=4, head_kv=2, ff=32, adam_iter=1), quiet=True)
    m = Model(tmp_path / "model-LATEST.gguf")
    assert m.config.arch == arch and np.isfinite(res.losses).all()
    assert set(m.file.tensors) == set(tensor_names(m.config, tied=m.config.spec.tied))
