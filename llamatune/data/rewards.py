"""GRPO's reward functions: what --reward names, loaded once, called on each group.

A reward has HF TRL's signature, `reward(prompts, completions, **row_fields) -> list[float]`:
prompts and completions are aligned lists (one entry per completion: a prompt is repeated
for each of its G completions), each the row's `prompt` as given (text, or a list of
messages) and the completion as text (for a conversational prompt the list
[{"role": "assistant", "content": text}], as TRL). Every other field of the rows comes as
a keyword argument holding one value per completion. A value of None means "does not
apply" (TRL: NaN, left out of the weighted sum, which sums the others).

  boxed-answer      1.0 where the last \\boxed{...} of the completion equals the row's
                    `answer` (both stripped; numbers compared as numbers), else 0.0
  regex:PATTERN     1.0 where PATTERN matches the completion (re.search), else 0.0
  FILE.py:NAME      the function NAME of a Python file
  MODULE:NAME       the function NAME of an importable module (dotted)

Several --reward add up, each times its --reward-weights entry (default 1). A reward
that raises, returns the wrong length, a non-number or NaN, or needs a field the rows
lack, stops the run with one line naming the reward.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import LlamatuneError

BOXED = "boxed-answer"


@dataclass(frozen=True)
class Reward:
    name: str                                 # as given to --reward; TRL's rewards/<name>/mean
    function: Callable
    weight: float = 1.0
    needs: tuple[str, ...] = ()               # row fields it reads (checked before training)


def completion_text(c) -> str:
    """The text of a completion as rewards get it (a string, or TRL's list of one message)."""
    return c if isinstance(c, str) else str(c[-1]["content"])


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} of text (braces nested), or None."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, j = 1, i + len("\\boxed{")
    for k in range(j, len(text)):
        depth += {"{": 1, "}": -1}.get(text[k], 0)
        if depth == 0:
            return text[j:k].strip()
    return None


def same_answer(got: str | None, want) -> bool:
    """Whether a boxed answer equals the row's: as numbers where both parse, else as text."""
    if got is None:
        return False
    want = str(want).strip()
    try:
        return float(got.replace(",", "")) == float(want.replace(",", ""))
    except ValueError:
        return got == want


def boxed_answer(prompts, completions, answer, **_) -> list[float]:
    """1.0 where the completion's last \\boxed{} equals the row's answer."""
    return [float(same_answer(last_boxed(completion_text(c)), a)) for c, a in zip(completions, answer)]


def regex_reward(pattern: str) -> Callable:
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise LlamatuneError(f"--reward regex:{pattern}: not a valid regular expression ({e})") from None

    def reward(prompts, completions, **_) -> list[float]:
        return [float(compiled.search(completion_text(c)) is not None) for c in completions]
    return reward


def load_function(spec: str) -> Callable:
    """FILE.py:NAME or MODULE:NAME -> the function, or one line saying what is wrong."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise LlamatuneError(f"--reward {spec}: give boxed-answer, regex:PATTERN, FILE.py:FUNCTION or "
                             "MODULE:FUNCTION")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise LlamatuneError(f"--reward {spec}: {path} not found")
            module_spec = importlib.util.spec_from_file_location(f"llamatune_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except LlamatuneError:
        raise
    except Exception as e:  # noqa: BLE001 - any error of the user's module is theirs to see, in one line
        raise LlamatuneError(f"--reward {spec}: loading {where} failed ({type(e).__name__}: {e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise LlamatuneError(f"--reward {spec}: {where} has no function {name}")
    return fn


def parse_rewards(specs: list[str], weights: list[float]) -> list[Reward]:
    """--reward (repeatable) and --reward-weights -> the rewards, checked."""
    if not specs:
        raise LlamatuneError("--method grpo needs at least one --reward (boxed-answer, regex:PATTERN, "
                             "FILE.py:FUNCTION or MODULE:FUNCTION)")
    if weights and len(weights) != len(specs):
        raise LlamatuneError(f"--reward-weights: {len(weights)} weight(s) for {len(specs)} reward(s)")
    out = []
    for k, spec in enumerate(specs):
        w = float(weights[k]) if weights else 1.0
        if not math.isfinite(w):
            raise LlamatuneError(f"--reward-weights {w}: must be a finite number")
        if spec == BOXED:
            out.append(Reward(spec, boxed_answer, w, ("answer",)))
        elif spec.startswith("regex:"):
            out.append(Reward(spec, regex_reward(spec[len("regex:"):]), w))
        else:
            out.append(Reward(spec, load_function(spec), w))
    return out


def score(rewards: list[Reward], prompts: list, completions: list, fields: dict[str, list]) -> np.ndarray:
    """(n, R) float64: each reward of each completion (NaN where a reward returned None)."""
    n = len(completions)
    table = np.empty((n, len(rewards)))
    for j, r in enumerate(rewards):
        missing = [f for f in r.needs if f not in fields]
        if missing:
            raise LlamatuneError(f"--reward {r.name}: the rows have no '{missing[0]}' field")
        try:
            got = r.function(prompts=prompts, completions=completions, **fields)
        except LlamatuneError:
            raise
        except Exception as e:  # noqa: BLE001 - a failing reward is reported in one line, not a traceback
            raise LlamatuneError(f"--reward {r.name} raised {type(e).__name__}: {e}") from None
        table[:, j] = _checked(r.name, got, n)
    return table


def _checked(name: str, got, n: int) -> np.ndarray:
    if got is None or isinstance(got, (str, bytes)) or not hasattr(got, "__len__"):
        raise LlamatuneError(f"--reward {name} returned {type(got).__name__}, not a list of {n} numbers")
    if len(got) != n:
        raise LlamatuneError(f"--reward {name} returned {len(got)} values for {n} completions")
    out = np.empty(n)
    for k, v in enumerate(got):
        if v is None:
            out[k] = np.nan
            continue
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            raise LlamatuneError(f"--reward {name} returned {v!r} for completion {k}, not a number") from None
        if not math.isfinite(out[k]):
            raise LlamatuneError(f"--reward {name} returned {out[k]} for completion {k}: rewards must be "
                                 "finite (None: does not apply)")
    return out


def total(table: np.ndarray, rewards: list[Reward]) -> np.ndarray:
    """(n,) the weighted sum over rewards, None (NaN) entries left out (TRL's nansum)."""
    w = np.array([r.weight for r in rewards])
    return np.nansum(table * w, axis=1)

