"""ZeRO / offload arithmetic, rollout KV room, verdicts and suggestions."""
import math

import pytest

from rl.config import load_config
from rl.plan.memory import GiB, GroupPlan, Line, plan_rollout, plan_trainer, rollout_weight_bytes
from rl.plan.report import build, with_changes

GPU_CLUSTER = ["cluster.kind=slurm", "model.dtype=bfloat16", "cluster.trainer.nodes=1",
               "cluster.trainer.gpus_per_node=8", "trainer.num_ranks=8",
               "cluster.rollout.gpus_per_node=8", "plan.overhead_gb=0"]


def gpu_cfg(*overrides):
    return load_config(None, [*GPU_CLUSTER, *overrides])


def line(g: GroupPlan, prefix: str) -> Line:
    return next(ln for ln in g.lines if ln.label.startswith(prefix))


def test_peak_is_resident_plus_the_larger_transient():
    g = GroupPlan("x", [""], [Line("a", gpu=10 * GiB), Line("b", gpu=5 * GiB, phase="train"),
                              Line("c", gpu=7 * GiB, phase="step")], gpu_budget=17 * GiB)
    assert g.need("gpu") == 17 * GiB and g.fits and g.overruns() == []
    g.gpu_budget = 16 * GiB
    assert not g.fits
    assert g.overruns() == ["per GPU: needs 17.0 GiB of 16.0 GiB (over by 1.0 GiB)"]


@pytest.mark.parametrize("stage, params, grads, master", [
    (0, 2, 2, 4), (1, 2, 2, 4 / 8), (2, 2, 2 / 8, 4 / 8), (3, 2 / 8, 2 / 8, 4 / 8)])
def test_zero_stage_partitioning(qwen3_8b, stage, params, grads, master):
    P = qwen3_8b.total_params
    g = plan_trainer(gpu_cfg(f"trainer.zero_stage={stage}"), qwen3_8b)
    assert line(g, "parameters").gpu == pytest.approx(params * P)
    assert line(g, "gradients").gpu == pytest.approx(grads * P)
    assert line(g, "fp32 master").gpu == pytest.approx(master * P)
    assert line(g, "AdamW moments").gpu == pytest.approx(2 * master * P)


def test_optimizer_offload_moves_state_to_each_node(qwen3_8b):
    P = qwen3_8b.total_params
    g = plan_trainer(gpu_cfg("trainer.zero_stage=3", "trainer.optimizer_offload=cpu"), qwen3_8b)
    # 8 ranks per node, each with 1/8: master 4 + moments 8 + fp32 grads 4 + bf16 grads 2 = 18 B
    assert g.need("host") == pytest.approx(18 * P)
    assert line(g, "fp32 master").gpu == 0 and line(g, "AdamW").gpu == 0
    nvme = plan_trainer(gpu_cfg("trainer.zero_stage=3", "trainer.optimizer_offload=nvme",
                                "plan.nvme_gb=100000"), qwen3_8b)
    assert nvme.need("nvme") == pytest.approx(16 * P)
    assert nvme.need("host") < g.need("host") and nvme.need("gpu") == pytest.approx(g.need("gpu"))


def test_invalid_combinations_do_not_fit(qwen3_8b):
    g = plan_trainer(gpu_cfg("trainer.zero_stage=0", "trainer.optimizer_offload=cpu"), qwen3_8b)
    assert not g.fits and "needs trainer.zero_stage >= 1" in g.problems[0]
    g = plan_trainer(gpu_cfg("trainer.zero_stage=2", "trainer.param_offload=cpu"), qwen3_8b)
    assert not g.fits and "zero_stage: 3" in g.problems[0]
    g = plan_trainer(gpu_cfg("trainer.num_ranks=16"), qwen3_8b)
    assert not g.fits and "num_ranks is 16 but cluster.trainer has 1 x 8 = 8" in g.problems[0]


def test_activation_checkpointing_and_eager_scores(v4_flash):
    base = ["cluster.trainer.nodes=2", "trainer.num_ranks=16", "trainer.micro_batch_tokens=4096",
            "rollout.max_model_len=4096", "rollout.max_new_tokens=4096"]
    full = plan_trainer(gpu_cfg(*base, "trainer.attention_kernel=fused"), v4_flash)
    ckpt = plan_trainer(gpu_cfg(*base, "trainer.attention_kernel=fused",
                                "trainer.activation_checkpointing=true"), v4_flash)
    assert line(ckpt, "activations: decoder").gpu < line(full, "activations: decoder").gpu / 10
    eager = plan_trainer(gpu_cfg(*base, "trainer.activation_checkpointing=true",
                                 "trainer.attention_kernel=eager"), v4_flash)
    # one layer's scores: 64 heads x 4096 x (4096 + 4096/4) x (2 B kept + 4 B fp32 softmax)
    assert line(eager, "activations: eager").gpu == 64 * 4096 * 5120 * 6
    # auto is what load_model runs for V4: rl.models.v4_attention, no score matrix
    auto = plan_trainer(gpu_cfg(*base, "trainer.activation_checkpointing=true"), v4_flash)
    assert not any(ln.label.startswith("activations: eager") for ln in auto.lines)
    assert any("rl.models.v4_attention" in n for n in auto.notes)


def test_rollout_weights_and_kv_room(qwen3_8b):
    P = qwen3_8b.total_params
    bf16, kept, scales = rollout_weight_bytes(qwen3_8b, tp=1, fp8=False)
    assert bf16 == 2 * P and kept == 2 * P and scales == 0
    fp8, kept, scales = rollout_weight_bytes(qwen3_8b, tp=1, fp8=True)
    embed = qwen3_8b.vocab * qwen3_8b.hidden
    assert kept > 2 * 2 * embed and fp8 == pytest.approx(P + kept / 2 + scales)
    cfg = gpu_cfg("rollout.quantization=fp8", "rollout.max_model_len=32768")
    g = plan_rollout(cfg, qwen3_8b)
    room = 0.85 * 140 * GiB - fp8
    per_seq = 2 * 8 * 128 * 36 * 2 * 32768
    assert g.concurrent == math.floor(room / per_seq) and g.fits


def test_rollout_that_cannot_hold_one_sequence(qwen3_8b):
    g = plan_rollout(gpu_cfg("plan.gpu_memory_gb=24", "rollout.max_model_len=40960"), qwen3_8b)
    assert not g.fits and "cannot hold one sequence" in g.problems[0]
    g = plan_rollout(gpu_cfg("plan.gpu_memory_gb=16"), qwen3_8b)
    assert not g.fits and "no room for KV cache" in g.problems[0]


def test_suggestions_are_replanned_configs(v4_flash):
    cfg = gpu_cfg("cluster.trainer.nodes=2", "trainer.num_ranks=16", "trainer.zero_stage=3",
                  "trainer.attention_kernel=fused", "trainer.activation_checkpointing=true",
                  "trainer.optimizer_offload=cpu", "rollout.quantization=fp8",
                  "rollout.tensor_parallel_size=8", "rollout.max_model_len=8192")
    v = build(cfg, v4_flash, "test", [])
    assert not v.fits and not v.trainer.fits and v.rollout.fits
    assert "host RAM per node: needs" in v.report
    # the quoted alternatives are what planning the changed config gives
    more = plan_trainer(with_changes(cfg, {"cluster.trainer.nodes": 3, "trainer.num_ranks": 24}),
                        v4_flash)
    assert more.fits
    assert "cluster.trainer.nodes=3 trainer.num_ranks=24" in v.report
    assert "trainer.optimizer_offload=nvme (needs plan.nvme_gb >= " in v.report
    assert v.report.rstrip().endswith("Verdict: DOES NOT FIT: trainer")


def test_with_changes_revalidates():
    with pytest.raises(ValueError, match="zero_stage"):
        with_changes(gpu_cfg(), {"trainer.zero_stage": 5})


def test_cpu_runs_are_checked_against_host_memory_only(qwen3_8b):
    cfg = load_config(None, ["cluster.kind=local"])
    v = build(cfg, qwen3_8b, "cpu", [])
    assert v.trainer.gpu_budget is None and v.rollout.gpu_budget is None
    assert v.trainer.need("gpu") == 0 and v.trainer.need("host") > 16 * qwen3_8b.total_params / 2


def test_expert_parallel_holds_1_over_ep_of_the_experts_outside_zero(v4_flash):
    routed = sum(t.numel for t in v4_flash.tensors if t.routed)
    dense = v4_flash.total_params - routed
    g = plan_trainer(gpu_cfg("trainer.zero_stage=3", "trainer.expert_parallel_size=8"), v4_flash)
    assert line(g, "parameters").gpu == pytest.approx(2 * dense / 8)  # ZeRO: the rest only
    # bf16 weights 2 + gradients 2 + fp32 master 4 + AdamW 8 = 16 B per expert parameter held.
    assert line(g, "routed experts (1/8").gpu == pytest.approx(16 * routed / 8)
    no_ep = plan_trainer(gpu_cfg("trainer.zero_stage=3"), v4_flash)
    # ZeRO-3 no longer gathers a whole expert stack: the largest module is a dense one.
    assert line(g, "ZeRO-3 gathered").gpu < line(no_ep, "ZeRO-3 gathered").gpu


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_expert_parallel_with_offload_keeps_the_experts_optimizer_state_in_host_ram(v4_flash,
                                                                                   offload):
    routed = [t.numel for t in v4_flash.tensors if t.routed]
    on = plan_trainer(gpu_cfg("trainer.zero_stage=3", "trainer.expert_parallel_size=8",
                              f"trainer.optimizer_offload={offload}", "plan.nvme_gb=100000"),
                      v4_flash)
    no_ep = plan_trainer(gpu_cfg("trainer.zero_stage=3", f"trainer.optimizer_offload={offload}",
                                 "plan.nvme_gb=100000"), v4_flash)
    dev = plan_trainer(gpu_cfg("trainer.zero_stage=3", "trainer.expert_parallel_size=8"),
                       v4_flash)
    # GPU: bf16 weights 2 + gradients 2 per expert parameter held, 1/8 of them per rank.
    assert line(on, "routed experts (1/8, expert parallel)").gpu == pytest.approx(
        4 * sum(routed) / 8)
    assert line(on, "routed experts (1/8, expert parallel)").host == 0
    # Host RAM per node (8 ranks of 1/8 each): fp32 master 4 + AdamW m, v 8; also with nvme.
    host = line(on, "routed experts (1/8): fp32 master, AdamW m, v")
    assert host.host == pytest.approx(12 * sum(routed)) and host.gpu == 0 and host.nvme == 0
    # The step's fp32 gradient (+ bf16 staging): one tensor, the largest, per rank.
    assert line(on, "routed experts: fp32 gradient").host == pytest.approx(6 * max(routed))
    assert on.need("gpu") < dev.need("gpu") - 11 * sum(routed) / 8
    # NVMe holds ZeRO's dense state only: less than without EP by the experts' 16 B.
    assert on.need("nvme") <= no_ep.need("nvme") - (16 * sum(routed) if offload == "nvme" else 0)
    assert any("not NVMe" in n for n in on.notes) == (offload == "nvme")
    assert not any("stay on the GPU" in n for n in on.notes)


def test_v4_flash_3node_fits_with_ep16_not_ep8(v4_flash):
    # The 3-node config (ZeRO-2, EP 16, optimizer offload to host RAM): each rank holds 16 of
    # 256 experts per layer, their bf16 weights and gradients on the GPU, their fp32 state in
    # host RAM; EP 8 doubles both.
    v4 = "configs/deepseek_v4_flash_3node.yaml"
    ep16 = plan_trainer(load_config([v4], ["trainer.expert_parallel_size=16"]), v4_flash)
    ep8 = plan_trainer(load_config([v4], ["trainer.expert_parallel_size=8"]), v4_flash)
    assert ep16.fits, ep16.overruns()
    assert ep8.need("gpu") > ep8.gpu_budget and ep8.need("host") > ep8.host_budget


def test_expert_parallel_needs_routed_experts(qwen3_8b):
    g = plan_trainer(gpu_cfg("trainer.expert_parallel_size=2"), qwen3_8b)  # a dense model
    assert not g.fits
    assert "expert_parallel_size 2 does not divide the model's 0 routed experts" in g.problems[0]


def test_more_nodes_suggestion_keeps_expert_parallelism_a_divisor_of_the_ranks():
    from rl.plan import check
    # Nothing the suggestions change fits, so more nodes are tried: 3 x 8 = 24 ranks is not a
    # multiple of EP 16 (it raised the config's FieldError), 4 nodes are.
    report = check(load_config(["configs/deepseek_v4_flash_3node.yaml"], [
        "trainer.expert_parallel_size=16", "rollout.max_new_tokens=65536",
        "rollout.max_model_len=67584"])).report
    assert "Suggestions (trainer)" in report and "cluster.trainer.nodes=3" not in report
