"""Routing replay on the trainer side, in process: the hf engine (routers nudged, so its routing
differs on CPU) returns routing; the trainer's HF model replays it (rl.trainer.replay)."""
import random

import numpy as np
import pytest
import torch

from rl.config import RolloutConfig
from rl.models.presets import build_preset
from rl.models.loading import load_model
from rl.rollout.base import SamplingParams
from rl.rollout.routing import routing_rows
from rl.trainer.batch import TrainBatch
from rl.trainer.microbatch import micro_batches, pad_batch
from rl.trainer.replay import TrainerReplay, reduce_stats

NUDGE = 0.6  # router weights x (1 + NUDGE * noise): a few percent of the choices change


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rl.rollout.hf_engine import HFEngine

    torch.set_num_threads(1)
    model_dir = build_preset("tiny-qwen3-moe", tmp_path_factory.mktemp("m") / "m", seed=0)
    engine = HFEngine(model_dir, RolloutConfig(engine="hf", max_model_len=128), dtype="float32",
                      device="cpu")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(1 + NUDGE * torch.randn(p.shape, generator=g))
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 100) for _ in range(rng.randrange(3, 8))] for _ in range(6)]
    groups = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8,
                                                     seed=3, return_routing=True))
    samples = [s for g in groups for s in g]
    trainer = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu")).eval()
    return engine, trainer, samples


def _batch(samples):
    return TrainBatch.from_samples(samples, [0.0] * len(samples), routing=True)


def test_engine_routing_shape(setup):
    engine, trainer, samples = setup
    for s in samples:
        assert s.routing.dtype == np.uint8
        c = trainer.config
        rows = routing_rows(len(s.prompt_ids), len(s.response_ids))
        assert s.routing.shape == (rows, c.num_hidden_layers, c.num_experts_per_tok)


def _logp(model, mb):
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
    return torch.log_softmax(out.float(), -1).gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)


def test_r3_selects_the_engines_experts_and_shrinks_the_mismatch(setup):
    engine, trainer, samples = setup
    replay = TrainerReplay(trainer, "r3", tis_cap=2.0)
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, a: seen.append(a[1].clone()))
             for n, m in trainer.named_modules() if n.endswith("mlp.experts")]
    try:
        batch = _batch(samples)
        mbs = micro_batches(batch, list(range(len(samples))), 10**6, 1)
        with torch.no_grad():
            for mb in mbs:
                seen.clear()
                replay.old_pass(lambda: _logp(trainer, mb), mb)
                # old_pass runs the model twice: without replay (for the metrics), then with it.
                b, length = mb.input_ids.shape
                assert len(seen) == 2 * replay.routers.num_layers
                for slot, idx in enumerate(seen[replay.routers.num_layers:]):
                    got = idx.view(b, length, -1)
                    m = mb.routing_mask
                    assert torch.equal(got[m], mb.routing[:, :, slot][m])
        stats = reduce_stats(replay.stats(), "r3")
    finally:
        for h in hooks:
            h.remove()
        replay.routers.remove()
    # The nudge shows: the trainer's own routing disagrees with the engine's on some choices...
    assert 0.5 < stats["rollout/routing_agreement"] < 0.99
    # ...and replaying the engine's routing brings the trainer's log-probs closer to the engine's.
    assert stats["train/rollout_logp_absdiff"] < 0.7 * stats["train/noreplay_rollout_logp_absdiff"]
    assert "train/noreplay_tis_ratio_mean" in stats


def test_r2_replays_the_old_pass_routing(setup):
    engine, trainer, samples = setup
    replay = TrainerReplay(trainer, "r2", tis_cap=None)
    saved = {k: v.clone() for k, v in trainer.state_dict().items()}
    try:
        batch = TrainBatch.from_samples(samples, [0.0] * len(samples))  # r2: no engine routing
        (mb,) = micro_batches(batch, list(range(len(samples))), 10**6, 1)
        with torch.no_grad():
            old = replay.old_pass(lambda: _logp(trainer, mb), mb)
            for p in trainer.parameters():  # the update moved the weights
                p.add_(0.05 * torch.randn_like(p))
            with replay.update_pass(mb):
                replayed = _logp(trainer, mb)
            free = _logp(trainer, mb)
        stats = reduce_stats(replay.stats(), "r2")
    finally:
        replay.routers.remove()
        trainer.load_state_dict(saved)
    assert stats["train/routing_agreement"] < 1.0
    assert not torch.equal(replayed, free) and old.shape == replayed.shape


def test_pad_batch_places_routing_and_checks_its_shape(setup):
    _, _, samples = setup
    s = samples[0]
    mb = pad_batch([s.prompt_ids, [1, 5]], [s.response_ids, [7]], index=[0, 1],
                   routing=[s.routing, np.ones((2,) + s.routing.shape[1:], np.uint8)])
    rows = routing_rows(len(s.prompt_ids), len(s.response_ids))
    assert mb.routing_mask[0].sum() == rows and mb.routing_mask[1].sum() == 2
    assert torch.equal(mb.routing[0, :rows], torch.from_numpy(s.routing.astype(np.int64)))
    with pytest.raises(ValueError, match="expected"):
        pad_batch([[1, 2]], [[3]], routing=[np.zeros((3, 4, 2), np.uint8)])
