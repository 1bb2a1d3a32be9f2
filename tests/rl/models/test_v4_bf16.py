"""DeepSeek-V4 in BF16, its production dtype, on the paths production calls.

`load_model` keeps V4's norms and hyper-connection mixers in fp32 (as DeepSeek stores them) and
their outputs in the activations' dtype (`rl.models.v4_precision`). Without that, a BF16 V4
fails its first forward ("expected m1 and m2 to have the same dtype"): every test here fails on
such code. Figures are against the same checkpoint run in fp32."""
import math

import pytest
import torch

from rl.models.loading import load_model

PROMPTS = [[1, 20, 21, 22, 23, 24], [1, 30, 31, 32], [1, 40, 41, 42, 43, 44, 45, 46, 47]]


def logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token log-probs in fp32: (B, S-1)."""
    logits = model(ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


@pytest.fixture(scope="module")
def v4_dir(preset_dirs):
    return preset_dirs["tiny-deepseek-v4"]


@pytest.mark.parametrize("attention", ["auto", "eager"])
def test_bf16_forward_and_backward_track_fp32(v4_dir, attention):
    """Both attention kernels the trainer can run: the forward agrees with fp32 to BF16 rounding,
    and a backward reaches every parameter the LM loss reaches in fp32, with finite values."""
    torch.manual_seed(0)
    ids = torch.randint(3, 60, (2, 48))
    ref = load_model(v4_dir, torch.float32, attention=attention)
    bf16 = load_model(v4_dir, torch.bfloat16, attention=attention)
    assert bf16.model.layers[0].input_layernorm.weight.dtype == torch.float32  # kept as stored
    with torch.no_grad():
        want, got = logprobs(ref, ids), logprobs(bf16, ids)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got - want).abs().max() < 0.1 and (got - want).abs().mean() < 0.02

    grads = {}
    for name, model in (("fp32", ref), ("bf16", bf16)):
        model.train()
        loss = -logprobs(model, ids).mean()
        loss.backward()
        grads[name] = {n for n, p in model.named_parameters()
                       if p.grad is not None and p.grad.abs().sum() > 0}
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert grads["bf16"] == grads["fp32"] and len(grads["bf16"]) > 50
    norm = bf16.model.layers[1].self_attn.kv_norm.weight
    assert norm.grad.dtype == torch.float32


@pytest.fixture(scope="module")
def bf16_engine(v4_dir):
    from rl.config import RolloutConfig
    from rl.rollout.hf_engine import HFEngine

    torch.set_num_threads(1)
    return HFEngine(str(v4_dir), RolloutConfig(engine="hf", max_model_len=128),
                    dtype="bfloat16", device="cpu")


def test_bf16_hf_engine_generates_and_scores(bf16_engine):
    """The HF engine in BF16 (the V4 engine on CPUs and for the tiny model on GPUs): sampled and
    greedy generation with a KV cache, log-probs equal to its own scoring of the same tokens."""
    from rl.rollout.base import SamplingParams

    assert bf16_engine.model.dtype == torch.bfloat16
    groups = bf16_engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0,
                                                          max_new_tokens=12, seed=1))
    samples = [s for g in groups for s in g]
    assert all(s.response_ids and len(s.logprobs) == len(s.response_ids) for s in samples)
    scored = bf16_engine.score([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    worst = max(abs(a - b) for s, row in zip(samples, scored) for a, b in zip(s.logprobs, row))
    assert worst < 0.05  # cached decode vs one forward, BF16 rounding
    greedy = bf16_engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0,
                                                          max_new_tokens=8))
    assert all(len(g[0].response_ids) > 0 for g in greedy)


@pytest.mark.slow
def test_bf16_deepspeed_step_then_sync_into_the_hf_engine(v4_dir):
    """The runtime production builds (`rl.runtime.Runtime`, plain processes): a DeepSpeed ZeRO-3
    trainer in BF16 trains V4 one step, the weight sync (FP8 on the wire, checksummed) carries it
    to a BF16 HF engine, and the engine then scores as the trainer does."""
    from rl.config import (AlgorithmConfig, Config, ModelConfig, RolloutConfig, SyncConfig,
                           TrainerConfig)
    from rl.rollout.base import SamplingParams
    from rl.runtime import Placement, Runtime
    from rl.trainer.batch import TrainBatch

    cfg = Config(model=ModelConfig(path=str(v4_dir), preset=None, dtype="bfloat16"),
                 rollout=RolloutConfig(engine="hf", max_model_len=128, torch_threads=1),
                 trainer=TrainerConfig(num_ranks=1, zero_stage=3, device="cpu", lr=1e-2,
                                       micro_batch_tokens=512, torch_threads=1),
                 algorithm=AlgorithmConfig(kl_coef=0.0),
                 sync=SyncConfig(wire_dtype="fp8", verify=True, timeout_s=120.0))
    rt = Runtime(cfg, str(v4_dir), total_optimizer_steps=2,
                 placement=Placement("proc", "cpu", "cpu"))
    try:
        sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=0)
        samples = [s for g in rt.rollout.generate(PROMPTS, sp, seed=0) for s in g]
        rewards = [float(s.response_ids[0] % 2) for s in samples]
        adv = [r - sum(rewards[i // 4 * 4: i // 4 * 4 + 4]) / 4 for i, r in enumerate(rewards)]
        batch = TrainBatch.from_samples(samples, adv)
        P, R = batch.prompt_ids, batch.response_ids
        trainer_before = rt.trainer.score(P, R)
        stats = rt.trainer.train(batch, 0).metrics
        assert all(math.isfinite(v) for v in stats.values()), stats
        assert stats["train/grad_norm"] > 0
        trainer_after = rt.trainer.score(P, R)
        engine_before = rt.rollout.score(P, R)[0]
        rt.weight_sync.update(1)
        assert rt.rollout.versions() == [1]
        engine_after = rt.rollout.score(P, R)[0]

        def gap(a, b):
            vals = [abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)]
            return sum(vals) / len(vals)
        assert gap(trainer_before, trainer_after) > 0.01  # the step moved the policy
        assert gap(engine_after, trainer_after) < 0.25 * gap(engine_before, trainer_after)
        assert gap(engine_after, trainer_after) < 0.05    # FP8 wire, BF16 on both sides
    finally:
        rt.shutdown()
