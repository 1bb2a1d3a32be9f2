"""README's recovery promises, end to end (HF engine, 2 ZeRO-3 ranks, no warm start): a stop
signal lands a checkpoint within checkpoint.grace_period_s even during a slow step; a non-finite
step is skipped on every rank and never reaches the engines; too many abort with exit status 3."""
import math
import os
import signal
import threading
import time

import pytest
import torch

from rl.signals import EXIT_ABORTED
from rl.faults import FAULT_NAN_STEP
from tests.rl.loop import plugins
from tests.rl.loop.conftest import make_cfg, read_metrics, start_submit, wait_for

pytestmark = pytest.mark.slow

FAST = ("rollout.engine=hf", "model.warm_start=false", "eval.at_start=false", "eval.every=0")
SAMPLES_PER_STEP = 16 * 4  # BASE_OVERRIDES: prompts_per_step x n_samples


def checkpoint_weights(run_dir, step: int) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    path = run_dir / "checkpoints" / f"step_{step:06d}" / "trainer"
    return get_fp32_state_dict_from_zero_checkpoint(str(path), tag="ds")


def test_stop_during_a_slow_reward_checkpoints_within_the_grace_period(tmp_path, ray_local,
                                                                       monkeypatch):
    from rl.loop import run
    from rl.signals import StopRequest
    grace = 8.0
    monkeypatch.setenv("RL_TEST_REWARD_SLEEP_S", "0.3")  # ~19 s of scoring per step
    monkeypatch.setenv("RL_TEST_REWARD_CALLS", str(tmp_path / "reward_calls"))
    cfg = make_cfg(tmp_path, "grace", *FAST, "num_steps=4", f"checkpoint.grace_period_s={grace}",
                   "reward.function=tests.rl.loop.plugins:slow_short_answer",
                   "reward.num_workers=1")  # one call at a time, as the sleep assumes
    sent = {}

    def signal_during_step_2_scoring():
        wait_for(lambda: plugins.slow_reward_calls() >= SAMPLES_PER_STEP + 5, 900,
                 "step 2's reward scoring")
        sent["at"] = time.time()
        os.kill(os.getpid(), signal.SIGUSR1)

    stop = StopRequest().install()
    th = threading.Thread(target=signal_during_step_2_scoring, daemon=True)
    th.start()
    try:
        result = run(cfg, stop=stop)
    finally:
        stop.uninstall()
    th.join(10)
    assert result.status == "stopped" and result.step == 1  # step 2 abandoned before training
    latest = cfg.run_dir / "checkpoints" / "latest"
    assert latest.read_text().strip() == "step_000001"
    landed = latest.stat().st_mtime - sent["at"]
    assert 0 < landed < grace, f"checkpoint landed {landed:.1f}s after the signal"
    assert plugins.slow_reward_calls() < 2 * SAMPLES_PER_STEP  # scoring was cut short
    # The abandoned step left no trace: the sampler is where step 1 left it (the resumed run
    # draws step 2's prompts again), and only step 1 was logged.
    saved = torch.load(cfg.run_dir / "checkpoints" / "step_000001" / "driver.pt", weights_only=False)
    assert (saved["sampler"]["epoch"], saved["sampler"]["position"]) == (0, 16)
    assert [m["step"] for m in read_metrics(cfg.run_dir)] == [1]


def test_nan_steps_are_skipped_on_every_rank_and_too_many_abort_with_status_3(tmp_path):
    # NaN on rank 0 at steps 2, 4 and 5; two in a row abort.
    proc = start_submit(tmp_path, "nan", *FAST, "num_steps=8", "checkpoint.every=1",
                        "checkpoint.keep_last=10", "checkpoint.max_bad_steps=2",
                        env={FAULT_NAN_STEP: "2,4,5"})
    assert proc.wait(1200) == EXIT_ABORTED
    run_dir = tmp_path / "nan"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert [m["train/skipped"] for m in metrics] == [0, 1, 0, 1, 1]
    assert [m["faults/skipped_steps"] for m in metrics] == [0, 1, 1, 2, 3]
    w1, w2, w3 = (checkpoint_weights(run_dir, s) for s in (1, 2, 3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1), "the skipped step 2 changed the weights"
    assert any(not torch.equal(w2[k], w3[k]) for k in w2)  # and the run trained on afterwards
    assert all(torch.isfinite(v).all() for v in w3.values())
    # Step 3 sampled from the engines after step 2's sync: finite log-probs, close to the trainer's.
    assert math.isfinite(metrics[2]["train/tis_ratio_mean"])
    assert all(m["sync/logprob_max_diff"] <= 1e-3 for m in metrics)
    log = "".join(p.read_text() for p in tmp_path.glob("nan.*.log"))
    assert "aborted at step 5" in log
    assert (run_dir / "checkpoints" / "step_000005" / "manifest.json").exists()
