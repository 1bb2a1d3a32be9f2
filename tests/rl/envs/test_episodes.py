"""Episodes: engine turns and environment steps alternating, masks, budgets, failures (a
scripted engine, real environment workers)."""
import pytest

from rl.envs.episodes import EpisodeRunner, turn_seed
from rl.envs.pool import EnvPool
from rl.envs.tools import ToolFormat
from rl.models.tokenizer import EOS_ID
from rl.rollout.base import SamplingParams
from tests.helpers.episodes import TOK, ScriptedEngine, ids

@pytest.fixture(scope="module")
def pool():
    p = EnvPool("tests.rl.envs.envs:Misbehaving", 2, timeout_s=2.0)
    yield p
    p.close()


def runner(engine, pool, max_turns=3, max_tokens=60, max_model_len=128):
    return EpisodeRunner(generate=engine, map_steps=pool.map, tool_format=ToolFormat("raw"),
                         tokenizer=TOK, max_turns=max_turns, max_tokens=max_tokens,
                         max_model_len=max_model_len)


def tool_then_answer(text, j):
    if "[result: " in text:
        return text.rsplit("[result: ", 1)[1].split("]")[0]  # copies the tool's result
    return "[calc: 47*38]" if j == 0 else "1700"


def test_tool_call_then_answer_masks_the_tool_result(pool):
    engine = ScriptedEngine(tool_then_answer)
    prompt = ids("47*38=")
    (group,) = runner(engine, pool).run([prompt], [{"prompt": "47*38=", "answer": "1786"}],
                                        SamplingParams(n=2, max_new_tokens=16), seed=11)
    tool, direct = group
    assert (tool.env_reward, direct.env_reward) == (1.0, 0.0)
    assert tool.env_error is None and tool.finish_reason == "stop"
    call, obs, answer = ids("[calc: 47*38]") + [EOS_ID], ids("[result: 1786]"), ids("1786") + [EOS_ID]
    assert tool.response_ids == call + obs + answer
    assert tool.loss_mask == [1] * len(call) + [0] * len(obs) + [1] * len(answer)
    assert tool.logprobs == [-0.5] * len(call) + [0.0] * len(obs) + [-0.5] * len(answer)
    assert tool.turns == [
        {"start": 0, "end": len(call), "tool_calls": [["calc", "47*38"]],
         "observation": "[result: 1786]"},
        {"start": len(call) + len(obs), "end": len(tool.response_ids), "tool_calls": [],
         "observation": None}]
    assert direct.loss_mask == [1] * 5 and len(direct.turns) == 1
    assert tool.weight_version == 3 and tool.version_spans == []
    # turn 1: both samples of the prompt (n=2); turn 2: the one episode still running, n=1,
    # its own seed, the whole context as its prompt
    assert engine.calls == [(1, 2, 16, 11), (1, 1, 16, turn_seed(11, 2))]
    assert turn_seed(11, 2) != 11


def test_budget_and_max_turns_cut_episodes(pool):
    always_tool = ScriptedEngine(lambda text, j: "[calc: 1+1]")
    row = {"prompt": "1+1=", "answer": "2"}
    (group,) = runner(always_tool, pool, max_turns=2).run(
        [ids("1+1=")], [row], SamplingParams(n=1, max_new_tokens=16), seed=0)
    (s,) = group
    assert s.finish_reason == "length" and s.env_reward == 0.0 and s.env_error is None
    assert len(s.turns) == 2 and s.turns[-1]["observation"] is None  # ends on a model turn
    assert s.loss_mask[-1] == 1
    # a budget of 20 tokens: turn 1 (12) + result (10) leave no room for a second turn
    (group,) = runner(always_tool, pool, max_turns=4, max_tokens=20).run(
        [ids("1+1=")], [row], SamplingParams(n=1, max_new_tokens=16), seed=0)
    assert group[0].finish_reason == "length" and len(group[0].response_ids) == 12


def test_failing_environments_fail_their_episodes_only(pool):
    engine = ScriptedEngine(lambda text, j: ["hang", "crash", "garbage", "1786"][j])
    (group,) = runner(engine, pool).run([ids("47*38=")], [{"prompt": "", "answer": "1786"}],
                                        SamplingParams(n=4, max_new_tokens=16), seed=0)
    assert [s.env_error is not None for s in group] == [True, True, True, False]
    assert [s.env_reward for s in group] == [0.0, 0.0, 0.0, 1.0]
    assert "TimeoutError" in group[0].env_error and "WorkerDied" in group[1].env_error


class RoutingEngine(ScriptedEngine):
    """ScriptedEngine that also reports routing as r3 asks: one row per context position but the
    last, each row holding its position in the call's sequence and the call's number."""

    def __call__(self, prompts, sampling, seed):
        import numpy as np
        out = super().__call__(prompts, sampling, seed)
        for p, group in zip(prompts, out):
            for s in group:
                rows = len(p) + len(s.response_ids) - 1
                s.routing = np.stack([np.arange(rows), np.full(rows, len(self.calls))], axis=1
                                     )[:, None, :].repeat(2, axis=1)  # (rows, 2 layers, top-2)
        return out


@pytest.mark.parametrize("max_tokens", [60, 34], ids=["answered", "cut_by_budget"])
def test_routing_replay_covers_every_position_of_an_episode(pool, max_tokens):
    """r3 with multi-turn: the episode's routing is its last engine call's (that call ran the
    whole context: prompt, earlier turns, observations), cut to the tokens the episode kept, and
    the trainer's padding takes it with the loss mask."""
    from rl.rollout.routing import check_routing
    from rl.trainer.microbatch import pad_batch
    engine = RoutingEngine(lambda text, j: "[calc: 47*38]" if "[result: " not in text
                           else "17861786178617861786")
    prompt = ids("47*38=")
    (group,) = runner(engine, pool, max_tokens=max_tokens).run(
        [prompt], [{"prompt": "47*38=", "answer": "1786"}],
        SamplingParams(n=1, max_new_tokens=32), seed=5)
    (ep,) = group
    assert len(ep.turns) == 2 and 0 in ep.loss_mask
    if max_tokens == 34:  # 14 (the call) + 14 (its result) leave 6 of the 21-token answer
        assert ep.finish_reason == "length" and len(ep.response_ids) == 34
    check_routing(ep.routing, len(ep.prompt_ids), len(ep.response_ids), "episode")
    assert (ep.routing[:, 0, 0] == range(len(ep.routing))).all()  # positions 0.. in order
    assert (ep.routing[:, 0, 1] == 2).all()  # all from the second (last) call
    mb = pad_batch([ep.prompt_ids], [ep.response_ids], [ep.logprobs], routing=[ep.routing],
                   loss_mask=[ep.loss_mask])
    assert mb.routing_mask.sum() == len(ep.prompt_ids) + len(ep.response_ids) - 1
