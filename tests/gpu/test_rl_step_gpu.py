"""A full GPU RL step in plain processes: DeepSpeed BF16 trainer on GPU0 -> FP8 weight sync over
NCCL -> native FP8 engine on GPU1 generates with the new weights."""
import math

import pytest
import torch

from tests.gpu.workers import two_gpus

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not two_gpus(), reason="needs 2 GPUs (nvidia-h200-x2)")]


def test_train_on_gpu0_sync_generate_on_gpu1(tmp_path, report):
    pytest.importorskip("deepspeed")
    from rl.config import (AlgorithmConfig, Config, ModelConfig, RolloutConfig, SyncConfig,
                           TrainerConfig)
    from rl.models.loading import resolve_model_dir
    from rl.rollout.base import SamplingParams
    from rl.runtime import Placement, Runtime
    from rl.trainer.batch import TrainBatch

    cfg = Config(model=ModelConfig(preset="tiny-qwen3-moe", dtype="bfloat16"),
                 rollout=RolloutConfig(engine="native", quantization="fp8", max_model_len=128,
                                       max_batch_size=64),
                 trainer=TrainerConfig(num_ranks=1, zero_stage=3, device="cuda", lr=3e-3,
                                       micro_batch_tokens=2048),
                 algorithm=AlgorithmConfig(kl_coef=0.0),
                 sync=SyncConfig(wire_dtype="fp8", backend="nccl", timeout_s=120.0))
    model_dir = str(resolve_model_dir(cfg.model, cache_root=tmp_path))
    rt = Runtime(cfg, model_dir, total_optimizer_steps=1,
                 placement=Placement("proc", "cuda", "cuda:1"))
    try:
        prompts = [[1, 10 + i, 20 + i, 30] for i in range(8)]
        sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=0)
        samples = [s for g in rt.rollout.generate(prompts, sp, seed=0) for s in g]
        assert all(s.weight_version == 0 and s.response_ids for s in samples)
        rewards = [sum(t % 2 for t in s.response_ids) / len(s.response_ids) for s in samples]
        adv = []
        for i in range(0, len(rewards), 4):
            grp = rewards[i:i + 4]
            mean = sum(grp) / 4
            adv += [r - mean for r in grp]
        batch = TrainBatch.from_samples(samples, adv)
        P, R = batch.prompt_ids, batch.response_ids
        trainer_before = rt.trainer.score(P, R)
        stats = rt.trainer.train(batch, 0).metrics
        assert all(math.isfinite(v) for v in stats.values()), stats
        engine_before = rt.rollout.score(P, R)[0]
        sync = rt.weight_sync.update(1)
        assert rt.rollout.versions() == [1]
        engine_after = rt.rollout.score(P, R)[0]
        trainer_after = rt.trainer.score(P, R)

        def gap(a, b):
            vals = [abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)]
            return sum(vals) / len(vals)
        report("rl_step_gpu", train_tokens_per_s=stats["train/tokens_per_s"],
               sync_seconds=sync.get("seconds"), sync_bytes=sync.get("bytes"),
               trainer_moved=gap(trainer_before, trainer_after),
               engine_vs_trainer_before_sync=gap(engine_before, trainer_after),
               engine_vs_trainer_after_sync=gap(engine_after, trainer_after))
        assert gap(trainer_before, trainer_after) > 0.01     # the step changed the policy
        assert gap(engine_after, trainer_after) < gap(engine_before, trainer_after)
        assert gap(engine_after, trainer_after) < 0.1        # bf16 trainer vs FP8 engine
        again = [s for g in rt.rollout.generate(prompts, sp, seed=1) for s in g]
        assert all(s.weight_version == 1 for s in again)
    finally:
        rt.shutdown()
