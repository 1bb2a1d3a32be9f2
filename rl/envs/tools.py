"""Tool calls in the model's output, and tool results in its input, per prompt format.

Every model turn ends with the model's EOS token (the engines always stop there); the turn's
text is parsed for tool calls, and the environment's observation is appended as text in the
same format, as context the model reads but is not trained on.

`raw` (the tiny presets; `raw` and `chat_template` prompt formats): a tool call is
`[NAME: ARGUMENTS]` anywhere in the turn (NAME a word, ARGUMENTS up to the closing `]`, passed
as a string); the observation follows the turn's EOS as `[result: OBSERVATION]` (one such block
per string when the environment returns a list).

`deepseek_v4`: DeepSeek-V4's own encoding (vLLM's `deepseek_v4_encoding.py`, the revision vLLM
0.32 ships): a turn with tool calls ends in a `<｜DSML｜tool_calls>` block of
`<｜DSML｜invoke name="NAME">` elements, each with `<｜DSML｜parameter name="P" string="true|false">
VALUE</｜DSML｜parameter>` lines (string="false" values are JSON), then EOS; the tool results come
back in a user turn, `<｜User｜><tool_result>OBSERVATION</tool_result><｜Assistant｜>` and the
thinking token of the mode (`<think>`, or `</think>` in chat mode), as that file renders a tool
message merged into the next user turn when tools are declared (so earlier reasoning is kept and
the context only grows: each turn's prompt is the previous one extended).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from rl.data import deepseek_v4 as v4
from rl.envs.protocol import ToolCall

DSML = "｜DSML｜"
_RAW_CALL = re.compile(r"\[([A-Za-z_][\w.-]*):\s?([^\]]*)\]")
_V4_BLOCK = re.compile(r"<" + DSML + r"tool_calls>(.*?)</" + DSML + r"tool_calls>", re.S)
_V4_INVOKE = re.compile(r"<" + DSML + r"invoke name=\"([^\"]*)\">(.*?)</" + DSML + r"invoke>",
                        re.S)
_V4_PARAM = re.compile(r"<" + DSML + r"parameter name=\"([^\"]*)\" string=\"(true|false)\">"
                       r"(.*?)</" + DSML + r"parameter>", re.S)


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    """`raw` or `deepseek_v4`."""
    thinking: bool = True
    """deepseek_v4: the next assistant turn opens with `<think>` (else `</think>`)."""

    def parse(self, text: str) -> list[ToolCall]:
        """The tool calls in one model turn, in order (malformed ones are not calls)."""
        if self.name == "raw":
            return [ToolCall(name=m.group(1), arguments=m.group(2).strip())
                    for m in _RAW_CALL.finditer(text)]
        calls = []
        for block in _V4_BLOCK.findall(text):
            for name, body in _V4_INVOKE.findall(block):
                args = {}
                for key, is_str, value in _V4_PARAM.findall(body):
                    args[key] = value if is_str == "true" else _json_or_text(value)
                calls.append(ToolCall(name=name, arguments=args))
        return calls

    def observation_text(self, observation: str | list[str]) -> str:
        """The text appended after a model turn (its EOS included) for `observation`."""
        parts = [observation] if isinstance(observation, str) else list(observation)
        if self.name == "raw":
            return "".join(f"[result: {p}]" for p in parts)
        results = "\n\n".join(f"<tool_result>{p}</tool_result>" for p in parts)
        return (v4.USER + results + v4.ASSISTANT
                + (v4.THINK_START if self.thinking else v4.THINK_END))

    def render_call(self, call: ToolCall) -> str:
        """The text of one tool call as the model should write it (demos, SFT data, tests)."""
        if self.name == "raw":
            return f"[{call.name}: {call.arguments}]"
        args = call.arguments if isinstance(call.arguments, dict) else {"input": call.arguments}
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</{DSML}parameter>"
            for k, v in args.items())
        return (f"\n\n<{DSML}tool_calls>\n<{DSML}invoke name=\"{call.name}\">\n{params}\n"
                f"</{DSML}invoke>\n</{DSML}tool_calls>")


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


def tool_format(name: str, prompt_format: str, thinking: bool) -> ToolFormat:
    """`env.tool_format` resolved: `auto` follows `data.prompt_format` (deepseek_v4 -> its own
    encoding, anything else -> raw)."""
    if name == "auto":
        name = "deepseek_v4" if prompt_format == "deepseek_v4" else "raw"
    return ToolFormat(name=name, thinking=thinking)
