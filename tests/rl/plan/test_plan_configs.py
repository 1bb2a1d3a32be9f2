"""The shipped big-model configs load, fit, and their comments quote the planner's numbers."""
import re
from pathlib import Path

import pytest

from rl.config import load_config
from rl.plan import check
from rl.plan.memory import GiB, line_gpu
from rl.plan.report import with_changes

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ["configs/deepseek_v4_flash_3node.yaml", "configs/qwen3_30b_a3b_2node.yaml"]


def quoted(path: Path) -> dict[str, float]:
    """`# ... [plan] <what>: <number> ...` comment lines -> {what: number}."""
    out = {}
    for m in re.finditer(r"\[plan\] ([a-z0-9/ ]+): ([0-9.,]+)", path.read_text()):
        out[m.group(1).strip()] = float(m.group(2).replace(",", ""))
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_config_loads_and_fits(name):
    cfg = load_config(ROOT / name)
    assert cfg.cluster.kind == "slurm" and cfg.model.dtype == "bfloat16"
    assert cfg.rollout.quantization == "fp8"
    assert cfg.trainer.num_ranks == cfg.cluster.trainer.nodes * cfg.cluster.trainer.gpus_per_node
    assert cfg.rollout.max_model_len == cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    verdict = check(cfg, name)
    assert verdict.fits, verdict.report
    assert cfg.checkpoint.keep_last >= 2  # a damaged newest checkpoint has one to fall back to


@pytest.mark.parametrize("name", CONFIGS)
def test_comment_arithmetic_matches_the_planner(name):
    path = ROOT / name
    cfg = load_config(path)
    v = check(cfg, name)
    fp8 = v.rollout.lines[0].gpu
    bf16 = check(with_changes(cfg, {"rollout.quantization": "none"}), name).rollout.lines[0].gpu
    actual = {
        "trainer peak": v.trainer.need("gpu") / GiB,
        "trainer params": line_gpu(v.trainer, "parameters") / GiB,
        "rollout fp8 weights": fp8 / GiB,
        "rollout bf16 weights": bf16 / GiB,
        "rollout kv room": line_gpu(v.rollout, "KV cache") / GiB,
        "rollout concurrent": v.rollout.concurrent,
        "trainer host/node": v.trainer.need("host") / GiB,
        "trainer nvme/node": v.trainer.need("nvme") / 2**40,
    }
    claims = quoted(path)
    assert len(claims) >= 5
    for what, number in claims.items():
        assert actual[what] == pytest.approx(number, abs=0.051), what


def test_v4_config_is_honest_about_what_does_not_fit():
    cfg = load_config(ROOT / CONFIGS[0])
    # the optimizer state on the GPU, half the expert parallelism, full logits instead of the
    # chunked LM head, and transformers' eager V4 attention at 18k tokens: each alone breaks
    # the plan
    for change in ({"trainer.optimizer_offload": "none"}, {"trainer.expert_parallel_size": 8},
                   {"trainer.chunked_lm_head": False}, {"trainer.attention_kernel": "eager"}):
        assert not check(with_changes(cfg, change)).fits, change
