"""Preference tuning: the losses against TRL's formulas, their gradient through the whole
model by finite differences (float64), the reference with the adapter off, and tiny-model
runs (held-out reward accuracy, exact resume)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fdcheck import fd_check
from llamatune.commands.finetune import finetune
from llamatune.data.samples import Batch
from llamatune.formats.gguf_io import GGUFFile
from llamatune.models.model import Model
from llamatune.models.weights import FrozenBase
from llamatune.options import FinetuneOptions
from llamatune.train.step import StepExecutor
from llamatune.train.lora import init_lora, lora_specs, lora_targets
from llamatune.train.lora import disabled_adapters
from llamatune.train.params import ParamBuffer
from llamatune.train.preference import Preference, dpo_loss, orpo_loss

import test_mpi
from conftest import write_tiny_model
from test_mpi import launcher  # noqa: F401  (the fixture: `mpiexec -n 2`, or a skip with the reason)

ALL_RANKS = {k: 2 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                            "token_embd", "output", "attn_norm", "ffn_norm", "output_norm")}


# --------------------------------------------------------------------------- TRL's formulas
def trl_dpo(pi_c, pi_r, ref_c, ref_r, beta, loss_type, label_smoothing):
    """DPOTrainer.dpo_loss (sigmoid, ipo), in numpy as TRL writes it in torch."""
    logsigmoid = lambda x: np.log(1.0 / (1.0 + np.exp(-x)))  # noqa: E731
    logits = (pi_c - pi_r) - (ref_c - ref_r)
    if loss_type == "sigmoid":
        return -logsigmoid(beta * logits) * (1 - label_smoothing) - logsigmoid(-beta * logits) * label_smoothing
    return (logits - 1 / (2 * beta)) ** 2


def trl_orpo(lp_c, lp_r, beta):
    """ORPOTrainer.odds_ratio_loss's `losses`, negated as get_batch_loss_metrics subtracts them."""
    log_odds = (lp_c - lp_r) - (np.log1p(-np.exp(lp_c)) - np.log1p(-np.exp(lp_r)))
    return -beta * np.log(1.0 / (1.0 + np.exp(-log_odds)))


def central(f, x, eps=1e-6):
    return (f(x + eps) - f(x - eps)) / (2 * eps)


@pytest.mark.parametrize("loss_type, smoothing, beta", [("sigmoid", 0.0, 0.1), ("sigmoid", 0.2, 0.5),
                                                        ("ipo", 0.0, 0.1), ("ipo", 0.0, 2.0)])
def test_dpo_loss_and_derivatives_match_trl(loss_type, smoothing, beta):
    rng = np.random.default_rng(0)
    pi_c, pi_r, ref_c, ref_r = (rng.normal(-20, 8, 64) for _ in range(4))
    if loss_type == "ipo":                                   # IPO's log-probabilities are means per token
        pi_c, pi_r, ref_c, ref_r = pi_c / 10, pi_r / 10, ref_c / 10, ref_r / 10
    losses, d_c, d_r = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta, loss_type, smoothing)
    ref = lambda c, r: trl_dpo(c, r, ref_c, ref_r, beta, loss_type, smoothing)  # noqa: E731
    np.testing.assert_allclose(losses, ref(pi_c, pi_r), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(d_c, central(lambda c: ref(c, pi_r), pi_c), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(d_r, central(lambda r: ref(pi_c, r), pi_r), rtol=1e-6, atol=1e-9)


def test_orpo_loss_and_derivatives_match_trl():
    rng = np.random.default_rng(1)
    lp_c, lp_r = -rng.uniform(0.05, 6, 64), -rng.uniform(0.05, 6, 64)
    losses, d_c, d_r, log_odds = orpo_loss(lp_c, lp_r, 0.25)
    np.testing.assert_allclose(losses, trl_orpo(lp_c, lp_r, 0.25), rtol=1e-12)
    np.testing.assert_allclose(log_odds, (lp_c - lp_r) - (np.log1p(-np.exp(lp_c)) - np.log1p(-np.exp(lp_r))),
                               rtol=1e-12)
    np.testing.assert_allclose(d_c, central(lambda c: trl_orpo(c, lp_r, 0.25), lp_c, 1e-7), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(d_r, central(lambda r: trl_orpo(lp_c, r, 0.25), lp_r, 1e-7), rtol=1e-6, atol=1e-9)


def test_dpo_loss_stays_finite_far_out():
    big = np.array([400.0, -400.0])
    losses, d_c, d_r = dpo_loss(big, -big, np.zeros(2), np.zeros(2), 1.0)
    assert np.isfinite(losses).all() and np.isfinite(d_c).all()
    np.testing.assert_allclose(losses, [0.0, 800.0], atol=1e-300)     # logits -800: -log s(-800)
    np.testing.assert_allclose(d_c, [0.0, -1.0])


# --------------------------------------------------------------------------- through the model
@pytest.fixture(scope="module")
def small_model(tmp_path_factory, tiny_vocab):
    return Model(write_tiny_model(tmp_path_factory.mktemp("p") / "m.gguf", tiny_vocab, n_embd=32, n_ff=48,
                                  head_dim=8, n_rot=8))


def pair_batch(n_vocab: int, pairs: list[int], T: int, seed: int) -> Batch:
    """Rows 2k, 2k + 1: pair pairs[k]'s answers after a shared 3-token prompt (targets -1 there)."""
    rng = np.random.default_rng(seed)
    B = 2 * len(pairs)
    inputs = np.zeros((B, T), np.int64)
    targets = np.full((B, T), -1, np.int64)
    for k in range(len(pairs)):
        prompt = rng.integers(0, n_vocab, 3)
        for j in range(2):
            n = int(rng.integers(2, T - 2))                  # answer tokens
            seq = np.concatenate([prompt, rng.integers(0, n_vocab, n + 1)])
            inputs[2 * k + j, :len(seq) - 1] = seq[:-1]
            targets[2 * k + j, 2:len(seq) - 1] = seq[3:]
    ids = np.array([2 * p + j for p in pairs for j in range(2)], np.int64)
    return Batch(inputs, targets, int((targets >= 0).sum()), False, sample_ids=ids)


def setup(model, B, T, seed=0):
    targets = lora_targets(model.config, ALL_RANKS, alpha=3.0, tied=False)
    params = ParamBuffer(lora_specs(targets), np.float64)
    init_lora(params, targets, np.random.default_rng(seed))
    params.data[...] += np.random.default_rng(seed + 1).normal(0, 0.05, params.size)   # B != 0: policy != base
    executor = StepExecutor(model.config, FrozenBase(model), params, targets, B, T, "selective", 0.0, dtype=np.float64)
    return executor, params, targets


@pytest.mark.parametrize("method, loss_type, smoothing", [("dpo", "sigmoid", 0.0), ("dpo", "sigmoid", 0.3),
                                                          ("dpo", "ipo", 0.0), ("orpo", "sigmoid", 0.0)])
def test_weighted_step_is_the_gradient_of_the_preference_loss(small_model, method, loss_type, smoothing):
    """params.grad after Preference.step == finite differences of the step's loss computed
    from forward passes alone (reference held fixed), in float64 through the whole model."""
    cfg = small_model.config
    executor, params, targets = setup(small_model, 4, 8)
    pref = Preference(FinetuneOptions(method=method, beta=0.7, loss_type=loss_type, label_smoothing=smoothing))
    b = pair_batch(cfg.n_vocab, [0, 1], 8, seed=2)
    cache = np.full((2, 2), np.nan)
    n_pairs, n_chosen = Preference.counts([b])
    params.zero_grad()
    loss = pref.step(executor, b, cache, n_pairs, n_chosen, (0,))
    analytic = params.grad.copy()
    if method == "dpo":
        assert np.isfinite(cache).all() and pref._new == [(0, cache[0].tolist()), (1, cache[1].tolist())]
    ref = cache.copy()

    def objective(p):
        return pref.loss(executor, b, ref, n_pairs, n_chosen)
    assert objective(params.data) == loss
    err = fd_check(objective, {"p": params.data}, {"p": analytic}, eps=1e-5, rtol=1e-5, atol=1e-10, n_probe=200)
    assert err < 1e-5
    np.testing.assert_array_equal(ref, cache)                         # the reference stays as first computed


def test_split_micro_batches_give_the_same_gradient(small_model):
    """Two micro-batches of one pair each (normalized by the step's pairs) == one of two."""
    cfg = small_model.config
    o = FinetuneOptions(method="dpo", beta=0.5)
    both = pair_batch(cfg.n_vocab, [0, 1], 8, seed=4)
    halves = [Batch(both.inputs[k:k + 2], both.targets[k:k + 2], 0, False, sample_ids=both.sample_ids[k:k + 2])
              for k in (0, 2)]
    executor, params, targets = setup(small_model, 4, 8)
    pref = Preference(o)
    params.zero_grad()
    loss = pref.step(executor, both, np.full((2, 2), np.nan), *Preference.counts([both]), (0,))
    one = params.grad.copy()
    graph2, params2, targets2 = setup(small_model, 2, 8)
    pref2 = Preference(o)
    cache, counts, total = np.full((2, 2), np.nan), Preference.counts(halves), 0.0
    params2.zero_grad()
    for h in halves:
        total += pref2.step(graph2, h, cache, *counts, (0,))
    np.testing.assert_allclose(params2.grad, one, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(total, loss, rtol=1e-12)
    assert len(pref._rows) == 1 and len(pref2._rows) == 2


def test_disabled_adapters_are_the_base_model_and_switch_back_on(small_model):
    """The DPO reference: every Lora of the graph disabled gives the losses of a fresh
    adapter (B A = 0) bit for bit, in the trimmed graphs too (short rows), and leaves the
    parameters untouched."""
    cfg = small_model.config
    executor, params, targets = setup(small_model, 4, 40)
    b = pair_batch(cfg.n_vocab, [0, 1], 8, seed=5)                  # rows padded to 40 columns without targets
    b = Batch(np.pad(b.inputs, ((0, 0), (0, 32))), np.pad(b.targets, ((0, 0), (0, 32)), constant_values=-1),
              b.n_targets, False, sample_ids=b.sample_ids)
    w = (b.targets >= 0).astype(np.float64)
    before = params.data.copy()
    with disabled_adapters(executor.lora.values()):
        executor.loss(b.inputs, b.targets, w)                          # columns up to 32: a trimmed graph
        off = executor.losses.copy()
    assert executor._trimmed_executors and not any(a.disabled for a in executor.lora.values())
    np.testing.assert_array_equal(params.data, before)
    base = ParamBuffer(lora_specs(targets), np.float64)
    init_lora(base, targets, np.random.default_rng(9))                # a fresh adapter: B A = 0
    fresh = StepExecutor(cfg, FrozenBase(small_model), base, targets, 4, 40, "selective", 0.0, dtype=np.float64)
    fresh.loss(b.inputs, b.targets, w)
    np.testing.assert_array_equal(off, fresh.losses)
    executor.loss(b.inputs, b.targets, w)
    assert not np.array_equal(executor.losses, off)                      # the adapter is back on


# --------------------------------------------------------------------------- runs
GOOD = [" Speak, speak.", " Resolved. resolved.", " We know't, we know't."]
BAD = [" we'll have corn at our own price.", " chief enemy to the people.", " kill him"]
PROMPTS = ["First Citizen:", "All:", "Before we proceed", "You are all resolved", "Let us kill him",
           "hear me speak", "Caius Marcius", "rather to die"]


def write_pairs(path: Path, prompts: list[str]) -> Path:
    rows = [{"prompt": p, "chosen": GOOD[i % 3], "rejected": BAD[(i + 1) % 3]} for i, p in enumerate(prompts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_options(tmp: Path, model: Path, **over) -> FinetuneOptions:
    base = dict(model_base=model, train_data=write_pairs(tmp / "train.jsonl", PROMPTS * 2), ctx=24, batch=4,
                lora_r=4, adam_iter=4, save_every=0, warmup=2, adam_alpha=5e-3, method="dpo", plot=False,
                checkpoint_out=tmp / "chk-ITERATION.gguf", lora_out=tmp / "adapter-ITERATION.gguf")
    base.update(over)
    return FinetuneOptions(**base)


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_tiny_model_learns_held_out_preferences(tmp_path, tiny_model, method):
    """Held-out pairs (other prompts, the same preferred answers) go from a reward accuracy
    of 0 (DPO: rewards start equal) or chance to 1; the metrics carry TRL's names."""
    val = write_pairs(tmp_path / "val.jsonl", ["Speak", "famish", "corn"])
    o = run_options(tmp_path, tiny_model, method=method, adam_iter=12, val_data=val, eval_every=12,
                    metrics_out=tmp_path / "m.jsonl", save_best=True)
    res = finetune(o, quiet=True)
    rows = metrics(tmp_path / "m.jsonl")
    evals = [r for r in rows if "val_loss" in r]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in evals] == [0, 12] and len(steps) == 12
    assert evals[-1]["eval_rewards/accuracies"] == 1.0 and evals[-1]["val_loss"] < evals[0]["val_loss"]
    if method == "dpo":
        assert evals[0]["eval_rewards/accuracies"] == 0.0 and evals[0]["val_loss"] == pytest.approx(np.log(2))
        assert steps[0]["loss"] == pytest.approx(np.log(2))           # the policy starts as the reference
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert key in steps[-1] and "eval_" + key in evals[-1]
    assert steps[-1]["rewards/margins"] == pytest.approx(steps[-1]["rewards/chosen"] - steps[-1]["rewards/rejected"])
    assert ("nll_loss" in steps[-1]) == (method == "orpo")
    assert res.losses[-1] < res.losses[0]
    assert (tmp_path / "adapter-BEST.gguf").exists()
    from llamatune.plot import read_metrics
    c = read_metrics(tmp_path / "m.jsonl")                # the plot's curves: the accuracies too
    assert c.acc == [r["rewards/accuracies"] for r in steps] and c.val_acc_steps == [0, 12]
    if method == "orpo":
        pytest.importorskip("matplotlib", reason="matplotlib (the 'plot' extra) is not installed")
        from llamatune.plot import plot_metrics
        assert plot_metrics(tmp_path / "m.jsonl", tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def tensors(path: Path) -> dict[str, np.ndarray]:
    return {n: np.array(t.data) for n, t in GGUFFile(path).tensors.items()}


@pytest.mark.parametrize("over", [dict(), dict(grad_acc=2, batch=2, loss_type="ipo", val_split=0.25)])
def test_dpo_resume_is_bit_exact(tmp_path, tiny_model, over):
    """4 steps in one run == 2 steps, then resume from LATEST for 2 more: parameters, moments,
    data state (the reference cache in it) and metrics."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    finetune(run_options(one, tiny_model, metrics_out=one / "m.jsonl", **over), quiet=True)
    finetune(run_options(two, tiny_model, adam_iter=2, metrics_out=two / "m.jsonl", **over), quiet=True)
    res = finetune(run_options(two, tiny_model, checkpoint_in=two / "chk-LATEST.gguf", metrics_out=two / "m.jsonl",
                               **over), quiet=True)
    assert res.state.iteration == 4 and len(res.losses) == 2
    a, b = tensors(one / "chk-4.gguf"), tensors(two / "chk-4.gguf")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    fa, fb = GGUFFile(one / "chk-4.gguf"), GGUFFile(two / "chk-4.gguf")
    state = json.loads(fa.get("llamatune.data_state"))
    assert fa.get("llamatune.data_state") == fb.get("llamatune.data_state")
    assert np.isfinite(np.array(state["reference"], float)).any()
    # the step lines (an evaluation ends each run, so the resumed run has one more at step 2)
    steps = lambda path: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in metrics(path) if "loss" in r]  # noqa: E731
    assert steps(one / "m.jsonl") == steps(two / "m.jsonl")


def test_changed_preference_options_refuse_to_resume(tmp_path, tiny_model):
    from llamatune.errors import LlamatuneError
    finetune(run_options(tmp_path, tiny_model, adam_iter=1), quiet=True)
    with pytest.raises(LlamatuneError, match=r"cannot resume with changed options: --beta 0.1 -> 0.2"):
        finetune(run_options(tmp_path, tiny_model, adam_iter=2, beta=0.2,
                             checkpoint_in=tmp_path / "chk-LATEST.gguf"), quiet=True)


@pytest.mark.cuda
@pytest.mark.slow                                  # 13 s under the simulator
def test_dpo_step_on_cuda_matches_cpu(tmp_path, tiny_vocab):
    """The reweighted step and the reference with the adapter off on the CUDA backend (the
    simulator without a GPU): the CPU's losses, metrics and gradient."""
    from llamatune.backend import cpu, get_backend
    from llamatune.errors import LlamatuneError
    try:
        cuda = get_backend("cuda")
    except LlamatuneError as e:
        pytest.skip(f"no CUDA device or simulator: {e}")
    model = Model(write_tiny_model(tmp_path / "micro.gguf", tiny_vocab, n_embd=16, n_ff=24, head_dim=4, n_rot=4,
                                   n_layer=1))
    cfg = model.config
    targets = lora_targets(cfg, {k: 2 for k in ("attn_q", "attn_v", "ffn_down")}, 2.0, tied=False)
    b = pair_batch(cfg.n_vocab, [0], 6, seed=3)
    results = []
    for backend in (cpu(), cuda):
        params = ParamBuffer(lora_specs(targets))
        init_lora(params, targets, np.random.default_rng(1))
        params.data += np.random.default_rng(2).normal(0, 0.05, params.size).astype(np.float32)
        if backend is not cpu():
            params.to_device(backend)
        g = StepExecutor(cfg, FrozenBase(model, backend), params, targets, 2, 6, backend=backend)
        pref = Preference(FinetuneOptions(method="dpo", beta=0.5))
        cache = np.full((1, 2), np.nan)
        loss = pref.step(g, b, cache, 1, 1, (0,))
        results.append((loss, cache, pref._rows[0], params.host(params.grad).copy()))
    (l0, c0, r0, g0), (l1, c1, r1, g1) = results
    assert l1 == pytest.approx(l0, rel=1e-5)
    np.testing.assert_allclose(c1, c0, rtol=1e-5)
    np.testing.assert_allclose(r1, r0, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g1, g0, rtol=1e-3, atol=1e-6)


def test_dpo_on_two_mpi_ranks_trains_what_one_process_does(tmp_path, tiny_model, launcher):
    """mpiexec -n 2 against one process with --grad-acc 2: parameters, moments and the data
    state with every rank's reference values, bit for bit (skips without mpi4py / mpiexec)."""
    pairs = write_pairs(tmp_path / "train.jsonl", PROMPTS * 2)
    common = ["finetune", "--model-base", tiny_model, "--train-data", pairs, "--method", "dpo", "--ctx", 24,
              "--batch", 2, "--lora-r", 2, "--adam-iter", 3, "--save-every", 0, "--warmup", 1, "--no-plot"]
    assert len(test_mpi.ranks_match_grad_acc(tmp_path, launcher, common, 3)) == 3
