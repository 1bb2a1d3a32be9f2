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


class Relay:
    """Every episode takes two turns: turn 1 always gets the observation `ok` (a tool call or
    not); turn 2 is rewarded like `tests.rl.loop.plugins:short_answer`. A turn-1 text `77`
    raises, `88` returns garbage, `99` ends the worker's process, `66` hangs.
    With RL_TEST_ENV_MARKER=PATH each turn-2 call appends a line to PATH; the call that makes it
    RL_TEST_ENV_PAUSE_AT lines long sleeps 1.5 s (a window for a stop mid-step)."""

    def __init__(self, row):
        self.turn = 0

    def step(self, message):
        self.turn += 1
        text = message.text.strip()
        if self.turn == 1:
            if text == "66":
                time.sleep(3600)
            if text == "77":
                raise RuntimeError("environment failure on purpose")
            if text == "88":
                return "garbage"
            if text == "99":
                os._exit(3)
            return StepResult(observation="ok")
        marker = os.environ.get("RL_TEST_ENV_MARKER")
        if marker:
            with open(marker, "a") as f:
                f.write("x\n")
            with open(marker) as f:
                if sum(1 for _ in f) == int(os.environ.get("RL_TEST_ENV_PAUSE_AT", "-1")):
                    time.sleep(1.5)
        return StepResult(reward=1.0 if 0 < len(text) <= 2 else 0.0, done=True)


class Unreplayable(CalcEnv):
    """Breaks the protocol: its observations are random, so replaying its messages gives other
    answers."""

    def step(self, message):
        import random
        if message.tool_calls:
            return StepResult(observation=f"[{random.random()}]")
        return StepResult(reward=1.0, done=True)
