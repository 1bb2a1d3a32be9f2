"""What a step makes of its episodes: rewards from the environment, failures counted, env/
metrics."""
from __future__ import annotations

import logging
import statistics

from rl.rewards.computer import RewardBreakdown

log = logging.getLogger(__name__)

MAX_ERRORS_LOGGED = 5


class EnvScorer:
    """The episodes' rewards as a `RewardBreakdown` (the environment's reward is the
    correctness; no format part), and the run's count of failed episodes (checkpointed)."""

    def __init__(self) -> None:
        self.failures = 0
        """Episodes whose environment failed (raised, hung, crashed, returned garbage), over the
        run's training steps (evaluation episodes are not counted)."""
        self._logged = 0

    def state_dict(self) -> dict:
        return {"env_failures_before": self.failures}

    def load_state_dict(self, state: dict) -> None:
        self.failures = state.get("env_failures_before", 0)  # checkpoints before rl/envs/: 0

    def score(self, samples) -> RewardBreakdown:
        """Rewards of `samples` (`rl.rollout.base.Sample`s of episodes); counts their failures."""
        failed = [s.env_error is not None for s in samples]
        self.failures += sum(failed)
        for s in samples:
            if s.env_error is not None and self._logged < MAX_ERRORS_LOGGED:
                self._logged += 1
                log.warning("environment failed on an episode (reward 0): %s", s.env_error[:300])
        total = [float(s.env_reward or 0.0) for s in samples]
        n = len(samples)
        return RewardBreakdown(total=total, correctness=list(total), format=[0.0] * n,
                               failed=failed, unclosed=[False] * n)


def episode_metrics(samples, prefix: str = "env/") -> dict[str, float]:
    """Turns, tool calls and cuts of a batch of episodes (`prefix` + name)."""
    n = max(len(samples), 1)
    turns = [len(s.turns or []) for s in samples]
    calls = [sum(len(t["tool_calls"]) for t in (s.turns or [])) for s in samples]
    env_tokens = [len(s.loss_mask or []) - sum(s.loss_mask or []) for s in samples]
    return {f"{prefix}turns_mean": statistics.fmean(turns) if turns else 0.0,
            f"{prefix}tool_calls_mean": statistics.fmean(calls) if calls else 0.0,
            f"{prefix}tool_call_rate": sum(c > 0 for c in calls) / n,
            f"{prefix}env_tokens_mean": statistics.fmean(env_tokens) if env_tokens else 0.0,
            f"{prefix}cut_frac": sum(s.finish_reason == "length" for s in samples) / n}
