"""Partial rollouts of multi-turn episodes (`algorithm.partial_rollouts: resume`): an episode
generated ahead pauses at the interrupt budget, mid-turn or between turns, and continues with
the new weights; through a checkpoint (no environment pickle in it) its environment is rebuilt
by replaying its messages, and a run resumed from the pipeline's state is the uninterrupted run."""
import types

import pytest

from rl.config import load_config
from rl.data.example import Example
from rl.envs.episodes import EpisodeRunner, turn_seed
from rl.envs.generator import MultiTurnGenerator
from rl.envs.pool import EnvPool
from rl.envs.tools import ToolFormat
from rl.pipeline import RolloutBatch, RolloutPipeline, resume_seed
from rl.rollout.base import SamplingParams
from tests.helpers.episodes import TOK, OracleEngine, ids, transcript

# Counting answers tool calls with "step N" and the final answer with reward N: a rebuilt
# environment that forgot its steps answers "step 1" again and leaves the transcript.
TARGET = transcript(">[calc: 1+1]", "[result: step 1]", ">[calc: 2+2]", "[result: step 2]", ">42")
TURNS = [(0, 12), (28, 40), (56, 59)]  # the model turns' token ranges; the rest is observations
PROMPT = ids("1+1=")
ROW = {"prompt": "1+1=", "answer": "42"}
SAMPLING = SamplingParams(n=1, max_new_tokens=16)


@pytest.fixture(scope="module")
def pool():
    p = EnvPool("tests.rl.envs.envs:Counting", 2, timeout_s=10.0)
    yield p
    p.close()


def runner(engine, pool):
    return EpisodeRunner(generate=engine, map_steps=pool.map, tool_format=ToolFormat("raw"),
                         tokenizer=TOK, max_turns=4, max_tokens=80, max_model_len=128)


def through_checkpoint(sample):
    """`sample` as a resumed run reads it from the pending batches of a checkpoint."""
    batch = RolloutBatch(step=2, indices=[0], groups=[[sample]], ahead=True)
    (back,) = RolloutBatch.from_state(batch.to_state()).samples()
    return back


@pytest.mark.parametrize("pause_at, mid_turn, messages", [
    (6, True, 0),     # inside turn 1
    (20, False, 1),   # turn 1 (12) and its result (16) reach 20: before turn 2
    (30, True, 1),    # 2 tokens into turn 2
])
def test_paused_episode_resumes_with_new_weights(pool, pause_at, mid_turn, messages):
    engine = OracleEngine(len(PROMPT), TARGET)
    ((paused,),) = runner(engine, pool).run([PROMPT], [ROW], SAMPLING, seed=7, pause_at=pause_at)
    stop = pause_at if mid_turn else 28
    assert paused.response_ids == TARGET[:stop]
    assert paused.paused["mid_turn"] is mid_turn and len(paused.paused["messages"]) == messages
    assert (paused.paused["env_state"] is None) == (messages == 0)
    assert through_checkpoint(paused).paused["env_state"] is None  # no pickle in a checkpoint

    engine.version = 4  # the weight update
    results = []
    for s in (paused, through_checkpoint(paused)):  # in memory, and rebuilt by replay
        (done,) = runner(engine, pool).resume([s], [ROW], SAMPLING, seed=99)
        results.append(done)
    memory, replayed = results
    assert memory == replayed
    assert memory.paused is None and memory.env_error is None
    assert memory.response_ids == TARGET and memory.env_reward == 3.0
    assert [(t["start"], t["end"]) for t in memory.turns] == TURNS  # a cut turn stays one turn
    model = {i for a, b in TURNS for i in range(a, b)}
    assert memory.loss_mask == [int(i in model) for i in range(len(TARGET))]
    assert memory.version_spans == [(0, 3), (stop, 4)] and memory.weight_version == 4
    # tokens before the pause keep their log-probs; the rest come from the resume's calls
    assert memory.logprobs[:stop] == paused.logprobs
    resume_seeds = [99, turn_seed(99, 2), turn_seed(99, 3)]
    after = {lp for i, lp in enumerate(memory.logprobs) if i >= stop and i in model}
    assert after and after <= {-(s % 1000 + 1) / 1000 - 0.4 for s in resume_seeds}


def test_environment_that_answers_otherwise_on_replay_fails_its_episode():
    pool = EnvPool("tests.rl.envs.envs:Unreplayable", 1, timeout_s=10.0)
    try:
        engine = OracleEngine(len(PROMPT), TARGET)
        ((paused,),) = runner(engine, pool).run([PROMPT], [ROW], SAMPLING, seed=7, pause_at=20)
        assert paused.paused["messages"] and not paused.paused["mid_turn"]
        calls = len(engine.calls)
        (done,) = runner(engine, pool).resume([through_checkpoint(paused)], [ROW], SAMPLING, 9)
    finally:
        pool.close()
    assert done.env_reward == 0.0 and "gave another answer" in done.env_error
    assert done.paused is None and len(engine.calls) == calls  # failed before any generation


class SyncGenerator:
    """`rl.publisher.Generator`'s verbs over a blocking engine call."""

    def __init__(self, engine):
        self.engine = engine

    def start(self, prompts, sampling, seed):
        out = self.engine(prompts, sampling, seed)
        return types.SimpleNamespace(wait=lambda timeout: True, out=out)

    def finish(self, gen, prompts, sampling, seed):
        return gen.out, 0.0

    def abandon(self):
        pass


class Source:
    """Ten prompts `i+i=` (4 tokens each), drawn by the real seeded sampler."""

    def __init__(self):
        from rl.data.sampler import PromptSampler
        self.sampler, self.tokenizer = PromptSampler(10, 0), TOK

    def draw(self, k):
        return self.sampler.next_indices(k)

    def prompts(self, indices):
        return [ids(f"{i}+{i}=") for i in indices]

    def examples(self, indices):
        return [Example(prompt=f"{i}+{i}=", answer="42") for i in indices]

    def state_dict(self):
        return self.sampler.state_dict()

    def load_state_dict(self, state):
        self.sampler.load_state_dict(state)


def pipeline_steps(cfg, pool, engine, steps, state=None):
    """The loop's pipeline verbs for `steps` (take, launch ahead, collect, weight update); with
    `state` (a checkpoint's source and pending batches) a fresh pipeline resumes from it.
    Returns the batches trained on and the state after the last step."""
    source = Source()
    gen = MultiTurnGenerator(SyncGenerator(engine), pool, ToolFormat("raw"), TOK,
                             cfg.env.max_turns, cfg.env.max_response_tokens,
                             cfg.rollout.max_model_len)
    sampling = SamplingParams(n=cfg.rollout.n_samples, max_new_tokens=cfg.rollout.max_new_tokens)
    pipe = RolloutPipeline(cfg, source, gen, sampling)
    if state is not None:
        source.load_state_dict(state["source"])
        pipe.load_state_dict(state["pending"])
    batches = []
    for step in steps:
        batches.append(pipe.take(step))
        pipe.launch_ahead(step, 4)
        pipe.collect()
        engine.version += 1
    return batches, {"source": source.state_dict(), "pending": pipe.state_dict()}


def test_pipeline_resumed_from_its_state_runs_the_same_episodes(pool):
    cfg = load_config("configs/local.yaml", [
        "env.path=tests.rl.envs.envs:Counting", "env.max_turns=4", "env.max_response_tokens=80",
        "rollout.max_new_tokens=16", "algorithm.max_staleness=1",
        "algorithm.partial_rollouts=resume", "algorithm.partial_tokens=20",
        "algorithm.prompts_per_step=2", "rollout.n_samples=2"])
    whole, _ = pipeline_steps(cfg, pool, OracleEngine(4, TARGET), range(1, 5))
    engine = OracleEngine(4, TARGET)
    first, state = pipeline_steps(cfg, pool, engine, range(1, 3))
    pending = [s for d in state["pending"] for s in RolloutBatch.from_state(d).samples()]
    assert pending and all(s.paused and s.paused["messages"] for s in pending)
    rest, _ = pipeline_steps(cfg, pool, engine, range(3, 5), state)
    for a, b in zip(whole, first + rest, strict=True):
        assert (a.step, a.indices, a.groups) == (b.step, b.indices, b.groups)
    samples = [s for b in whole for s in b.samples()]
    assert all(s.paused is None and s.response_ids == TARGET and s.env_reward == 3.0
               for s in samples)
    # step 1 generated on-policy; every later step's episodes paused at 28 tokens (turn 1 and
    # its result) under the weights before the update, and finished with the new ones
    assert all(s.version_spans == [] for s in whole[0].samples())
    assert all(s.version_spans == [(0, 3 + b.step - 2), (28, 3 + b.step - 1)]  # 3: step 1's
               for b in whole[1:] for s in b.samples())
    assert resume_seed(cfg.rollout.seed, 3) in {c[2] for c in engine.calls}
