"""`llamatune plot`: training and validation loss against optimizer steps, as a PNG.

Reads the metrics log (metrics.py). Training loss is drawn raw (thin) and smoothed
with TensorBoard's debiased exponential moving average; validation loss as points
joined by a line, its lowest value marked. Preference runs (--method dpo / orpo) add
the reward accuracy (smoothed) and the validation reward accuracy on a right axis; GRPO
runs (--method grpo) the mean reward (raw and smoothed) there. matplotlib is an optional extra
(`pip install 'llamatune[plot]'`), imported only when a plot is drawn, on its
non-interactive Agg backend; the module itself imports nothing heavy, so the command
line can take its defaults from here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import LlamatuneError
from .options import PlotOptions

INSTALL_HINT = "pip install 'llamatune[plot]' (or pip install matplotlib)"
SMOOTH = PlotOptions.smooth        # weight of the moving average over the training loss (llamatune/options/)


@dataclass
class Curves:
    steps: list[int] = field(default_factory=list)        # optimizer steps with a training loss
    loss: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)    # evaluations
    val_loss: list[float] = field(default_factory=list)
    acc_steps: list[int] = field(default_factory=list)     # preference runs: reward accuracy per step
    acc: list[float] = field(default_factory=list)
    val_acc_steps: list[int] = field(default_factory=list)  # and per evaluation
    val_acc: list[float] = field(default_factory=list)
    reward_steps: list[int] = field(default_factory=list)  # GRPO runs: the mean reward per step
    reward: list[float] = field(default_factory=list)


def read_metrics(path: Path) -> Curves:
    """The curves of a metrics log; a half-written last line (a running run) is ignored."""
    path = Path(path)
    if not path.is_file():
        raise LlamatuneError(f"{path}: metrics file not found")
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    c = Curves()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not an object with an integer 'step'")
        except ValueError as e:
            if i == len(lines):                       # no newline yet: still being written
                break
            raise LlamatuneError(f"{path}:{i}: not a metrics line ({e})") from None
        if row.get("loss") is not None:
            c.steps.append(row["step"])
            c.loss.append(float(row["loss"]))
        if row.get("val_loss") is not None:
            c.val_steps.append(row["step"])
            c.val_loss.append(float(row["val_loss"]))
        for key, steps, values in (("rewards/accuracies", c.acc_steps, c.acc),
                                   ("eval_rewards/accuracies", c.val_acc_steps, c.val_acc),
                                   ("reward", c.reward_steps, c.reward)):
            if row.get(key) is not None:
                steps.append(row["step"])
                values.append(float(row[key]))
    if not c.steps and not c.val_steps:
        raise LlamatuneError(f"{path}: no training or validation loss in this metrics file")
    return c


def smoothed(values: list[float], weight: float) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing): with weight w,
    ema_i = w ema_{i-1} + (1 - w) x_i, divided by 1 - w^(i+1) so it starts at x_0."""
    out, ema = [], 0.0
    for i, x in enumerate(values):
        ema = weight * ema + (1 - weight) * x
        out.append(ema / (1 - weight ** (i + 1)))
    return out


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise LlamatuneError(f"plotting needs matplotlib, which is not installed: {INSTALL_HINT}") from None
    return plt


def _right_axis(ax, c: Curves, smooth: float) -> None:
    """Preference runs: the reward accuracy; GRPO runs: the mean reward (right axis)."""
    if c.reward_steps:
        r = ax.twinx()
        r.plot(c.reward_steps, c.reward, color="tab:green", alpha=0.4, linewidth=0.8, label="mean reward")
        r.plot(c.reward_steps, smoothed(c.reward, smooth), color="tab:green", linewidth=1.5,
               label=f"mean reward, smoothed (EMA {smooth:g})")
        r.set_ylabel("mean reward of the step's completions")
        r.legend(loc="center right")
    if not (c.acc_steps or c.val_acc_steps):
        return
    acc = ax.twinx()
    if c.acc_steps:
        acc.plot(c.acc_steps, smoothed(c.acc, smooth), color="tab:green", linewidth=1.5,
                 label=f"reward accuracy, smoothed (EMA {smooth:g})")
    if c.val_acc_steps:
        acc.plot(c.val_acc_steps, c.val_acc, color="tab:olive", marker="s", markersize=4, linewidth=1.5,
                 label="validation reward accuracy")
    acc.set_ylim(-0.02, 1.02)
    acc.set_ylabel("reward accuracy (chosen rewarded above rejected)")
    acc.legend(loc="center right")


def plot_metrics(path: Path, out: Path, smooth: float = SMOOTH, log_y: bool = False, title: str | None = None) -> Path:
    """Draw the curves of the metrics log `path` into the PNG `out`; returns `out`."""
    if not 0 <= smooth < 1:
        raise LlamatuneError(f"--smooth {smooth}: must be in [0, 1)")
    c = read_metrics(path)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5), dpi=120)
    try:
        if c.steps:
            ax.plot(c.steps, c.loss, color="tab:blue", alpha=0.4, linewidth=0.8, label="training loss")
            ax.plot(c.steps, smoothed(c.loss, smooth), color="tab:blue", linewidth=2,
                    label=f"training loss, smoothed (EMA {smooth:g})")
        if c.val_steps:
            ax.plot(c.val_steps, c.val_loss, color="tab:orange", marker="o", markersize=4, linewidth=1.5,
                    label="validation loss")
            k = c.val_loss.index(min(c.val_loss))
            ax.plot([c.val_steps[k]], [c.val_loss[k]], color="tab:red", marker="*", markersize=14, linestyle="none",
                    label=f"best validation loss {c.val_loss[k]:.4f} (step {c.val_steps[k]})")
        if log_y:
            ax.set_yscale("log")
            for axis_format in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                axis_format(plt.FuncFormatter(lambda v, _: f"{v:.3g}"))   # 5.8, not 5.8x10^0
        ax.set_xlabel("optimizer step")
        what = ("preference loss, mean per pair" if c.acc_steps or c.val_acc_steps else
                "GRPO loss" if c.reward_steps else "mean cross-entropy per target token, nats")
        ax.set_ylabel(f"loss ({what})" + (", log scale" if log_y else ""))
        _right_axis(ax, c, smooth)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(title or f"Loss: {Path(path).resolve().parent.name}/{Path(path).name}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="best")
        fig.tight_layout()
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
    finally:
        plt.close(fig)
    return out
