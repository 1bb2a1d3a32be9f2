"""Which layout of the same job runs fastest and still fits? (`launch.plan CONFIG --search`)

Re-plans `cfg` for every combination of the layout keys below that the config accepts, on the
same nodes, for the same work: trainer ZeRO stage, expert parallelism (divisors of num_ranks and
of the routed experts), optimizer and parameter offload, and the rollout group's tensor
parallelism (its engines then fill the group's GPUs). Model, data, sequence lengths, batch and
algorithm stay as given. Each row is the planner's memory verdict and step-time estimate, the
same numbers `launch.plan` prints for that layout.

Every layout that fits is listed; `Layout.within(headroom)` says whether it also leaves that
fraction of every budget free (trainer GPU, host RAM and NVMe per node, rollout GPU): the
planner's activation figures are estimates, and a layout at 99% of a GPU is one allocator
detail away from running out of memory. The step estimate leaves out the optimizer step, so
offloading looks free: among equal estimates the layout that offloads less comes first, then
the smaller EP, then the higher ZeRO stage.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from rl.config import Config, ConfigError
from rl.plan.arch import Arch
from rl.plan.memory import GroupPlan, plan_rollout, plan_trainer
from rl.plan.timing import _fmt, estimate

OFFLOAD_RANK = {"none": 0, "cpu": 1, "nvme": 2}


@dataclass(frozen=True, slots=True)
class Layout:
    """One re-planned layout that fits."""
    values: dict[str, Any]
    """Every searched key's value (`candidates`)."""
    changes: dict[str, Any]
    """The keys whose value differs from the searched config ({}: the config itself)."""
    step_s: float
    work_s: float
    """Rollout + train + sync: the step on-policy. With max_staleness >= 1 the rollout hides
    behind training, and among layouts with the same step the one with less work comes first
    (shorter rollouts leave more slack)."""
    use: dict[str, float]
    """Fraction of each budget the layout needs: `trainer GPU`, `host/node`, `NVMe/node` (when
    the trainer needs any), `rollout GPU`."""

    def within(self, headroom: float) -> bool:
        return max(self.use.values()) <= 1 - headroom

    @property
    def overrides(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.changes.items()) or "(this config)"

    def order(self) -> tuple:
        """Sort key: estimated step, then less work (`work_s`), less offload, smaller EP, higher
        ZeRO stage."""
        v = self.values
        offload = (OFFLOAD_RANK[v["trainer.optimizer_offload"]]
                   + (v["trainer.param_offload"] != "none"))
        return (round(self.step_s, 3), round(self.work_s, 3), offload,
                v["trainer.expert_parallel_size"], -v["trainer.zero_stage"])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_values(cfg: Config) -> dict[str, Any]:
    """The searched keys' values in `cfg`."""
    t, r = cfg.trainer, cfg.rollout
    return {"trainer.zero_stage": t.zero_stage,
            "trainer.expert_parallel_size": t.expert_parallel_size,
            "trainer.optimizer_offload": t.optimizer_offload,
            "trainer.param_offload": t.param_offload,
            "rollout.tensor_parallel_size": r.tensor_parallel_size,
            "rollout.num_engines": r.num_engines}


def candidates(cfg: Config, arch: Arch) -> list[dict[str, Any]]:
    """Every combination of the layout keys (the config refuses some, e.g. EP under ZeRO-1 or
    parameter offload under ZeRO-2; `search` skips those)."""
    t, rollout = cfg.trainer, cfg.cluster.rollout
    eps = [d for d in _divisors(t.num_ranks) if arch.num_experts and arch.num_experts % d == 0]
    gpus = rollout.nodes * rollout.gpus_per_node
    out = []
    for stage, ep, opt, param, tp in itertools.product(
            (1, 2, 3), eps or [1], OFFLOAD_RANK, ("none", "cpu"),
            _divisors(rollout.gpus_per_node)):
        out.append({"trainer.zero_stage": stage, "trainer.expert_parallel_size": ep,
                    "trainer.optimizer_offload": opt, "trainer.param_offload": param,
                    "rollout.tensor_parallel_size": tp, "rollout.num_engines": gpus // tp})
    return out


def _apply(cfg: Config, values: dict[str, Any]) -> Config:
    """`cfg` with `values` (`section.key`), each section replaced at once: validation sees the
    final combination, never a half-changed one (ZeRO-1 before EP is set back to 1)."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **kw)
                                       for section, kw in sections.items()})


def _use(trainer: GroupPlan, rollout: GroupPlan) -> dict[str, float]:
    use = {"trainer GPU": trainer.need("gpu") / trainer.gpu_budget,  # type: ignore[operator]  # lint baseline (issue 39)
           "host/node": trainer.need("host") / trainer.host_budget}  # type: ignore[operator]  # lint baseline (issue 39)
    if trainer.nvme_budget and trainer.need("nvme") > 0:
        use["NVMe/node"] = trainer.need("nvme") / trainer.nvme_budget
    use["rollout GPU"] = rollout.need("gpu") / rollout.gpu_budget  # type: ignore[operator]  # lint baseline (issue 39)
    return use


def require_gpus(cfg: Config) -> None:
    """ConfigError for a config without GPUs in both groups (a CPU run has one layout)."""
    if not (cfg.cluster.trainer.gpus_per_node and cfg.cluster.rollout.gpus_per_node):
        raise ConfigError("cluster.trainer/rollout.gpus_per_node: 0; the layout search plans "
                          "GPU jobs (a CPU run has one layout)")


def search(cfg: Config, arch: Arch) -> list[Layout]:
    """Every layout of `cfg` that the config accepts and that fits, fastest first (`order`).
    Raises ConfigError for a config without GPUs (`require_gpus`)."""
    require_gpus(cfg)
    current = layout_values(cfg)
    layouts = []
    for values in candidates(cfg, arch):
        try:
            changed = _apply(cfg, values)
        except ValueError:  # a combination the config refuses (FieldError / ConfigError)
            continue
        trainer, rollout = plan_trainer(changed, arch), plan_rollout(changed, arch)
        if not (trainer.fits and rollout.fits) or rollout.kv is None:
            continue
        changes = {k: v for k, v in values.items() if current[k] != v}
        step = estimate(changed, arch, rollout)
        layouts.append(Layout(values, changes, step.total, step.rollout + step.train + step.sync,
                              _use(trainer, rollout)))
    return sorted(layouts, key=Layout.order)


def report(title: str, layouts: list[Layout], headroom: float) -> tuple[str, Layout | None]:
    """The printed table (fastest first) and the fastest layout within `headroom`, if any."""
    best = next((x for x in layouts if x.within(headroom)), None)
    columns = ["trainer GPU", "host/node", "NVMe/node", "rollout GPU"]
    lines = [f"Layout search for {title}: {len(layouts)} layouts fit; `ok` leaves at least "
             f"{headroom:.0%} of every budget free",
             f"  {'step':>10}  " + "  ".join(f"{c:>11}" for c in columns) + "      layout"]
    for x in layouts:
        cells = "  ".join(f"{x.use[c]:>11.1%}" if c in x.use else f"{'-':>11}" for c in columns)
        lines.append(f"  {_fmt(x.step_s):>10}  {cells}  {'ok' if x.within(headroom) else '  '}  "
                     f"{x.overrides}")
    if best is None:
        lines.append(f"no layout leaves {headroom:.0%} of every budget free")
    else:
        lines.append(f"fastest with {headroom:.0%} free: {best.overrides}, estimated step "
                     f"{_fmt(best.step_s)}")
    return "\n".join(lines), best
