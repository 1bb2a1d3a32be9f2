"""Assertions every rollout engine's `generate` output must pass (shared by the engine tests)."""
from __future__ import annotations

from rl.models.tokenizer import EOS_ID
from rl.rollout.base import Sample


def assert_generated(groups: list[list[Sample]], prompts: list[list[int]], n: int, max_new: int,
                     stop: list[int]) -> list[Sample]:
    """n samples per prompt, in prompt order, weight version 0, one log-prob per token; a
    `stop` sample ends at its only stop token (EOS or one of `stop`), a `length` sample has
    exactly `max_new` tokens and none; both finish reasons occur. Returns the samples."""
    assert len(groups) == len(prompts) and all(len(g) == n for g in groups)
    reasons = set()
    for prompt, group in zip(prompts, groups):
        for s in group:
            assert s.prompt_ids == prompt and s.weight_version == 0
            assert 1 <= len(s.response_ids) <= max_new and len(s.logprobs) == len(s.response_ids)
            stops = [j for j, t in enumerate(s.response_ids) if t in stop or t == EOS_ID]
            if s.finish_reason == "stop":
                assert stops == [len(s.response_ids) - 1]
            else:
                assert s.finish_reason == "length" and not stops and len(s.response_ids) == max_new
            reasons.add(s.finish_reason)
    assert reasons == {"stop", "length"}
    return [s for g in groups for s in g]
