"""GRPO: the loss and advantages against TRL's formulas (numpy), the reweighted step's
gradient through the whole model by finite differences (float64), the rewards and their
errors, the batched group decode, and tiny-model runs (exact resume; a regex reward that
rises, slow)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fdcheck import fd_check
from llamatune.commands.finetune import finetune
from llamatune.errors import LlamatuneError
from llamatune.formats.gguf_io import GGUFFile
from llamatune.models.infer import Runner
from llamatune.models.model import Model
from llamatune.models.sampling import generate_group, generate_ids
from llamatune.models.weights import FrozenBase
from llamatune.options import FinetuneOptions
from llamatune.train import rewards as R
from llamatune.train.step import StepExecutor
from llamatune.train.grpo import GRPO, GroupBatch, coefficients, group_advantages, layout, token_terms
from llamatune.train.objective import token_losses
from llamatune.train.lora import disabled_adapters, init_lora, lora_specs, lora_targets
from llamatune.train.params import ParamBuffer

import test_mpi
from conftest import write_tiny_model
from test_mpi import launcher  # noqa: F401  (the fixture: `mpiexec -n 2`, or a skip with the reason)

RANKS = {k: 2 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}


# --------------------------------------------------------------------------- TRL's formulas
def trl_advantages(rewards, G, scale):
    """GRPOTrainer._generate_and_score_completions's advantages, in numpy as TRL writes them."""
    grouped = rewards.reshape(-1, G)
    mean = np.repeat(grouped.mean(axis=1), G)
    std = np.repeat(grouped.std(axis=1, ddof=1), G)          # torch.std: unbiased
    if scale == "batch":
        std = np.full_like(rewards, rewards.std(ddof=1))
    adv = rewards - mean
    return adv / (std + 1e-4) if scale != "none" else adv


def trl_loss(logp, old, ref, adv, mask, eps_low, eps_high, beta, loss_type, max_len, num_items):
    """GRPOTrainer._compute_loss for one micro-batch (importance sampling per token), numpy."""
    coef_1 = np.exp(logp - old)
    coef_2 = np.clip(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -np.minimum(coef_1 * adv[:, None], coef_2 * adv[:, None])
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * (np.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / max(mask.sum(), 1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.shape[0] * max_len)
    return (per_token_loss * mask).sum() / num_items               # dapo


def random_batch(seed, n=6, T=9):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, n)
    mask = np.arange(T)[None, :] < lengths[:, None]
    logp = -rng.uniform(0.05, 4.0, (n, T))
    old = logp + rng.uniform(-0.45, 0.45, (n, T))               # ratios 0.64 .. 1.57: both clips hit
    ref = logp + rng.normal(0, 0.3, (n, T))
    adv = rng.normal(0, 1, n)
    return logp, old, ref, adv, mask, lengths


@pytest.mark.parametrize("G, scale", [(4, "group"), (3, "batch"), (2, "none")])
def test_advantages_match_trl(G, scale):
    r = np.random.default_rng(0).integers(0, 3, 12 if G != 3 else 12).astype(float)
    r[:G] = 1.0                                                  # a group of equal rewards: advantages 0
    adv, mean, std = group_advantages(r, G, scale)
    np.testing.assert_allclose(adv, trl_advantages(r, G, scale), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(mean, r.reshape(-1, G).mean(axis=1), rtol=1e-15)
    assert (adv[:G] == 0).all()


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize("beta, eps_high", [(0.0, 0.2), (0.04, 0.28)])
def test_loss_and_derivative_match_trl(loss_type, beta, eps_high):
    """sum_i c_i sum_t l_it == TRL's loss on one micro-batch (its dapo normaliser: the batch's
    tokens), and dl/dlogp == central differences of TRL's loss, ratios in and out of the clip."""
    logp, old, ref, adv, mask, lengths = random_batch(1)
    n_items = int(mask.sum())

    def ours(lp):
        t = token_terms(lp, old, ref, adv, mask, 0.2, eps_high, beta)
        c = coefficients(loss_type, lengths, len(lengths), n_items, n_items, 1, 9)
        return float((c * t.loss.sum(axis=1)).sum()), c[:, None] * t.dlogp, t

    def trl(lp):
        return trl_loss(lp, old, ref, adv, mask, 0.2, eps_high, beta, loss_type, 9, n_items)
    loss, grad, t = ours(logp)
    np.testing.assert_allclose(loss, trl(logp), rtol=1e-13)
    numeric = np.zeros_like(logp)
    for idx in zip(*np.nonzero(mask)):
        d = np.zeros_like(logp)
        d[idx] = 1e-6
        numeric[idx] = (trl(logp + d) - trl(logp - d)) / 2e-6
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-10)
    assert t.low.any() and t.high.any()                          # both clips are exercised
    assert not (t.low[~mask].any() or t.high[~mask].any() or t.loss[~mask].any())


def test_ratio_one_is_weighted_cross_entropy():
    """Without KL, at rho = 1 the weights -c dl/dlogp are c_i A_i on every completion token."""
    logp, _, _, adv, mask, lengths = random_batch(2)
    t = token_terms(logp, logp, None, adv, mask, 0.2, 0.2, 0.0)
    np.testing.assert_array_equal(-t.dlogp, np.where(mask, adv[:, None], 0.0))
    np.testing.assert_array_equal(t.loss, np.where(mask, -adv[:, None], 0.0))


# --------------------------------------------------------------------------- through the model
@pytest.fixture(scope="module")
def small_model(tmp_path_factory, tiny_vocab):
    return Model(write_tiny_model(tmp_path_factory.mktemp("g") / "m.gguf", tiny_vocab, n_embd=32, n_ff=48,
                                  head_dim=8, n_rot=8))


def group_batch(n_vocab: int, B: int, T: int, seed: int) -> GroupBatch:
    """Two groups of B / 2 random completions after a 3-token prompt each."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, n_vocab, 3).tolist() for _ in range(2) for _ in range(B // 2)]
    completions = [rng.integers(0, n_vocab, int(rng.integers(1, T - 2))).tolist() for _ in range(B)]
    inputs, targets = layout(prompts, completions, B, T, 0)
    rewards = rng.integers(0, 2, (B, 1)).astype(float)
    adv, _, _ = group_advantages(rewards[:, 0], B // 2)
    return GroupBatch(inputs, targets, int((targets >= 0).sum()), False, sample_ids=np.repeat([0, 1], B // 2),
                      advantages=adv, rewards=rewards, lengths=np.array([len(c) for c in completions]),
                      ended=np.zeros(B, bool))


def grpo_options(**over) -> FinetuneOptions:
    base = dict(method="grpo", reward=["regex:a"], num_generations=2, batch=4, max_completion_length=6, ctx=9,
                beta=0.0, loss_type="dapo")
    base.update(over)
    return FinetuneOptions(**base)


def setup(model, B, T, seed=0):
    targets = lora_targets(model.config, RANKS, alpha=3.0, tied=False)
    params = ParamBuffer(lora_specs(targets), np.float64)
    init_lora(params, targets, np.random.default_rng(seed))
    params.data[...] += np.random.default_rng(seed + 1).normal(0, 0.05, params.size)   # policy != base
    executor = StepExecutor(model.config, FrozenBase(model), params, targets, B, T, "selective", 0.0, dtype=np.float64)
    return executor, params


@pytest.mark.parametrize("loss_type, beta, shift", [("dapo", 0.0, False), ("grpo", 0.1, False),
                                                    ("dr_grpo", 0.1, True), ("bnpo", 0.0, True)])
def test_weighted_step_is_the_gradient_of_the_grpo_loss(small_model, loss_type, beta, shift):
    """params.grad after GRPO.micro_step == finite differences of the loss from forward passes
    alone (old and reference log-probabilities held fixed), float64 through the whole model;
    `shift`: old log-probabilities moved off the policy's so that ratios clip."""
    executor, params = setup(small_model, 4, 9)
    g = GRPO(grpo_options(loss_type=loss_type, beta=beta), small_model)
    b = group_batch(small_model.config.n_vocab, 4, 9, seed=3)
    if shift:
        current = -token_losses(executor, b)
        b.old_logp = current + np.random.default_rng(4).uniform(-0.4, 0.4, current.shape)
    g.begin_step([b])
    params.zero_grad()
    loss = g.micro_step(executor, b, (0,))
    analytic = params.grad.copy()
    assert (b.ref_logp is not None) == (beta > 0) and b.old_logp is not None
    assert g.micro_loss(executor, b, (0,)) == pytest.approx(loss, rel=1e-12, abs=1e-15)
    err = fd_check(lambda p: g.micro_loss(executor, b, (0,)), {"p": params.data}, {"p": analytic}, eps=1e-5,
                   rtol=1e-5, atol=1e-10, n_probe=150)
    assert err < 1e-5
    if beta:                                                     # the reference is the base, adapter off
        with disabled_adapters(executor.lora.values()):
            np.testing.assert_array_equal(b.ref_logp, -token_losses(executor, b))


def test_loss_on_a_fixed_batch_is_trls(small_model):
    """The micro-batch loss equals TRL's formula applied to the graph's own per-token
    log-probabilities (forward only), with clipped ratios and the KL term."""
    executor, params = setup(small_model, 4, 9, seed=5)
    g = GRPO(grpo_options(beta=0.05, epsilon=0.1, epsilon_high=0.3, loss_type="grpo"), small_model)
    b = group_batch(small_model.config.n_vocab, 4, 9, seed=6)
    logp = -token_losses(executor, b)
    with disabled_adapters(executor.lora.values()):
        ref = -token_losses(executor, b)
    b.old_logp = logp + np.random.default_rng(7).uniform(-0.3, 0.3, logp.shape)
    g.begin_step([b])
    mask = b.targets >= 0
    want = trl_loss(logp, b.old_logp, ref, b.advantages, mask, 0.1, 0.3, 0.05, "grpo", 6, mask.sum())
    assert g.micro_loss(executor, b, (0,)) == pytest.approx(want, rel=1e-12)


# --------------------------------------------------------------------------- rewards
def test_built_in_rewards():
    boxed = R.parse_rewards(["boxed-answer"], [])
    comps = ["so \\boxed{12}", "\\boxed{1} then \\boxed{ 42 }", "no box", "\\boxed{4.0}", "\\boxed{x{y}}"]
    table = R.score(boxed, [""] * 5, comps, {"answer": ["12", "42", "3", 4, "x{y}"]})
    np.testing.assert_array_equal(table[:, 0], [1, 1, 0, 1, 1])
    two = R.parse_rewards(["regex:^\\s*A", "regex:b+"], [0.5, 2.0])
    t = R.score(two, ["p"] * 3, [" A b", "B", [{"role": "assistant", "content": "Abb"}]], {})
    np.testing.assert_array_equal(t, [[1, 1], [0, 0], [1, 1]])
    np.testing.assert_array_equal(R.total(t, two), [2.5, 0, 2.5])


def test_user_reward_from_a_file(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text("def length(prompts, completions, level, **kw):\n"
                 "    return [len(c) * l if l else None for c, l in zip(completions, level)]\n"
                 "def boom(prompts, completions, **kw):\n    raise KeyError('gone')\n"
                 "def short(prompts, completions, **kw):\n    return [1.0]\n"
                 "def nan(prompts, completions, **kw):\n    return [float('nan')] * len(completions)\n"
                 "def text(prompts, completions, **kw):\n    return ['x'] * len(completions)\n")
    rs = R.parse_rewards([f"{f}:length", "regex:a"], [1.0, 10.0])
    t = R.score(rs, ["p", "q"], ["aa", "bbb"], {"level": [2, None]})
    np.testing.assert_array_equal(t, [[4, 1], [np.nan, 0]])
    np.testing.assert_array_equal(R.total(t, rs), [14, 0])      # None is left out of the sum (TRL's nansum)
    for name, message in (("boom", r"--reward .*:boom raised KeyError: 'gone'"),
                          ("short", r"returned 1 values for 2 completions"),
                          ("nan", r"returned nan for completion 0: rewards must be finite"),
                          ("text", r"returned 'x' for completion 0, not a number")):
        with pytest.raises(LlamatuneError, match=message):
            R.score(R.parse_rewards([f"{f}:{name}"], []), ["p", "q"], ["a", "b"], {})


def test_reward_results_that_are_not_lists_and_missing_fields(tmp_path):
    f = tmp_path / "odd.py"
    f.write_text("def none(prompts, completions, **kw):\n    return None\n"
                 "def text(prompts, completions, **kw):\n    return 'ab'\n")
    for name, message in (("none", r"returned NoneType, not a list of 2 numbers"),
                          ("text", r"returned str, not a list of 2 numbers")):
        with pytest.raises(LlamatuneError, match=message):
            R.score(R.parse_rewards([f"{f}:{name}"], []), ["p", "q"], ["a", "b"], {})
    with pytest.raises(LlamatuneError, match=r"--reward boxed-answer: the rows have no 'answer' field"):
        R.score(R.parse_rewards(["boxed-answer"], []), ["p"], ["\\boxed{1}"], {"level": [1]})


def test_loss_type_unknown_to_the_maths():
    with pytest.raises(ValueError, match="unknown GRPO loss type 'sigmoid'"):
        coefficients("sigmoid", np.array([3]), 1, 3, 3, 1, 4)


@pytest.mark.parametrize("specs, weights, message", [
    ([], [], "needs at least one --reward"),
    (["regex:("], [], r"regex:\(: not a valid regular expression"),
    (["nowhere.py:f"], [], r"nowhere.py not found"),
    (["json:nothing_here"], [], r"json has no function nothing_here"),
    (["no_such_module_xyz:f"], [], r"loading no_such_module_xyz failed \(ModuleNotFoundError"),
    (["plain"], [], r"give boxed-answer, regex:PATTERN"),
    (["regex:a"], [1.0, 2.0], r"2 weight\(s\) for 1 reward"),
    (["regex:a"], [float("nan")], r"--reward-weights nan: must be a finite number"),
])
def test_bad_reward_specs(specs, weights, message):
    with pytest.raises(LlamatuneError, match=message):
        R.parse_rewards(specs, weights)


# --------------------------------------------------------------------------- sampling
def test_group_decode_is_the_single_sequence_decode(tiny_model):
    """At a vanishing temperature every row of a group is the greedy continuation that the
    one-sequence KV-cached loop gives; a stop id ends a row and is kept."""
    runner = Runner(Model(tiny_model))
    ids = runner.model.tokenizer.encode("First Citizen:", add_special=True)
    greedy = list(generate_ids(runner, ids, 10, temp=0.0, n_ctx=64))
    rows = generate_group(runner, ids, 3, 10, np.random.default_rng(0), 1e-6, 1.0)
    assert rows == [greedy] * 3
    stop = {greedy[4]}
    cut = generate_group(runner, ids, 2, 10, np.random.default_rng(0), 1e-6, 1.0, stop)
    assert cut == [greedy[:greedy.index(greedy[4]) + 1]] * 2


def test_rows_that_end_leave_the_batch(tiny_model):
    """Rows end at different steps (a seventh of the vocabulary stops them) and leave the
    batch with their cache rows: replaying the draws (one uniform per live row and step, in
    row order) on each completion's full forward without a cache gives the same tokens."""
    runner = Runner(Model(tiny_model))
    ids = runner.model.tokenizer.encode("First Citizen:", add_special=True)
    stop = set(range(0, runner.model.config.n_vocab, 7))
    rows = generate_group(runner, ids, 4, 12, np.random.default_rng(3), 1.0, 1.0, stop)
    assert len({len(r) for r in rows}) > 1 and any(r[-1] in stop for r in rows)
    full = [runner.forward(np.asarray([ids + r]))[0].astype(np.float64) for r in rows]
    rng, live, got = np.random.default_rng(3), [0, 1, 2, 3], [[], [], [], []]
    for j in range(12):
        for r in live:
            z = full[r][len(ids) - 1 + j]
            c = np.cumsum(np.exp(z - z.max()))
            got[r].append(int(np.searchsorted(c, rng.random() * c[-1], side="right")))
        live = [r for r in live if got[r][-1] not in stop]
        if not live:
            break
    assert got == rows


def test_group_sampling_is_seeded(tiny_model):
    runner = Runner(Model(tiny_model))
    ids = runner.model.tokenizer.encode("All:", add_special=True)
    a = generate_group(runner, ids, 4, 8, np.random.default_rng(5), 1.0, 0.9)
    b = generate_group(runner, ids, 4, 8, np.random.default_rng(5), 1.0, 0.9)
    assert a == b and len({tuple(r) for r in a}) > 1


# --------------------------------------------------------------------------- runs
PROMPTS = ["First Citizen:", "All:", "Before we proceed", "You are all resolved", "Let us kill him",
           "hear me speak", "Caius Marcius", "rather to die"]


def write_prompts(path: Path, rows: list[dict] | None = None) -> Path:
    rows = rows or [{"prompt": p, "answer": str(i)} for i, p in enumerate(PROMPTS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_options(tmp: Path, model: Path, **over) -> FinetuneOptions:
    base = dict(model_base=model, train_data=write_prompts(tmp / "train.jsonl"), ctx=16, batch=4, lora_r=2,
                adam_iter=4, save_every=0, warmup=1, adam_alpha=5e-3, method="grpo", reward=["regex:e"],
                num_generations=2, max_completion_length=6, plot=False, output_dir=tmp, metrics_out=tmp / "m.jsonl")
    base.update(over)
    o = FinetuneOptions(**base)
    o.check()
    return o


def tensors(path: Path) -> dict[str, np.ndarray]:
    return {n: np.array(t.data) for n, t in GGUFFile(path).tensors.items()}


def test_grpo_resume_is_bit_exact(tmp_path, tiny_model):
    """4 steps in one run == 2 steps, then resume from LATEST for 2 more: the completions
    (sampling state in the checkpoint), parameters, moments and the metrics."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    over = dict(beta=0.05, grad_acc=2)
    finetune(run_options(one, tiny_model, **over), quiet=True)
    finetune(run_options(two, tiny_model, adam_iter=2, **over), quiet=True)
    res = finetune(run_options(two, tiny_model, checkpoint_in=two / "chk-LATEST.gguf", **over), quiet=True)
    assert res.state.iteration == 4 and len(res.losses) == 2
    test_mpi.assert_same_training(one / "chk-4.gguf", two / "chk-4.gguf")   # tensors, counters, data state
    assert "sampling_rng_state" in json.loads(GGUFFile(one / "chk-4.gguf").get("llamatune.data_state"))
    timing = ("tokens_per_s", "sampling/tokens_per_second", "sampling/seconds")
    rows = lambda d: [{k: v for k, v in json.loads(x).items() if k not in timing}  # noqa: E731
                      for x in (d / "m.jsonl").read_text().splitlines()]
    ra = rows(one)
    assert ra == rows(two)
    from llamatune.plot import read_metrics
    c = read_metrics(one / "m.jsonl")                       # the plot's reward curve
    assert c.reward_steps == [1, 2, 3, 4] and c.reward == [r["reward"] for r in ra]
    for key in ("reward", "reward_std", "rewards/regex:e/mean", "rewards/regex:e/std", "kl",
                "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean"):
        assert key in ra[-1], key


def test_plot_draws_the_reward(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the 'plot' extra) is not installed")
    from llamatune.plot import plot_metrics
    rows = [{"step": k, "loss": 0.01 * k, "reward": 0.1 * k} for k in range(1, 6)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_metrics(tmp_path / "m.jsonl", tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_reward_that_raises_stops_the_run_cleanly(tmp_path, tiny_model):
    f = tmp_path / "bad_reward.py"
    f.write_text("def reward(prompts, completions, **kw):\n    return [1 / 0 for c in completions]\n")
    with pytest.raises(LlamatuneError, match=r"^--reward .*bad_reward.py:reward raised ZeroDivisionError"):
        finetune(run_options(tmp_path, tiny_model, reward=[f"{f}:reward"]), quiet=True)
    assert not list(tmp_path.glob("adapter-*.gguf")) and not list(tmp_path.glob("chk-*.gguf"))


def test_bad_grpo_data_and_options(tmp_path, tiny_model):
    with pytest.raises(LlamatuneError, match=r"prompt 2 has no 'answer' field, which --reward boxed-answer reads"):
        rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b"}]
        finetune(run_options(tmp_path, tiny_model, train_data=write_prompts(tmp_path / "x.jsonl", rows),
                             reward=["boxed-answer"]), quiet=True)
    long = [{"prompt": "First Citizen: " * 8}]
    with pytest.raises(LlamatuneError, match=r"long.jsonl:1: the prompt has \d+ tokens: with --max-completion-length 6 "
                                             r"it needs --ctx \d+ \(--ctx is 16\)"):
        finetune(run_options(tmp_path, tiny_model, train_data=write_prompts(tmp_path / "long.jsonl", long)), quiet=True)
    with pytest.raises(LlamatuneError, match=r"no 'prompt' field"):
        finetune(run_options(tmp_path, tiny_model, train_data=write_prompts(tmp_path / "c.jsonl", [{"text": "a"}])),
                 quiet=True)
    for over, message in ((dict(batch=3), r"--batch 3: --method grpo puts whole groups"),
                          (dict(num_generations=1, batch=1), r"--num-generations 1: must be at least 2"),
                          (dict(loss_type="sigmoid"), r"--loss-type 'sigmoid': choose dapo, grpo, bnpo, dr_grpo \(--method grpo\)"),
                          (dict(temperature=0.0), r"--temperature 0.0: must be greater than 0"),
                          (dict(max_completion_length=16), r"--max-completion-length 16 leaves no room for a prompt in --ctx 16"),
                          (dict(rank_att_norm=2), r"not with norm adapters \(attn_norm"),
                          (dict(val_split=0.25), r"not with --val-split"),
                          (dict(scale_rewards="x"), r"--scale-rewards 'x': choose group, batch, none"),
                          (dict(top_p=0.0), r"--top-p 0.0: must be in \(0, 1\]"),
                          (dict(epsilon=1.0), r"--epsilon 1.0: must be in \[0, 1\)"),
                          (dict(epsilon_high=-1.0), r"--epsilon-high -1.0: must be at least 0"),
                          (dict(reward_weights=[1.0, 2.0]), r"--reward-weights: 2 weight\(s\) for 1 --reward"),
                          (dict(fine_tune_type="full"), r"not with --fine-tune-type full"),
                          (dict(pack=True, lora_dropout=0.1), r"not with --pack, --lora-dropout")):
        with pytest.raises(LlamatuneError, match=message):
            run_options(tmp_path, tiny_model, **over)


def test_bad_prompt_files_and_states(tmp_path, tiny_model):
    from llamatune.data.prompts import load_prompts
    from llamatune.train.grpo import GroupBatcher
    tok = Model(tiny_model).tokenizer
    o = run_options(tmp_path, tiny_model)
    (tmp_path / "t.txt").write_text("plain text, not rows\n")
    with pytest.raises(LlamatuneError, match=r"t.txt: --method grpo trains on prompt-only rows"):
        load_prompts(tmp_path / "t.txt", tok, o)
    with pytest.raises(LlamatuneError, match=r"n.jsonl:1: a row must be a JSON object, got int"):
        load_prompts(write_prompts(tmp_path / "n.jsonl", [[1, 2]]), tok, o)
    o.skip_bad_rows = True
    with pytest.raises(LlamatuneError, match=r"b.jsonl: no prompt to train on"):
        load_prompts(write_prompts(tmp_path / "b.jsonl", [{"text": "a"}]), tok, o)
    o.skip_bad_rows = False
    samples = load_prompts(write_prompts(tmp_path / "p.jsonl"), tok, o)
    batcher = GroupBatcher(samples, o, tok.n_vocab, tok.bos_id, tok.eos_id, rollout=None)
    state = batcher.state()
    with pytest.raises(LlamatuneError, match=r"invalid sampling state"):
        batcher.load_state({**state, "sampling_rng_state": {"bit_generator": "MT19937"}}, samples)
    del state["sampling_rng_state"]
    with pytest.raises(LlamatuneError, match=r"no sampling state \(not a --method grpo checkpoint\)"):
        batcher.load_state(state, samples)


def test_beta_and_loss_type_defaults_follow_the_method():
    o = FinetuneOptions(method="grpo", reward=["regex:a"], batch=8, ctx=512)
    o.check()
    assert (o.beta, o.loss_type) == (0.0, "dapo")
    d = FinetuneOptions(method="dpo")
    d.check()
    assert (d.beta, d.loss_type) == (0.1, "sigmoid")


def test_grpo_on_two_mpi_ranks_trains_what_one_process_does(tmp_path, tiny_model, launcher):
    """mpiexec -n 2 against one process with --grad-acc 2: every rank samples the step's
    groups from the same sampling state and trains its share; parameters, moments, data
    state and metrics bit for bit (skips without mpi4py / mpiexec)."""
    data = write_prompts(tmp_path / "train.jsonl")
    common = ["finetune", "--model-base", tiny_model, "--train-data", data, "--method", "grpo", "--reward", "regex:e",
              "--num-generations", 2, "--max-completion-length", 6, "--ctx", 16, "--batch", 4, "--lora-r", 2,
              "--adam-iter", 3, "--save-every", 0, "--warmup", 1, "--beta", 0.05, "--no-plot"]
    rows = test_mpi.ranks_match_grad_acc(tmp_path, launcher, common, 3,
                                         ("tokens_per_s", "sampling/tokens_per_second", "sampling/seconds"))
    assert "kl" in rows[-1]


@pytest.mark.slow
def test_regex_reward_rises_on_a_tiny_model(tmp_path):
    """A few dozen GRPO steps on the shared tiny Shakespeare model (Q8_0) raise the share of
    completions that a regex reward pays for (the word "the" within 8 tokens: about 0.2 of
    the base's samples): the mean of the last 8 steps well above the first 8's."""
    model = Path(__file__).resolve().parents[2] / "shared" / "models" / "tiny-Q8_0.gguf"
    if not model.exists():
        pytest.skip(f"{model} is absent")
    o = run_options(tmp_path, model, reward=["regex:the"], adam_iter=32, batch=8, num_generations=4,
                    max_completion_length=8, ctx=24, adam_alpha=2e-2, lora_r=4, warmup=2)
    finetune(o, quiet=True)
    steps = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    rewards = [s["reward"] for s in steps if "reward" in s]
    assert len(rewards) == 32
    first, last = float(np.mean(rewards[:8])), float(np.mean(rewards[-8:]))
    assert last > first + 0.25 and last > 0.5, (first, last, rewards)
