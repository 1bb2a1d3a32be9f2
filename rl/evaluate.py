"""Held-out evaluation: greedy pass@1, mean reward, and pass@k from k samples at temperature."""
from __future__ import annotations

from rl.data.example import Example
from rl.rewards.computer import RewardComputer
from rl.rollout.base import SamplingParams


def evaluate(runtime, prompt_ids: list[list[int]], examples: list[Example], rewards: RewardComputer,
             tokenizer, max_new_tokens: int, pass_k: int, temperature: float, seed: int) -> dict:
    """Eval metrics; {} without examples (evaluation off: nothing to score, no 0/0 accuracy)."""
    if not examples:
        return {}
    greedy = runtime.generate(prompt_ids, SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=-1,
                                                         max_new_tokens=max_new_tokens, seed=seed), seed)
    texts = [s[0].text for s in greedy]
    parts = rewards.score(texts, examples)
    out = {"eval/pass1": sum(c >= 1.0 for c in parts.correctness) / max(len(examples), 1),
           "eval/mean_reward": sum(parts.total) / max(len(examples), 1)}
    if pass_k > 1:
        sampled = runtime.generate(prompt_ids, SamplingParams(
            n=pass_k, temperature=temperature, top_p=1.0, top_k=-1,
            max_new_tokens=max_new_tokens, seed=seed + 1), seed + 1)
        flat_texts = [s.text for group in sampled for s in group]
        flat_examples = [ex for ex, group in zip(examples, sampled) for _ in group]
        corr = rewards.score(flat_texts, flat_examples).correctness
        hits = 0
        for i in range(len(examples)):
            hits += any(c >= 1.0 for c in corr[i * pass_k:(i + 1) * pass_k])
        out["eval/pass_k"] = hits / max(len(examples), 1)
    return out
