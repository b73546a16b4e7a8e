"""Full finetuning of an existing model (finetune --fine-tune-type full, train/full.py):
gradients of every tensor kind by finite differences on models loaded from GGUF files
(quantized, tied, with biases, partly frozen), exact resume with AdamW and SGD, the
written model (its bytes, its losses), --freeze, --save-best, and the errors."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from fdcheck import fd_check
from llamatune.commands.finetune import finetune
from llamatune.errors import LlamatuneError
from llamatune.formats.gguf_io import GGUFFile
from llamatune.kernels.quantize import quantize
from llamatune.models.model import Model
from llamatune.models.writer import tensor_names
from llamatune.models.weights import FrozenBase
from llamatune.options import FinetuneOptions, validate
from llamatune.train import checkpoint as ckpt
from llamatune.train.full import FullWeights, load_trained, trained_names
from llamatune.train.step import StepExecutor
from llamatune.train.params import ParamBuffer, ParamSpec

from conftest import TEXT, write_tiny_model


def batch(cfg, B, T, seed=0):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, cfg.n_vocab, (B, T))
    targets = rng.integers(0, cfg.n_vocab, (B, T))
    targets[0, -2:] = -1
    return inputs, targets, (targets >= 0) / int((targets >= 0).sum())


def full_params(model: Model, freeze: str = "", dtype=np.float32) -> tuple[ParamBuffer, FullWeights]:
    tied = model.weights.output is model.weights.token_embd
    shapes = tensor_names(model.config, tied)
    names = trained_names(list(shapes), "", freeze, model.path.name)
    params = ParamBuffer([ParamSpec(n, shapes[n]) for n in names], dtype)
    load_trained(params, model.file)
    return params, FullWeights(FrozenBase(model), params, tied)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_vocab) -> dict[str, Path]:
    """Small enough for element-wise finite differences: C 32, F 64 (Q8_0 blocks fit)."""
    d = tmp_path_factory.mktemp("full")
    shape = dict(n_embd=32, n_ff=64, head_dim=8, n_rot=8)
    return {"llama-q8_0": write_tiny_model(d / "llama-q8.gguf", tiny_vocab, QType.Q8_0, **shape),
            "qwen2-tied-f16": write_tiny_model(d / "qwen2-f16.gguf", tiny_vocab, QType.F16, arch="qwen2",
                                               tied=True, seed=2, **shape)}


@pytest.mark.parametrize("name,freeze,mode", [
    ("llama-q8_0", "", "layer"),
    ("llama-q8_0", "token_embd.*,blk.0.ffn_up.*,blk.1.attn_norm.*", "none"),
    ("qwen2-tied-f16", "", "selective"),                  # q/k/v biases; the head is token_embd
    ("qwen2-tied-f16", "blk.0.attn_k.bias,output_norm.*", "layer"),
])
def test_gradient_of_every_tensor_kind_matches_finite_differences(models, name, freeze, mode):
    """float64 parameters from a quantized / F16 GGUF (dequantized exactly); frozen tensors
    stay quantized in the FrozenBase and get no parameter and no gradient."""
    model = Model(models[name])
    params, weights = full_params(model, freeze, np.float64)
    frozen = [n for n in tensor_names(model.config, weights.tied) if n not in params]
    assert len(frozen) == len([p for p in freeze.split(",") if p])
    for s in params.specs:                                        # norms away from 1: their grads matter
        if s.name.endswith("norm.weight"):
            params[s.name][...] += np.random.default_rng(1).normal(0, 0.1, s.shape)
    g = StepExecutor(model.config, weights, params, [], 2, 5, mode, dtype=np.float64)
    inputs, tg, w = batch(model.config, 2, 5, seed=3)

    def loss(**_):
        params.zero_grad()
        return g.step(inputs, tg, w)

    loss()
    analytic = {s.name: params.grad_of(s.name).copy() for s in params.specs}
    assert all(np.abs(a).max() > 0 for a in analytic.values()), "a trained tensor got no gradient"
    views = {s.name: params[s.name] for s in params.specs}        # every tensor probed
    assert fd_check(loss, views, analytic, eps=1e-5, rtol=1e-5, atol=1e-9, n_probe=8) < 1e-5


def test_frozen_tensors_read_as_stored_and_trained_ones_dequantized(models):
    """A trained tensor's parameter is the stored tensor dequantized; the graph gets the
    parameter for it and the FrozenBase's expansion for a frozen one."""
    from llamatune.kernels import dequant
    model = Model(models["llama-q8_0"])
    params, weights = full_params(model, "blk.0.attn_q.weight")
    for s in params.specs:
        t = model.file.tensors[s.name]
        np.testing.assert_array_equal(params[s.name].reshape(t.n_rows, t.n_cols),
                                      dequant.dequantize(t.raw_rows(), t.qtype, t.n_cols))
    assert weights.matrix("blk.0.attn_v.weight") is not None and not weights.is_scratch("blk.0.attn_v.weight")
    assert weights.is_scratch("blk.0.attn_q.weight") and weights.grad("blk.0.attn_q.weight") is None
    assert set(weights.tensors) == {"blk.0.attn_q.weight"}


def test_trained_names_patterns_and_errors():
    names = ["token_embd.weight", "output_norm.weight", "output.weight", "blk.0.attn_q.weight",
             "blk.0.attn_norm.weight", "blk.1.attn_q.weight"]
    assert trained_names(names, "", "", "m") == names
    assert trained_names(names, "", "token_embd.*, output.*", "m") == names[1:2] + names[3:]
    assert trained_names(names, "blk.*", "blk.1.*", "m") == names[3:5]
    with pytest.raises(LlamatuneError, match=r"^--freeze 'tok_embd\.\*': matches no tensor of m \(names look "):
        trained_names(names, "", "tok_embd.*", "m")
    with pytest.raises(LlamatuneError, match=r"^--train-only 'blk\.9\.\*': matches no tensor of m"):
        trained_names(names, "blk.9.*", "", "m")
    with pytest.raises(LlamatuneError, match=r"^--train-only / --freeze leave no tensor of m to train$"):
        trained_names(names, "blk.*", "blk.*", "m")


def options(tmp: Path, model: Path, **over) -> FinetuneOptions:
    (tmp / "train.txt").write_text(TEXT)
    base = dict(model_base=model, train_data=tmp / "train.txt", ctx=16, batch=2, adam_iter=4, save_every=0,
                warmup=1, adam_alpha=1e-3, fine_tune_type="full", checkpoint_out=tmp / "chk-ITERATION.gguf",
                model_out=tmp / "model-ITERATION.gguf", plot=False)
    base.update(over)
    o = FinetuneOptions(**base)
    validate(o)
    return o


def test_option_errors(tmp_path, tiny_model):
    with pytest.raises(LlamatuneError, match=r"^--fine-tune-type 'dense': choose lora or full$"):
        options(tmp_path, tiny_model, fine_tune_type="dense")
    with pytest.raises(LlamatuneError, match=r"^--freeze, --out-type: only with --fine-tune-type full$"):
        options(tmp_path, tiny_model, fine_tune_type="lora", freeze="token_embd.*", out_type="f16")
    with pytest.raises(LlamatuneError, match=r"unknown output type 'q9_9'"):
        finetune(options(tmp_path, tiny_model, out_type="q9_9"), quiet=True)


def tensors(path: Path) -> dict[str, np.ndarray]:
    return {n: np.array(t.data) for n, t in GGUFFile(path).tensors.items()}


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_resume_continues_the_same_trajectory(tmp_path, models, optimizer):
    """4 steps == 2 steps, resume from LATEST, 2 more: checkpoint (weights, moments, counters,
    data position) and written model bit for bit. SGD checkpoints hold no moments."""
    model = models["qwen2-tied-f16"]
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    finetune(options(one, model, optimizer=optimizer, freeze="blk.1.*"), quiet=True)
    finetune(options(two, model, optimizer=optimizer, freeze="blk.1.*", adam_iter=2), quiet=True)
    res = finetune(options(two, model, optimizer=optimizer, freeze="blk.1.*",
                           checkpoint_in=two / "chk-LATEST.gguf"), quiet=True)
    assert res.state.iteration == 4 and len(res.losses) == 2
    a, b = tensors(one / "chk-4.gguf"), tensors(two / "chk-4.gguf")
    assert a.keys() == b.keys()
    assert ("optimizer.adam.first_moments" in a) == (optimizer == "adamw")
    assert not any(n.startswith("blk.1.") for n in a)             # frozen: not in the checkpoint
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    fa, fb = GGUFFile(one / "chk-4.gguf"), GGUFFile(two / "chk-4.gguf")
    for key in ("training.sample_count", "training.token_count", "llamatune.data_state", "training.loss_ema"):
        assert fa.get(key) == fb.get(key), key
    assert (one / "model-4.gguf").read_bytes() == (two / "model-LATEST.gguf").read_bytes()


def test_checkpointing_modes_and_accumulation_train_the_same_bits(tmp_path, models):
    """Modes recompute, they never change the gradient; two micro-batches of 1 sum to one of 2
    (per-token weights over the whole step) up to float rounding."""
    model = models["llama-q8_0"]
    runs = {}
    for name, over in {"layer": dict(checkpointing="layer"), "none": dict(checkpointing="none"),
                       "acc": dict(checkpointing="none", batch=1, grad_acc=2)}.items():
        d = tmp_path / name
        d.mkdir()
        finetune(options(d, model, adam_iter=2, **over), quiet=True)
        runs[name] = tensors(d / "chk-2.gguf")
    for n in runs["layer"]:
        np.testing.assert_array_equal(runs["layer"][n], runs["none"][n], err_msg=n)
        scale = np.abs(runs["none"][n]).max()
        np.testing.assert_allclose(runs["acc"][n], runs["none"][n], rtol=1e-4, atol=1e-5 * scale, err_msg=n)


def test_written_model_keeps_the_base_and_gives_the_trained_losses(tmp_path, models):
    """The model written in the base's types (Q8_0 here) holds every key and tensor of the
    base in its order; frozen tensors byte for byte, trained ones equal to the project's
    quantizer applied to the trained weights; as F32 (--out-type) it computes the very
    losses of the trained weights, and in Q8_0 the same to the type's rounding."""
    base = models["llama-q8_0"]
    freeze = "token_embd.*,blk.0.ffn_up.*"
    finetune(options(tmp_path, base, freeze=freeze, adam_alpha=3e-2), quiet=True)
    c = ckpt.load(tmp_path / "chk-LATEST.gguf")
    fb, fo = GGUFFile(base), GGUFFile(tmp_path / "model-LATEST.gguf")
    assert list(fo.kvs) == list(fb.kvs) and list(fo.tensors) == list(fb.tensors)
    assert all(fo.get(k) == fb.get(k) for k in fb.kvs)
    for name, t in fb.tensors.items():
        out = fo.tensors[name]
        assert out.qtype == t.qtype, name
        if name in ("token_embd.weight", "blk.0.ffn_up.weight"):
            np.testing.assert_array_equal(out.raw_rows(), t.raw_rows(), err_msg=name)
            continue
        trained = np.array(c.file.tensors[name].data).reshape(t.shape)
        if t.qtype == QType.F32:                                    # norms
            np.testing.assert_array_equal(np.array(out.data).reshape(t.shape), trained, err_msg=name)
        else:
            np.testing.assert_array_equal(out.raw_rows(), quantize(trained.reshape(-1, t.n_cols), t.qtype))
            assert not np.array_equal(out.raw_rows(), t.raw_rows()), f"{name} did not change"
    # the same run written as F32: losses of the file == losses of the trained weights
    finetune(options(tmp_path, base, freeze=freeze, adam_alpha=3e-2, out_type="f32",
                     checkpoint_in=tmp_path / "chk-LATEST.gguf", adam_iter=5), quiet=True)
    c = ckpt.load(tmp_path / "chk-LATEST.gguf")
    model = Model(base)
    params, weights = full_params(model, freeze)
    c.load_into(params)
    cfg = model.config
    inputs, tg, w = batch(cfg, 2, 8, seed=4)
    trained = StepExecutor(cfg, weights, params, [], 2, 8)
    trained.loss(inputs, tg, w)
    losses = {"trained": trained.losses.copy()}
    for typ in ("f32", "q8_0"):
        path = tmp_path / f"model-{typ}.gguf"
        if typ == "f32":
            path = tmp_path / "model-LATEST.gguf"
            assert GGUFFile(path).tensors["blk.0.attn_q.weight"].qtype == QType.F32
            assert GGUFFile(path).tensors["token_embd.weight"].qtype == QType.F32    # frozen, converted
        else:
            from llamatune.train.full import write_full_model
            write_full_model(path, model.file, params, None)
        m = Model(path)
        g = StepExecutor(cfg, FrozenBase(m), ParamBuffer([]), [], 2, 8)
        g.loss(inputs, tg, w)
        losses[typ] = g.losses.copy()
    np.testing.assert_allclose(losses["f32"], losses["trained"], rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(losses["q8_0"], losses["trained"], rtol=2e-2, atol=2e-2)
    assert not np.array_equal(losses["q8_0"], losses["trained"])


def test_full_finetune_lowers_held_out_loss_and_saves_best(tmp_path, models):
    """A few steps on the text lower the loss on held-out samples of it; --save-best keeps
    the model and checkpoint of the lowest one under BEST."""
    o = options(tmp_path, models["llama-q8_0"], adam_iter=8, adam_alpha=1e-2, val_split=0.2, eval_every=4,
                save_best=True, metrics_out=tmp_path / "metrics.jsonl")
    res = finetune(o, quiet=True)
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = [e["val_loss"] for e in evals if "val_loss" in e]
    assert len(val) == 3 and val[-1] < val[0] - 0.5, val
    assert res.state.validation.best_loss == min(val)
    assert (tmp_path / "model-BEST.gguf").exists() and (tmp_path / "chk-BEST.gguf").exists()
    Model(tmp_path / "model-BEST.gguf")


def test_dry_run_says_what_the_trained_values_cost(tmp_path, models, capsys):
    """--dry-run: weights and gradients in f32, AdamW's two moments; SGD keeps none."""
    for optimizer, moments in (("adamw", "AdamW moments"), ("sgd", "no optimizer moments (SGD)")):
        finetune(options(tmp_path, models["llama-q8_0"], optimizer=optimizer, dry_run=True))
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == "dry run: nothing trained or written"
        assert lines[-1].startswith("  trained values (in each runtime above): f32 weights ")
        assert moments in lines[-1]
    assert not list(tmp_path.glob("*ITERATION*")) and not list(tmp_path.glob("model-*"))


@pytest.fixture(scope="module")
def cuda():
    from llamatune.backend import get_backend
    try:
        return get_backend("cuda")
    except LlamatuneError as e:
        pytest.skip(f"no CUDA device or simulator: {e}")


@pytest.mark.cuda
@pytest.mark.slow                          # minutes in the simulator; seconds on a GPU
def test_full_finetune_on_cuda_matches_cpu_and_resumes_there(cuda, tmp_path, tiny_vocab):
    """Two steps on the GPU (the simulator without one) give the CPU's weights to float
    rounding, a frozen tensor included; the checkpoint goes on on the CPU."""
    micro = write_tiny_model(tmp_path / "micro.gguf", tiny_vocab, n_embd=16, n_ff=24, head_dim=4, n_rot=4,
                             n_layer=1)
    runs = {}
    for device in ("cuda", "cpu"):
        d = tmp_path / device
        d.mkdir()
        finetune(options(d, micro, device=device, ctx=6, batch=1, adam_iter=2, freeze="blk.0.ffn_up.*"),
                 quiet=True)
        runs[device] = tensors(d / "chk-2.gguf")
    assert "blk.0.ffn_up.weight" not in runs["cpu"]
    for n, a in runs["cpu"].items():
        np.testing.assert_allclose(runs["cuda"][n], a, rtol=1e-3, atol=1e-6, err_msg=n)
    res = finetune(options(tmp_path / "cuda", micro, ctx=6, batch=1, adam_iter=3, freeze="blk.0.ffn_up.*",
                           checkpoint_in=tmp_path / "cuda" / "chk-LATEST.gguf"), quiet=True)
    assert res.state.iteration == 3 and np.isfinite(res.losses[-1])


def test_convert_checkpoint_takes_frozen_tensors_from_the_base(tmp_path, models):
    """A full-finetune checkpoint holds only the trained tensors: convert-checkpoint --to model
    takes the frozen ones from --model-base (dequantized, F32 like the rest), and says so
    without it or with another base."""
    from llamatune.commands.convert import convert
    from llamatune.kernels import dequant
    base = models["llama-q8_0"]
    finetune(options(tmp_path, base, freeze="token_embd.*", adam_iter=2), quiet=True)
    chk = tmp_path / "chk-LATEST.gguf"
    with pytest.raises(LlamatuneError, match=r"chk-LATEST.gguf: holds no token_embd.weight \(frozen in a full "
                                             r"finetune\): give the base model it was trained on with --model-base$"):
        convert(chk, tmp_path / "m.gguf", "model")
    with pytest.raises(LlamatuneError, match=r"chk-LATEST.gguf: was trained on a different base model than .*qwen2"):
        convert(chk, tmp_path / "m.gguf", "model", model_base=models["qwen2-tied-f16"])
    assert "--model-base" not in convert(chk, tmp_path / "m.gguf", "model", model_base=base)
    out, trained, fb = GGUFFile(tmp_path / "m.gguf"), tensors(chk), GGUFFile(base)
    t = fb.tensors["token_embd.weight"]
    np.testing.assert_array_equal(np.array(out.tensors["token_embd.weight"].data),
                                  dequant.dequantize(t.raw_rows(), t.qtype, t.n_cols))
    for name in fb.tensors:
        if name != "token_embd.weight":
            np.testing.assert_array_equal(np.array(out.tensors[name].data).reshape(-1), trained[name].reshape(-1))


def test_adamw_with_bf16_moments_is_the_f32_update_of_the_widened_moments():
    """Chunk by chunk: the parameters move as adamw_update moves them from the moments
    widened to f32, and the new moments are those rounded to nearest even (whole arrays,
    across a chunk boundary)."""
    from llamatune.kernels import bf16, optim
    rng = np.random.default_rng(0)
    n = optim.BF16_CHUNK + 1000
    p, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    m16 = bf16.to_bf16_ref(rng.standard_normal(n).astype(np.float32) * 0.1)
    v16 = bf16.to_bf16_ref(rng.random(n).astype(np.float32) * 0.01)
    pw, mw, vw = p.copy(), bf16.from_bf16_ref(m16).astype(np.float32), bf16.from_bf16_ref(v16).astype(np.float32)
    optim.adamw_update(pw, g, mw, vw, 1e-3, 0.9, 0.999, 1e-8, 0.1, 7)
    optim.adamw_update_bf16(p, g, m16, v16, 1e-3, 0.9, 0.999, 1e-8, 0.1, 7)
    np.testing.assert_array_equal(p, pw)
    np.testing.assert_array_equal(m16, bf16.to_bf16_ref(mw))
    np.testing.assert_array_equal(v16, bf16.to_bf16_ref(vw))
    with pytest.raises(ValueError, match="m must be a contiguous 1-D uint16"):
        optim.adamw_update_bf16(p, g, mw, v16, 1e-3, 0.9, 0.999, 1e-8, 0.1, 7)


def test_full_finetune_with_bf16_moments_trains_close_to_f32_and_resumes_exactly(tmp_path, tiny_model):
    """--adam-moments bf16: half the moments' memory, losses within 1 % of f32 moments over
    6 steps, and a resume from the checkpoint (moments stored as BF16) gives the bytes of
    an uninterrupted run."""
    runs = {}
    for name, moments, iters in (("f32", "f32", 6), ("bf16", "bf16", 6), ("half", "bf16", 3)):
        d = tmp_path / name
        d.mkdir()                               # the decay given: a 3-step run's schedule is the 6-step one's
        runs[name] = finetune(options(d, tiny_model, adam_iter=iters, adam_moments=moments, cos_decay_steps=6,
                                           compute_dtype="f32"), quiet=True)
    np.testing.assert_allclose(runs["bf16"].losses, runs["f32"].losses, rtol=1e-2)
    c = ckpt.load(tmp_path / "bf16" / "chk-LATEST.gguf")
    assert c.options["adam_moments"] == "bf16"
    assert c.file.tensors["optimizer.adam.first_moments"].qtype == QType.BF16       # stored as they are
    res = finetune(options(tmp_path / "half", tiny_model, adam_iter=6, adam_moments="bf16", compute_dtype="f32",
                                cos_decay_steps=6, checkpoint_in=tmp_path / "half" / "chk-LATEST.gguf"), quiet=True)
    assert res.state.iteration == 6
    a, b = (GGUFFile(tmp_path / d / "model-LATEST.gguf") for d in ("bf16", "half"))
    for name, t in a.tensors.items():
        np.testing.assert_array_equal(np.asarray(b.tensors[name].data), np.asarray(t.data), err_msg=name)


def test_bf16_moments_are_for_full_adamw_on_the_cpu(tmp_path, tiny_model):
    with pytest.raises(LlamatuneError, match=r"--adam-moments bf16 is for --fine-tune-type full with AdamW"):
        options(tmp_path, tiny_model, adam_moments="bf16", optimizer="sgd")
    with pytest.raises(LlamatuneError, match=r"--adam-moments bf16 runs on the CPU"):
        options(tmp_path, tiny_model, adam_moments="bf16", device="cuda")
    with pytest.raises(LlamatuneError, match=r"--adam-moments 'fp8': choose f32 or bf16"):
        options(tmp_path, tiny_model, adam_moments="fp8")
