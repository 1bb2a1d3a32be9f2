"""DeepSeek-V4 in BF16 on a GPU, loaded as production loads it (`rl.models.loading.load_model`):
the trainer's forward + backward with the Triton V4 attention against the same model in fp32,
and the HF engine's cached generation and scoring (the tiny V4's rollout engine on GPUs)."""
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    from rl.config import ModelConfig
    from rl.models.loading import resolve_model_dir
    return resolve_model_dir(ModelConfig(preset="tiny-deepseek-v4"),
                             tmp_path_factory.mktemp("v4"))


def _logprobs(model, ids):
    logits = model(ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_bf16_train_forward_backward_on_cuda(v4_dir, report):
    from rl.models import v4_attention
    from rl.models.loading import load_model

    ids = torch.randint(3, 60, (4, 256), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    ref = load_model(v4_dir, torch.float32, "cuda")
    bf16 = load_model(v4_dir, torch.bfloat16, "cuda")
    assert bf16.config._attn_implementation == v4_attention.IMPLEMENTATION
    with torch.no_grad():
        diff = (_logprobs(bf16, ids) - _logprobs(ref, ids)).abs()
    bf16.train()
    loss = -_logprobs(bf16, ids).mean()
    loss.backward()
    grads = [p.grad for p in bf16.parameters() if p.grad is not None]
    report("v4_bf16_cuda", logprob_max_diff=diff.max().item(), logprob_mean_diff=diff.mean().item(),
           params_with_grad=len(grads))
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    assert diff.max() < 0.25 and diff.mean() < 0.02  # 1,020 tokens, BF16 rounding
    assert len(grads) > 50


def test_bf16_hf_engine_on_cuda(v4_dir, report):
    from rl.config import RolloutConfig
    from rl.rollout.base import SamplingParams
    from rl.rollout.hf_engine import HFEngine

    engine = HFEngine(str(v4_dir), RolloutConfig(engine="hf", max_model_len=128),
                      dtype="bfloat16", device="cuda")
    prompts = [[1, 20 + i, 21, 22, 23] for i in range(16)]
    groups = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=16,
                                                     seed=0))
    samples = [s for g in groups for s in g]
    scored = engine.score([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    worst = max(abs(a - b) for s, row in zip(samples, scored) for a, b in zip(s.logprobs, row))
    report("v4_bf16_hf_engine_cuda", generate_vs_score_max_diff=worst, samples=len(samples))
    assert all(s.response_ids for s in samples)
    assert worst < 0.05


@pytest.mark.parametrize("fused", [False, True], ids=["hf_layer", "fused_layer"])
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_deepspeed_trainer_trains_v4_on_cuda(v4_dir, zero_stage, fused, report, monkeypatch):
    """DeepSpeed hands the model views into flat buffers, where V4's 3-element hyper-connection
    `scale` leaves the expert weights off 16-byte alignment at 1 rank, which grouped_mm refuses
    on CUDA ("expected data_ptr to be aligned to 16 bytes"): the worker's experts check and run
    such calls on aligned copies (`rl.trainer.alignment`). With the fused layer (`RL_V4_LAYER=1`)
    the compiled functions get aligned copies of the misaligned norm and mixer weights
    (inductor's kernels fault on them: "CUDA error: misaligned address")."""
    pytest.importorskip("deepspeed")
    from rl.models import v4_layer
    monkeypatch.setenv(v4_layer.ENV, "1" if fused else "0")
    from rl.cluster.actors import ProcActor, wait_all
    from rl.cluster.groups import free_port
    from rl.config import AlgorithmConfig, SyncConfig, TrainerConfig
    from rl.trainer import alignment
    from rl.trainer.batch import TrainBatch
    from rl.trainer.worker import RankInfo, TrainerWorker

    cfg = TrainerConfig(num_ranks=1, zero_stage=zero_stage, device="cuda", lr=1e-3,
                        micro_batch_tokens=1024)
    actor = ProcActor(TrainerWorker, cfg, AlgorithmConfig(kl_coef=0.0), SyncConfig(),
                      str(v4_dir), "bfloat16",
                      RankInfo(rank=0, world_size=1, master_addr="127.0.0.1",
                               master_port=free_port()), 0, 4, name="rank0")
    try:
        wait_all([actor.ready], timeout=300)
        prompts = [[1, 20 + i, 21, 22] for i in range(8)]
        responses = [[30 + i, 31, 32, 33, 2] for i in range(8)]
        batch = TrainBatch(prompt_ids=prompts, response_ids=responses,
                           rollout_logprobs=[[-4.0] * 5] * 8,
                           advantages=[1.0 if i % 2 else -1.0 for i in range(8)])
        stats = wait_all([actor.call("train_step", batch, 1)], timeout=300)[0].metrics
        (kernels,) = wait_all([actor.call("kernels")], timeout=60)
        report(f"v4_zero{zero_stage}_{'fused' if fused else 'hf'}_cuda", **kernels,
               grad_norm=stats["train/grad_norm"])
        assert kernels["experts"] == (v4_layer.IMPLEMENTATION if fused
                                      else alignment.IMPLEMENTATION)
        assert stats["train/grad_norm"] > 0 and all(
            v == v and abs(v) != float("inf") for v in stats.values())
    finally:
        actor.close()
