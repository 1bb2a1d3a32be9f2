"""The trainer's learning-rate schedule (`trainer.warmup_steps`, `lr_schedule`, `min_lr_ratio`):
the factor DeepSpeed's LambdaLR multiplies `trainer.lr` by at each optimizer step. The demo
(configs/local.yaml) runs `cosine`: its last evaluations must see the decayed rate."""
import math

import pytest

from rl.config import TrainerConfig, load_config
from rl.trainer.worker import _lr_lambda


def test_warmup_then_constant():
    f = _lr_lambda(TrainerConfig(warmup_steps=4, lr_schedule="constant"), total_steps=20)
    assert [f(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert f(19) == f(100) == 1.0


def test_cosine_decays_from_lr_to_min_ratio_at_the_last_step():
    f = _lr_lambda(TrainerConfig(warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1),
                   total_steps=110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)   # warmup
    assert f(10) == pytest.approx(1.0)                                   # decay starts at lr
    assert f(60) == pytest.approx(0.55)                                  # halfway: (1 + 0.1) / 2
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)  # held at the floor
    after = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert f(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))


def test_the_demo_decays_to_a_tenth_by_its_last_step():
    cfg = load_config("configs/local.yaml")
    t = cfg.trainer
    total = cfg.num_steps * t.ppo_epochs * t.num_mini_batches
    f = _lr_lambda(t, total)
    assert t.lr_schedule == "cosine"
    assert f(total) == pytest.approx(t.min_lr_ratio) and f(t.warmup_steps) == pytest.approx(1.0)
