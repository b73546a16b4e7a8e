"""Schedule, optimizer choice and the memory check before training."""
from __future__ import annotations

import math

import numpy as np
import pytest

from llamatune.errors import LlamatuneError
from llamatune.train.optimizer import cosine_decay_restart, learning_rate, schedule
from llamatune.options import FinetuneOptions

from test_finetune import options


def test_schedule_warmup_cosine_and_floor():
    o = FinetuneOptions(warmup=4, cos_decay_steps=10, cos_decay_min=0.1, adam_alpha=1.0, adam_min_alpha=0.0)
    got = [schedule(s, o) for s in range(16)]
    want = [0.25, 0.5, 0.75, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, 10) / 10)) for s in range(12)]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    o2 = FinetuneOptions(warmup=0, cos_decay_steps=10, cos_decay_min=0.0, adam_alpha=1e-3, adam_min_alpha=1e-4)
    assert learning_rate(10, o2) == pytest.approx(1e-4) and learning_rate(0, o2) == pytest.approx(1e-3)


def test_cosine_restarts_grow():
    # the second cycle is 1.5x longer: step 10 + 15 lands on its end
    assert cosine_decay_restart(10, 10, 0.0, 1.5) == pytest.approx(0.0, abs=1e-12)
    assert cosine_decay_restart(11, 10, 0.0, 1.5) == pytest.approx(0.5 * (1 + math.cos(math.pi / 15)))
    assert cosine_decay_restart(25, 10, 0.0, 1.5) == pytest.approx(0.0, abs=1e-12)


def test_sgd_trains(tmp_path, tiny_model):
    from llamatune.commands.finetune import finetune
    res = finetune(options(tmp_path, tiny_model, optimizer="sgd", adam_iter=10, adam_alpha=0.5, lora_dropout=0.0,
                           rank_out=0, rank_att_norm=0), quiet=True)
    assert np.mean(res.losses[-3:]) < res.losses[0]


def test_memory_estimate_refuses_what_does_not_fit(tmp_path, tiny_model, monkeypatch):
    import llamatune.train.trainer as trainer
    from llamatune.commands.finetune import finetune
    monkeypatch.setattr(trainer, "free_memory", lambda backend: 1000)
    with pytest.raises(LlamatuneError, match=r"training needs about .* GiB but only 0.00 GiB is available"):
        finetune(options(tmp_path, tiny_model), quiet=True)
