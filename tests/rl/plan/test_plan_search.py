"""`launch.plan --search`: the layouts of one job, re-planned, fastest first."""
from pathlib import Path

import pytest

from launch.plan import main as plan_main
from rl.config import load_config
from rl.plan import arch, check, source
from rl.plan.report import with_changes
from rl.plan.search import report, search
from rl.plan.timing import _fmt

ROOT = Path(__file__).resolve().parents[3]
V4 = ROOT / "configs/deepseek_v4_flash_3node.yaml"


@pytest.fixture(scope="module")
def v4_layouts():
    cfg = load_config(V4)
    config, where, _ = source.model_config(cfg)
    a = arch.parse(config, where)
    return cfg, search(cfg, a), search(with_changes(cfg, {"trainer.chunked_lm_head": False}), a)


def test_3node_config_is_the_fastest_layout_with_5pct_headroom(v4_layouts):
    cfg, layouts, full_logits = v4_layouts
    best = next(x for x in layouts if x.within(0.05))
    assert best.changes == {}, best.overrides
    assert best is layouts[0]  # nothing faster fits at all
    assert best.values["trainer.expert_parallel_size"] == 16
    # With full logits (trainer.chunked_lm_head: false) the layout does not fit, and the best
    # one that does takes more than 1.5 times as long.
    full_need = check(with_changes(cfg, {"trainer.chunked_lm_head": False})).trainer
    full_use = full_need.need("gpu") / full_need.gpu_budget
    assert full_use > 1
    full_best = next(x for x in full_logits if x.within(0.05))
    assert full_best.values["trainer.expert_parallel_size"] == 1
    assert full_best.step_s > 1.5 * best.step_s
    # the config's comment quotes these figures
    text = " ".join(V4.read_text().split())
    for figure in (f"estimated {_fmt(best.step_s)} a step",
                   f"{best.use['trainer GPU']:.1%} of a trainer GPU",
                   f"with full logits it needs {full_use:.1%} of a trainer GPU",
                   f"at {_fmt(full_best.step_s)}."):
        assert figure in text, figure
    # and so do docs/planner.md and docs/layout_search.md
    for doc in ("docs/planner.md", "docs/layout_search.md"):
        text = " ".join((ROOT / doc).read_text().split())
        for figure in (_fmt(best.step_s), _fmt(full_best.step_s)):
            assert figure in text, (doc, figure)
    assert f"| {_fmt(best.step_s)} | {best.use['trainer GPU']:.1%} |" in text
    assert f"| {_fmt(full_best.step_s)} | {full_best.use['trainer GPU']:.1%} |" in text
    # README states the estimate, with the config's one step of staleness and on-policy
    from rl.plan.memory import plan_rollout
    from rl.plan.timing import estimate
    assert cfg.algorithm.max_staleness == 1
    on_policy = with_changes(cfg, {"algorithm.max_staleness": 0})
    config, where, _ = source.model_config(on_policy)
    a = arch.parse(config, where)
    on = estimate(on_policy, a, plan_rollout(on_policy, a)).total
    assert on > best.step_s
    for doc in ("README.md", "docs/planner.md"):
        text = " ".join((ROOT / doc).read_text().split())
        for figure in (f"{_fmt(best.step_s)} a step", f"`algorithm.max_staleness: 1`; "
                       f"{_fmt(on)} on-policy"):
            assert figure in text, (doc, figure)


def test_rows_are_the_planners_numbers_for_that_layout(v4_layouts):
    cfg, layouts, _ = v4_layouts
    for layout in (layouts[0], layouts[-1]):
        verdict = check(with_changes(cfg, layout.changes))
        assert verdict.fits and verdict.time.total == pytest.approx(layout.step_s)
        assert layout.use["trainer GPU"] == pytest.approx(
            verdict.trainer.need("gpu") / verdict.trainer.gpu_budget)
    assert [x.step_s for x in layouts] == sorted(x.step_s for x in layouts)


def test_the_headroom_picks_the_layout(v4_layouts):
    _, layouts, _ = v4_layouts
    text, best = report("v4", layouts, 0.10)
    assert best is not layouts[0] and best.changes == {"trainer.zero_stage": 3}
    assert text.endswith("fastest with 10% free: trainer.zero_stage=3, estimated step "
                         f"{_fmt(best.step_s)}")


def test_cli_prints_the_table_and_exits_by_headroom(capsys):
    assert plan_main([str(V4), "--search"]) == 0
    out = capsys.readouterr().out
    assert "fastest with 5% free: (this config)" in out and "ok  (this config)" in out
    assert plan_main([str(V4), "--search", "--headroom", "0.5"]) == 1
    assert "no layout leaves 50% of every budget free" in capsys.readouterr().out


def test_a_cpu_config_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_main([str(ROOT / "configs/local.yaml"), "--search"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "the layout search plans GPU jobs" in err
