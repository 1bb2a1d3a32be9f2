"""One RL step with trainer rank 0 and the rollout engine on one device, in plain processes:
generate, train, sync over the same-device transport (`rl.sync.ipc`), and the engine's log-probs
against the trainer's before and after. The GPU test runs it on one GPU (CUDA IPC), the CPU test
on the CPU (/dev/shm): one code path, two ways of sharing the staging slots."""
from __future__ import annotations

import math


def one_step_on_one_device(tmp_path, device: str, backend: str, dtype: str,
                           zero_stage: int) -> dict:
    """`device`: `cuda` or `cpu` (trainer and engine both); `backend`: `sync.backend`. Returns
    the runtime's chosen transport, the sync stats and the mean |log-prob| gaps."""
    from rl.config import (AlgorithmConfig, Config, ModelConfig, RolloutConfig, SyncConfig,
                           TrainerConfig)
    from rl.models.loading import resolve_model_dir
    from rl.rollout.base import SamplingParams
    from rl.runtime import Placement, Runtime
    from rl.trainer.batch import TrainBatch

    cfg = Config(model=ModelConfig(preset="tiny-qwen3-moe", dtype=dtype),
                 rollout=RolloutConfig(engine="native", max_model_len=128, max_batch_size=64),
                 trainer=TrainerConfig(num_ranks=1, zero_stage=zero_stage, device=device,
                                       lr=3e-3, micro_batch_tokens=2048),
                 algorithm=AlgorithmConfig(kl_coef=0.0),
                 sync=SyncConfig(backend=backend, verify=True, bucket_mb=0.25, timeout_s=120.0))
    model_dir = str(resolve_model_dir(cfg.model, cache_root=tmp_path))
    rt = Runtime(cfg, model_dir, total_optimizer_steps=1,
                 placement=Placement("proc", device, device))
    try:
        prompts = [[1, 10 + i, 20 + i, 30] for i in range(8)]
        sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=0)
        samples = [s for g in rt.rollout.generate(prompts, sp, seed=0) for s in g]
        assert all(s.weight_version == 0 and s.response_ids for s in samples)
        rewards = [sum(t % 2 for t in s.response_ids) / len(s.response_ids) for s in samples]
        adv = []
        for i in range(0, len(rewards), 4):
            grp = rewards[i:i + 4]
            adv += [r - sum(grp) / 4 for r in grp]
        batch = TrainBatch.from_samples(samples, adv)
        P, R = batch.prompt_ids, batch.response_ids
        trainer_before = rt.trainer.score(P, R)
        stats = rt.trainer.train(batch, 0).metrics
        assert all(math.isfinite(v) for v in stats.values()), stats
        engine_before = rt.rollout.score(P, R)[0]
        sync = rt.weight_sync.update(1)
        versions = rt.rollout.versions()
        engine_after = rt.rollout.score(P, R)[0]
        trainer_after = rt.trainer.score(P, R)
        sync2 = rt.weight_sync.update(2)  # again: the staging slots are reused, the versions move on
        again = [s for g in rt.rollout.generate(prompts, sp, seed=1) for s in g]

        def gap(a, b):
            vals = [abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)]
            return sum(vals) / len(vals)
        return {"transport": rt.sync_backend, "sync": sync, "sync_again": sync2,
                "versions": versions, "versions_again": rt.rollout.versions(),
                "sample_versions_again": sorted({s.weight_version for s in again}),
                "train_tokens_per_s": stats["train/tokens_per_s"],
                "trainer_moved": gap(trainer_before, trainer_after),
                "engine_vs_trainer_before_sync": gap(engine_before, trainer_after),
                "engine_vs_trainer_after_sync": gap(engine_after, trainer_after)}
    finally:
        rt.shutdown()
