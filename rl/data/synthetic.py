"""A seeded synthetic arithmetic task for demos and tests: `37+5=` -> `42`.

The prompt carries no instructions because the policy is a tiny char-level transformer trained
briefly: the response is just the number followed by EOS. Precedence is the usual one (`*` binds
tighter than `+`/`-`); operands may be negative when `min_value < 0` (`3+-2=`).

Train and eval are disjoint (no prompt appears in both, nor twice in one split) and depend only on
the seed and the SyntheticConfig. Eval is drawn first, so it does not change with `num_train`.
"""
from __future__ import annotations

import itertools
import random

from rl.config import ConfigError, SyntheticConfig
from rl.data.example import Example

Problem = tuple[tuple[int, ...], tuple[str, ...]]
"""(operands, operators) with len(operators) == len(operands) - 1."""


def evaluate(operands: tuple[int, ...], operators: tuple[str, ...]) -> int:
    """Value of `operands[0] op0 operands[1] op1 ...` with `*` before `+`/`-`."""
    terms = [operands[0]]
    for op, value in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value if op == "+" else -value)
    return sum(terms)


def render(operands: tuple[int, ...], operators: tuple[str, ...]) -> str:
    """The prompt text, e.g. `37+5=`; distinct problems give distinct prompts."""
    parts = [str(operands[0])]
    for op, value in zip(operators, operands[1:]):
        parts += [op, str(value)]
    return "".join(parts) + "="


def num_distinct_problems(cfg: SyntheticConfig) -> int:
    values = cfg.max_value - cfg.min_value + 1
    return values ** cfg.num_operands * len(set(cfg.operators)) ** (cfg.num_operands - 1)


_ENUMERATE_LIMIT = 200_000
"""Spaces up to this size are enumerated and shuffled; larger ones are rejection-sampled. The
choice depends on the space alone, so the drawn sequence is a stable prefix for any count."""


def _draw_unique(cfg: SyntheticConfig, count: int, rng: random.Random) -> list[Problem]:
    n = cfg.num_operands
    ops = sorted(set(cfg.operators))  # a repeated operator is not a weight
    if num_distinct_problems(cfg) <= _ENUMERATE_LIMIT:
        # Small spaces: rejection sampling would stall near exhaustion, so shuffle the whole space.
        space = list(itertools.product(
            itertools.product(range(cfg.min_value, cfg.max_value + 1), repeat=n),
            itertools.product(ops, repeat=n - 1)))
        rng.shuffle(space)
        return space[:count]
    seen: set[Problem] = set()
    out: list[Problem] = []
    while len(out) < count:
        problem = (tuple(rng.randint(cfg.min_value, cfg.max_value) for _ in range(n)),
                   tuple(rng.choice(ops) for _ in range(n - 1)))
        if problem not in seen:
            seen.add(problem)
            out.append(problem)
    return out


def make_synthetic(cfg: SyntheticConfig, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, eval) arithmetic examples, disjoint and deterministic from `seed`.

    Raises ConfigError when the settings allow fewer distinct prompts than num_train + num_eval.
    """
    total = num_distinct_problems(cfg)
    needed = cfg.num_train + cfg.num_eval
    if needed > total:
        raise ConfigError(
            f"data.synthetic.num_train: got {cfg.num_train}, expected num_train + num_eval "
            f"({needed}) <= {total}, the number of distinct prompts these settings allow "
            "(widen min_value/max_value, add operands or operators)")
    # A string seed is hashed with SHA-512 by `random`, so it is stable across processes.
    problems = _draw_unique(cfg, needed, random.Random(f"synthetic-arithmetic:{seed}"))
    examples = [Example(prompt=render(*p), answer=str(evaluate(*p)),
                        meta={"operands": list(p[0]), "operators": list(p[1])})
                for p in problems]
    return examples[cfg.num_eval:], examples[:cfg.num_eval]
