"""Environments for the tests, loaded as `tests.rl.envs.envs:NAME`.

Each misbehaves on a turn whose text says so: `hang` sleeps, `crash` ends its process, `garbage`
returns a non-StepResult, `raise` raises, `exit` calls sys.exit; any other text is handled like
`rl.envs.calc.CalcEnv`: tool calls get results, a final answer is scored against the row.
"""
import os
import sys
import time

from rl.envs import StepResult
from rl.envs.calc import CalcEnv


class Misbehaving(CalcEnv):
    def __init__(self, row):
        super().__init__(row)
        self.steps = 0

    def step(self, message):
        self.steps += 1
        text = message.text
        if "hang" in text:
            time.sleep(3600)
        if "crash" in text:
            os._exit(3)
        if "garbage" in text:
            return {"reward": 1.0}
        if "nanreward" in text:
            return StepResult(reward=float("nan"), done=True)
        if "raise" in text:
            raise RuntimeError("environment failure on purpose")
        if "exit" in text:
            sys.exit(1)
        return super().step(message)


class Counting(CalcEnv):
    """Observation `step N` on every tool call: shows that state (N) travels between calls."""

    def __init__(self, row):
        super().__init__(row)
        self.n = 0

    def step(self, message):
        self.n += 1
        if message.tool_calls:
            return StepResult(observation=f"step {self.n}")
        return StepResult(reward=float(self.n), done=True)


class NotPicklable(CalcEnv):
    def __init__(self, row):
        super().__init__(row)
        self.f = lambda: None
