"""Tool calls parsed from the model's output and tool results rendered, per prompt format."""
from rl.data import deepseek_v4 as v4
from rl.envs import ToolCall
from rl.envs.calc import calc
from rl.envs.tools import ToolFormat, tool_format


def test_raw_format_parses_calls_and_renders_results():
    fmt = ToolFormat("raw")
    calls = fmt.parse("let me see [calc: 47*38] and [search:x y] but not [1] or [: 2]")
    assert calls == [ToolCall("calc", "47*38"), ToolCall("search", "x y")]
    assert fmt.parse("1786") == []
    assert fmt.observation_text("1786") == "[result: 1786]"
    assert fmt.observation_text(["1", "2"]) == "[result: 1][result: 2]"
    assert fmt.parse(fmt.render_call(ToolCall("calc", "3*4"))) == [ToolCall("calc", "3*4")]


def test_deepseek_v4_format_matches_its_published_encoding():
    # The text vLLM's deepseek_v4_encoding renders for an assistant tool call, written by hand.
    text = ("I will compute it.</think>\n\n<｜DSML｜tool_calls>\n"
            "<｜DSML｜invoke name=\"calc\">\n"
            "<｜DSML｜parameter name=\"expression\" string=\"true\">47*38</｜DSML｜parameter>\n"
            "<｜DSML｜parameter name=\"digits\" string=\"false\">[1, 2]</｜DSML｜parameter>\n"
            "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    fmt = ToolFormat("deepseek_v4", thinking=True)
    assert fmt.parse(text) == [ToolCall("calc", {"expression": "47*38", "digits": [1, 2]})]
    assert fmt.parse("the answer is 1786") == []
    call = ToolCall("calc", {"expression": "2+2", "n": 3})
    assert fmt.parse(fmt.render_call(call)) == [call]
    assert fmt.observation_text("4") == (v4.USER + "<tool_result>4</tool_result>" + v4.ASSISTANT
                                         + v4.THINK_START)
    assert ToolFormat("deepseek_v4", thinking=False).observation_text(["a", "b"]).endswith(
        "<tool_result>a</tool_result>\n\n<tool_result>b</tool_result>" + v4.ASSISTANT
        + v4.THINK_END)


def test_deepseek_v4_rendering_is_what_vllms_encoder_writes():
    """Our call rendering and result block, against vLLM's own V4 encoder (where installed)."""
    import pytest
    enc = pytest.importorskip("vllm.tokenizers.deepseek_v4_encoding")
    fmt = ToolFormat("deepseek_v4", thinking=False)
    call = ToolCall("calc", {"expression": "47*38"})
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    messages = [{"role": "system", "content": "s", "tools": tools},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "calc",
                                                       "arguments": {"expression": "47*38"}}}]},
                {"role": "tool", "tool_call_id": "0", "content": "1786"}]
    text = enc.encode_messages(messages, thinking_mode="chat")
    assert fmt.render_call(call) + v4.EOS + fmt.observation_text("1786") in text


def test_auto_follows_the_prompt_format():
    assert tool_format("auto", "raw", True).name == "raw"
    assert tool_format("auto", "chat_template", True).name == "raw"
    assert tool_format("auto", "deepseek_v4", False) == ToolFormat("deepseek_v4", thinking=False)


def test_calc_tool():
    assert calc("47*38") == "1786" and calc(" (2+3)*-4 ") == "-20"
    assert calc("__import__('os')") == "error" and calc("2**99") == "error"
    assert calc("9" * 70) == "error"
