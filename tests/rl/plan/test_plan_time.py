"""The step-time estimate (rl/plan/timing.py): its arithmetic, and its validation against the
2 x H200 measurements committed in bench/results (bench/plan_time.py; CPU, reads JSONs)."""
import json
import math

import pytest

from bench import plan_time
from rl.config import ConfigError, load_config
from rl.plan import check
from rl.plan.timing import DEVICES, ring_s

V4 = "configs/deepseek_v4_flash_3node.yaml"
# The config's layout before the chunked LM head (ZeRO-3 gathering every expert over IB): the
# tests below compare the ZeRO stages and expert parallelism from there.
ZERO3 = ["trainer.zero_stage=3", "trainer.expert_parallel_size=1",
         "trainer.optimizer_offload=nvme"]


@pytest.fixture(scope="module")
def rows():
    return plan_time.compare(with_async=False)   # the async rows need transformers (seconds)


def test_every_check_row_is_within_25_percent_or_a_declared_miss(rows):
    checks = [r for r in rows if r["role"] == "check"]
    assert len(checks) >= 15   # train, sync, rollout and V4 attention JSONs were all read
    for r in checks:
        key = f"{r['component']} {r['case']}"
        if key in plan_time.MISSES:
            assert not r["within_25%"], f"{key} is now within 25%: drop it from MISSES"
        else:
            assert 0.75 <= r["ratio"] <= 1.33, f"{key}: predicted / measured {r['ratio']:.2f}"
    assert set(plan_time.MISSES) <= {f"{r['component']} {r['case']}" for r in checks}


def test_each_constant_is_fitted_on_one_row_and_the_default_is_that_fit(rows):
    fits = [r for r in rows if r["role"] == "fit"]
    assert sorted(r["component"] for r in fits) == [  # V4 attention: one per layer kind
        "rollout", "train", "v4 attention", "v4 attention", "v4 attention", "weight sync"]
    for r in fits:
        assert r["ratio"] == pytest.approx(1.0, abs=0.01), r
    implied = plan_time.fitted_constants(rows)
    for key, value in implied.items():
        assert getattr(plan_time.DEFAULTS, key.split(".")[1]) == pytest.approx(value, rel=0.01)


def test_committed_table_is_what_the_code_computes(rows):
    committed = json.loads((plan_time.RESULTS / "plan_time.json").read_text())
    # A result file committed after the table (bench/moe_actor.py's) adds rows: rerun the bench.
    ours = [r for r in rows if r["source"] in committed["sources"]]
    committed = [r for r in committed["rows"] if r["role"] != "report"]
    assert [(r["case"], round(r["ratio"], 3)) for r in committed] == [
        (r["case"], round(r["ratio"], 3)) for r in ours]


def test_v4_plan_prints_time_breakdown_and_staleness_overlaps():
    on = check(load_config([V4], ZERO3 + ["algorithm.max_staleness=0"]))
    text = on.report
    for part in ("Step time estimate", "ZeRO-3 collectives over IB", "weight sync:",
                 "decode: weights + KV", "step (on-policy: rollout + train + sync)"):
        assert part in text
    t = on.time
    assert t.total == pytest.approx(t.rollout + t.train + t.sync)
    stale = check(load_config([V4], ZERO3 + ["algorithm.max_staleness=1"])).time
    assert stale.total == pytest.approx(max(stale.rollout, stale.train + stale.sync))
    assert stale.total < t.total


def test_expert_parallel_replaces_most_zero3_traffic():
    base = check(load_config([V4], ZERO3)).time
    ep = check(load_config([V4], ZERO3 + ["trainer.expert_parallel_size=8"]))
    assert "expert parallel 8: all-to-all" in ep.report
    assert ep.time.train < base.train / 1.5   # ZeRO-3 no longer gathers 256 experts per layer


def test_bandwidth_overrides_scale_the_estimate():
    slow = check(load_config([V4], ["plan.inter_node_gbps=25"])).time
    fast = check(load_config([V4], ["plan.inter_node_gbps=100"])).time
    assert slow.train > fast.train and slow.sync > fast.sync
    mi = check(load_config([V4], ["plan.device=mi300x"]))
    assert "AMD MI300X datasheet peaks" in mi.report


def test_ring_volume():
    assert ring_s(8e9, 1, 50) == 0.0
    assert ring_s(8e9, 16, 50) == pytest.approx(8e9 * 15 / 16 / 50e9)
    assert DEVICES["h200"].matmul_tflops == pytest.approx(791, rel=0.01)


@pytest.mark.parametrize("override", ["plan.trainer_mfu=0", "plan.sync_efficiency=1.5",
                                      "plan.hbm_gbps=-1", "plan.device=h100"])
def test_bad_rates_are_config_errors(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].split(".")[1]):
        load_config([V4], [override])


def test_submit_check_prints_the_estimate_in_one_line(capsys):
    from launch.plan import check_or_exit
    check_or_exit(load_config([V4], []), V4)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plan: FITS, estimated step ")
    assert "rollout " in err[0] and "train " in err[0] and "sync " in err[0]


def test_planner_doc_shows_the_estimate_the_planner_prints():
    doc = (plan_time.RESULTS.parents[1] / "docs" / "planner.md").read_text()
    start = doc.index("```text\nStep time estimate") + len("```text\n")
    shown = doc[start:doc.index("```", start)].rstrip("\n")
    report = check(load_config([V4], [])).report
    assert shown in report


def test_moe_actor_reader_predicts_bytes_from_the_model_not_from_the_measurement(tmp_path):
    # bench.moe_actor's schema (its notes carry the shape); the measured numbers are arbitrary:
    # the predictions must not depend on them.
    def write(scale):
        rows = [{"setup": s, "seconds_per_step": 1.0 * scale, "all_gather_GB": 50.0 * scale,
                 "reduce_scatter_GB": 10.0 * scale, "all_to_all_GB": (5.0 * scale if ep else 0.0)}
                for s, ep in (("ZeRO-3, no EP", 0), ("ZeRO-3, EP=2", 1))]
        notes = ["model: DeepSeek-V4 Flash dims, 2 layers, 64 experts top-6, 4.57 B parameters",
                 "batch: 8 x (512 + 1536) tokens = 16384 per step over 2 ranks, micro-batches "
                 "of 4096 tokens, activation checkpointing"]
        (tmp_path / "moe_actor.json").write_text(json.dumps(
            {"bf16_peak_TFLOPs": 790.0, "rows": rows, "notes": notes}))
        return {r["case"]: r["predicted"] for r in plan_time.moe_actor_rows(tmp_path)}
    one, other = write(1.0), write(3.0)
    assert one == other
    shape = " (2 layer(s), 64 experts, 16,384 tokens)"
    ep, no_ep = f"ZeRO-3, EP=2{shape}", f"ZeRO-3, no EP{shape}"
    assert one[f"{ep}: all_gather"] < one[f"{no_ep}: all_gather"] / 3
    assert f"{ep}: all_to_all" in one and f"{no_ep}: all_to_all" not in one
    # 2 micro-batches per rank x 4 gathers x the bf16 parameters
    arch = plan_time.moe_actor_arch(2, 64, 6)
    assert one[f"{no_ep}: all_gather"] == pytest.approx(2 * 4 * 2 * arch.total_params / 1e9)


def test_collective_bytes_per_zero_stage(v4_flash):
    from rl.plan.timing import collective_bytes
    base = load_config([V4], ZERO3)
    p2 = 2 * v4_flash.total_params   # bf16 bytes of every parameter
    z3 = collective_bytes(base, v4_flash, 32, 18432)
    assert z3["all_gather"] == 32 * 4 * p2 and z3["reduce_scatter"] == 32 * p2
    no_ckpt = load_config([V4], ZERO3 + ["trainer.activation_checkpointing=false"])
    assert collective_bytes(no_ckpt, v4_flash, 32, 18432)["all_gather"] == 32 * 3 * p2
    z2 = collective_bytes(load_config([V4], ZERO3 + ["trainer.zero_stage=2"]), v4_flash, 32,
                          18432)
    assert z2["all_gather"] == 4 * p2 and z2["reduce_scatter"] == 32 * p2   # 4 mini-batches
    ep = collective_bytes(load_config([V4], ZERO3 + ["trainer.expert_parallel_size=8"]),
                          v4_flash, 1, 100)
    # One node (8 GPUs): one hop. 4 passes x 43 MoE layers x 100 tokens x the ranks a token
    # goes to (each holding 32 of the 256 experts) x (a bf16 row of 4,096 with 6 int64 ids and
    # fp32 weights, and the row back)
    ranks = 8 * (1 - math.comb(256 - 32, 6) / math.comb(256, 6))
    assert ep["all_to_all"] == pytest.approx(4 * 43 * 100 * ranks * (2 * 4096 * 2 + 6 * 12))
    assert ep["all_to_all_inter"] == 0
    assert ep["all_to_all_intra"] == pytest.approx(4 * 43 * 100 * ranks * 7 / 8 * 2 * 4096 * 2)
    assert ep["all_gather"] < z3["all_gather"]


def _simulated_hops(experts: int, top_k: int, ep: int, node: int, tokens: int) -> dict:
    """Rows a rank sends per token under `rl.trainer.expert_parallel`'s rule, counted over
    random uniform picks: to each node owning a pick (its same local rank), which forwards the
    token to each rank there owning one; with one node, straight to each owning rank."""
    import random
    rng = random.Random(0)
    per, me = experts // ep, 0   # rank 0 of node 0; the layout is symmetric
    out = {"inter": 0, "intra": 0, "local": 0}
    for _ in range(tokens):
        owners = {e // per for e in rng.sample(range(experts), top_k)}
        if node >= ep:
            for o in owners:
                out["local" if o == me else "intra"] += 1
            continue
        nodes = {o // node for o in owners}
        out["inter"] += len(nodes - {me // node})
        out["local"] += me // node in nodes
        for m in nodes:   # the rank of local index 0 on node m forwards inside node m
            for o in owners:
                if o // node == m:
                    out["local" if o % node == 0 else "intra"] += 1
    return {k: v / tokens for k, v in out.items()}


@pytest.mark.parametrize("ep, node", [(16, 8), (8, 8), (32, 8), (4, 2)])
def test_ep_hops_expect_what_the_dispatch_sends(ep, node):
    from rl.plan.arch import Arch
    from rl.plan.timing import ep_hops
    cfg = load_config([V4], [f"trainer.expert_parallel_size={ep}", f"trainer.num_ranks={ep}",
                             f"cluster.trainer.gpus_per_node={node}"])
    arch = Arch(model_type="x", source="test", config={}, tensors=(), num_layers=1, hidden=1,
                vocab=1, top_k=6, num_experts=256)
    hops = ep_hops(cfg, arch)
    assert len(hops) == (2 if node < ep else 1)
    want = _simulated_hops(256, 6, ep, node, 20000)
    for k in ("inter", "intra", "local"):
        assert sum(h[k] for h in hops) == pytest.approx(want[k], rel=0.03, abs=0.01), k


def test_decode_sums_every_step_like_the_rollout_roofline():
    from rl.plan.timing import decode_s
    dev = DEVICES["h200"]
    w, kv_tok, kv_seq, rows, prompt, new, over = 1e9, 1e5, 3e6, 64, 128, 50, 1e-3
    got = decode_s(w, kv_tok, kv_seq, rows, prompt, new, 1e9, 0.0, dev, 0.2, over)["decode"]
    # bench.rollout.roofline_seconds' loop: steps 1 .. new - 1, each reading weights + context
    want = sum((w + rows * kv_seq + rows * (prompt + s) * kv_tok) / (dev.hbm_gbps * 1e9) + over
               for s in range(1, new))
    assert got == pytest.approx(want, rel=1e-12)
