"""Every engine returns routing (`SamplingParams.return_routing`) in the same format, and the
three agree with each other on the same fp32 weights (rl.rollout.routing)."""
import numpy as np
import pytest

from rl.config import RolloutConfig
from rl.rollout.base import SamplingParams
from rl.rollout.routing import agreement, routing_rows

SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7, return_routing=True)


@pytest.fixture
def native_engine(model_dir):
    from rl.rollout.native.engine import NativeEngine
    return NativeEngine(model_dir, RolloutConfig(engine="native", max_model_len=128),
                        dtype="float32", device="cpu")


def _check_and_compare(engine_samples, hf_engine):
    """Shapes follow the format; the hf engine's scoring forward routes the same tokens alike."""
    c = hf_engine.model.config
    prompts = [s.prompt_ids for s in engine_samples]
    responses = [s.response_ids for s in engine_samples]
    _, reference = hf_engine._score(prompts, responses, True)
    agree = []
    for s, ref in zip(engine_samples, reference):
        assert s.routing is not None and s.routing.dtype == np.uint8
        rows = routing_rows(len(s.prompt_ids), len(s.response_ids))
        assert s.routing.shape == (rows, c.num_hidden_layers, c.num_experts_per_tok)
        assert ref.shape == s.routing.shape
        agree.append(agreement(s.routing, ref))
    return float(np.mean(agree))


def test_hf_engine_routing_matches_its_own_replay(hf_engine, prompts):
    samples = [s for g in hf_engine.generate(prompts, SAMPLING) for s in g]
    assert _check_and_compare(samples, hf_engine) == 1.0
    plain = hf_engine.generate(prompts, SamplingParams(n=1, max_new_tokens=4, seed=1))
    assert all(s.routing is None for g in plain for s in g)


def test_native_engine_routing_is_the_decode_routing(native_engine, hf_engine, prompts):
    samples = [s for g in native_engine.generate(prompts, SAMPLING) for s in g]
    # Decode-time routing of the native engine vs a full forward of the same fp32 weights.
    assert _check_and_compare(samples, hf_engine) > 0.99


def test_vllm_engine_routing_through_the_worker_extension(vllm_engine, hf_engine, prompts):
    samples = [s for g in vllm_engine.generate(prompts, SAMPLING) for s in g]
    assert _check_and_compare(samples, hf_engine) > 0.99
