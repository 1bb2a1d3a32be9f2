"""The tool-use demo's environment: arithmetic the tiny model cannot do in one go, with a `calc`
tool. `configs/local_tools.yaml` trains against it (docs/environments.md).

The task is two-digit multiplication (`47*38=` -> `1786`). The model answers directly, or calls
the calculator, `[calc: 47*38]`, reads `[result: 1786]` and answers; the episode's reward is 1
when its final answer (a turn without a tool call) equals the product, else 0.

`python -m rl.envs.calc OUT_DIR` writes the demo's data: `train.jsonl` and `eval.jsonl`
(disjoint problems). A share of the training rows (`--tool-fraction`) carries an `sft_target`:
the whole tool-use transcript, which the SFT warm start imitates (`sft.target_field`); the
others teach a direct answer, mostly wrong for a model this small. RL then finds out which
pays.
"""
from __future__ import annotations

import argparse
import ast
import json
import operator
import random
from pathlib import Path

from rl.envs.protocol import Message, StepResult, ToolCall

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc(expression: str) -> str:
    """The value of an integer `+ - *` expression (parentheses allowed), or `error`."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("unsupported")
    if len(expression) > 64:
        return "error"
    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return "error"
    return str(result) if abs(result) < 10**12 else "error"


class CalcEnv:
    """Tools: `calc` (an arithmetic expression). Reward: 1 for the right final answer."""

    def __init__(self, row: dict):
        self.answer = str(row["answer"]).strip()

    def step(self, message: Message) -> StepResult:
        if message.tool_calls:
            return StepResult(observation=[self._tool(c) for c in message.tool_calls])
        return StepResult(reward=float(message.text.strip() == self.answer), done=True)

    @staticmethod
    def _tool(call: ToolCall) -> str:
        if call.name != "calc":
            return f"unknown tool {call.name}"
        args = call.arguments
        return calc(args if isinstance(args, str) else str(args.get("expression", "")))


def transcript(a: int, b: int) -> str:
    """The SFT target of a tool-using answer to `a*b=` (raw tool format; `<eos>` ends a turn)."""
    return f"[calc: {a}*{b}]<eos>[result: {a * b}]{a * b}"


def make_rows(seed: int, num_train: int, num_eval: int, tool_fraction: float
              ) -> tuple[list[dict], list[dict]]:
    """(train, eval) rows of distinct two-digit products; train rows carry `sft_target` with
    probability `tool_fraction`."""
    rng = random.Random(seed)
    problems = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(problems)
    if num_train + num_eval > len(problems):
        raise ValueError(f"at most {len(problems)} distinct problems")
    rows = [{"question": f"{a}*{b}=", "answer": str(a * b)} for a, b in problems]
    train = rows[:num_train]
    for row, (a, b) in zip(train, problems):
        if rng.random() < tool_fraction:
            row["sft_target"] = transcript(a, b)
    return train, rows[num_train:num_train + num_eval]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rl.envs.calc", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-train", type=int, default=3000)
    p.add_argument("--num-eval", type=int, default=300)
    p.add_argument("--tool-fraction", type=float, default=0.5)
    args = p.parse_args(argv)
    train, evals = make_rows(args.seed, args.num_train, args.num_eval, args.tool_fraction)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", evals)):
        with open(args.out_dir / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(train)} train and {len(evals)} eval rows to {args.out_dir}")


if __name__ == "__main__":
    main()
