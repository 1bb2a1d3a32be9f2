"""Verdicts, suggestions and the printed report.

Suggestions are not rules of thumb: each one is the planner re-run on a changed copy of the
config (`with_changes`), so the numbers it quotes are the ones `launch.plan` would print.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rl.config import Config
from rl.plan.arch import Arch
from rl.plan.memory import (
    GiB, GroupPlan, Line, line_gpu, plan_rollout, plan_trainer, sequence_length, size,
)
from rl.plan.timing import StepTime, estimate

MAX_EXTRA_NODES = 8  # how far the "more nodes" suggestion searches


@dataclass(frozen=True, slots=True)
class PlanVerdict:
    """What `rl.plan.check` returns. `fits`: both groups fit; `report`: the full text."""
    fits: bool
    report: str
    trainer: GroupPlan
    rollout: GroupPlan
    arch: Arch
    time: StepTime | None = None
    """The step-time estimate (rl/plan/timing.py); None for CPU runs."""


def with_changes(cfg: Config, changes: dict[str, Any]) -> Config:
    """A copy of `cfg` with dotted keys replaced (`{"trainer.zero_stage": 3}`), re-validated."""
    def put(obj: Any, parts: list[str], value: Any) -> Any:
        inner = value if len(parts) == 1 else put(getattr(obj, parts[0]), parts[1:], value)
        return dataclasses.replace(obj, **{parts[0]: inner})
    for key, value in changes.items():
        cfg = put(cfg, key.split("."), value)
    return cfg


def _fmt_value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _changes_text(changes: dict[str, Any]) -> str:
    return " ".join(f"{k}={_fmt_value(v)}" for k, v in changes.items())


def _summary(g: GroupPlan) -> str:
    parts = []
    for where, budget, unit in (("gpu", g.gpu_budget, "GPU"), ("host", g.host_budget, "host/node"),
                                ("nvme", g.nvme_budget, "NVMe/node")):
        need = g.need(where)
        if budget is not None and (need > 0 or where == "gpu"):
            parts.append(f"{unit} {size(need)} of {size(budget)}")
    return ", ".join(parts) + (" (fits)" if g.fits else " (does not fit)")


def _ladder(cfg: Config, arch: Arch, plan: Callable[[Config, Arch], GroupPlan],
            steps: list[dict[str, Any]]) -> list[str]:
    """Apply `steps` one after another; report each, stop at the first that fits."""
    out, current = [], cfg
    for i, step in enumerate(steps, 1):
        try:
            current = with_changes(current, step)
        except ValueError:  # a combination the config rejects: skip it
            continue
        g = plan(current, arch)
        out.append(f"  {i}. {'+ ' if i > 1 else ''}{_changes_text(step)}  ->  {_summary(g)}")
        if g.fits:
            break
    return out


def _more_nodes(cfg: Config, arch: Arch, group: str) -> str | None:
    cl = getattr(cfg.cluster, group)
    if cl.gpus_per_node == 0:
        return None
    for nodes in range(cl.nodes + 1, cl.nodes + MAX_EXTRA_NODES + 1):
        if group == "trainer":
            if nodes * cl.gpus_per_node % cfg.trainer.expert_parallel_size:
                continue  # the config refuses ranks that EP groups do not divide
            ch = {"cluster.trainer.nodes": nodes, "trainer.num_ranks": nodes * cl.gpus_per_node}
            g = plan_trainer(with_changes(cfg, ch), arch)
        else:
            engines = nodes * cl.gpus_per_node // cfg.rollout.tensor_parallel_size
            ch = {"cluster.rollout.nodes": nodes, "rollout.num_engines": engines}
            g = plan_rollout(with_changes(cfg, ch), arch)
        if g.fits:
            return f"  or more nodes: {_changes_text(ch)}  ->  {_summary(g)}"
    return None


def _shorter_sequences(cfg: Config, arch: Arch, plan: Callable[[Config, Arch], GroupPlan]
                       ) -> str | None:
    """The longest power-of-two response length that fits, with everything else unchanged."""
    prompt = cfg.data.max_prompt_tokens
    for k in range(20, 7, -1):
        new = 2 ** k
        if new >= cfg.rollout.max_new_tokens:
            continue
        ch = {"rollout.max_new_tokens": new, "rollout.max_model_len": prompt + new}
        g = plan(with_changes(cfg, ch), arch)
        if g.fits:
            return f"  or shorter sequences: {_changes_text(ch)}  ->  {_summary(g)}"
    return None


def trainer_suggestions(cfg: Config, arch: Arch, g: GroupPlan) -> list[str]:
    if g.fits:
        return []
    t = cfg.trainer
    steps: list[dict[str, Any]] = []
    if t.zero_stage < 3:
        steps.append({"trainer.zero_stage": 3})
    if not t.activation_checkpointing:
        steps.append({"trainer.activation_checkpointing": True})
    if t.micro_batch_tokens > sequence_length(cfg):
        steps.append({"trainer.micro_batch_tokens": sequence_length(cfg)})
    if t.optimizer_offload == "none":
        steps.append({"trainer.optimizer_offload": "cpu"})
    if t.param_offload == "none":
        steps.append({"trainer.param_offload": "cpu"})
    out = _ladder(cfg, arch, plan_trainer, steps)
    last = with_changes(cfg, {k: v for s in steps for k, v in s.items()}) if steps else cfg
    final = plan_trainer(last, arch)
    host_over = final.host_budget is not None and final.need("host") > final.host_budget
    if not final.fits and last.trainer.optimizer_offload == "cpu" and host_over:
        nvme = plan_trainer(with_changes(last, {"trainer.optimizer_offload": "nvme"}), arch)
        hint = "" if cfg.plan.nvme_gb else f" (needs plan.nvme_gb >= {nvme.need('nvme') / GiB:,.0f})"
        out.append(f"  or instead of host RAM: trainer.optimizer_offload=nvme{hint}  ->  "
                   f"{_summary(nvme)}")
    if any(ln.label.startswith("activations: eager") for ln in g.lines):
        fused = plan_trainer(with_changes(cfg, {"trainer.attention_kernel": "fused"}), arch)
        out.append(f"  the eager attention scores alone need {size(line_gpu(g, 'activations: eager'))}; "
                   "a fused attention kernel in the trainer (then trainer.attention_kernel=fused)"
                   "  ->  "
                   f"{_summary(fused)}")
    extras = (_shorter_sequences(cfg, arch, plan_trainer), _more_nodes(cfg, arch, "trainer"))
    out += [e for e in extras if e]
    if cfg.algorithm.kl_coef > 0:
        out.append("  the reference model (algorithm.kl_coef > 0) is a full unpartitioned copy per "
                   "GPU: algorithm.kl_coef=0 removes it")
    return out


def rollout_suggestions(cfg: Config, arch: Arch, g: GroupPlan) -> list[str]:
    r, cl = cfg.rollout, cfg.cluster.rollout
    batch = cfg.algorithm.prompts_per_step * r.n_samples
    if cl.gpus_per_node == 0 or (g.fits and g.concurrent * r.num_engines >= batch):
        return []
    out: list[str] = []
    if not g.fits:
        steps: list[dict[str, Any]] = []
        if r.quantization == "none":
            steps.append({"rollout.quantization": "fp8"})
        if r.tensor_parallel_size < cl.gpus_per_node:
            tp = cl.gpus_per_node
            steps.append({"rollout.tensor_parallel_size": tp,
                          "rollout.num_engines": max(cl.nodes * cl.gpus_per_node // tp, 1)})
        out += _ladder(cfg, arch, plan_rollout, steps)
        extras = (_shorter_sequences(cfg, arch, plan_rollout), _more_nodes(cfg, arch, "rollout"))
        out += [e for e in extras if e]
        return out
    waves = math.ceil(batch / (g.concurrent * r.num_engines))
    out.append(f"  fits, but a step's {batch:,} sequences need {waves} waves at full context")
    if r.quantization == "none":
        fp8 = plan_rollout(with_changes(cfg, {"rollout.quantization": "fp8"}), arch)
        held = fp8.concurrent * r.num_engines
        out.append(f"  rollout.quantization=fp8  ->  {held:,} concurrent sequences "
                   f"({math.ceil(batch / max(held, 1))} wave(s))")
    engines = math.ceil(batch / g.concurrent)
    nodes = math.ceil(engines * r.tensor_parallel_size / cl.gpus_per_node)
    if nodes > cl.nodes:
        out.append(f"  one wave: cluster.rollout.nodes={nodes} rollout.num_engines="
                   f"{nodes * cl.gpus_per_node // r.tensor_parallel_size}")
    return out


def _table(g: GroupPlan) -> list[str]:
    cols = [("gpu", "per GPU")] if g.gpu_budget is not None else []
    cols += [(w, h) for w, h in (("host", "host/node"), ("nvme", "NVMe/node"))
             if any(getattr(ln, w) for ln in g.lines)]
    width = max(len(ln.label) for ln in g.lines + [Line("peak")]) + 2
    rows = [f"    {'':<{width}}" + "".join(f"{h:>13}" for _, h in cols) + "   when"]
    for ln in g.lines:
        vals = "".join(f"{size(getattr(ln, w)) if getattr(ln, w) else '-':>13}" for w, _ in cols)
        rows.append(f"    {ln.label:<{width}}{vals}   {ln.phase}")
    rows.append(f"    {'peak':<{width}}"
                + "".join(f"{size(g.need(w)):>13}" for w, _ in cols))
    budgets = {"gpu": g.gpu_budget, "host": g.host_budget, "nvme": g.nvme_budget}
    rows.append(f"    {'budget':<{width}}" + "".join(
        f"{size(budgets[w]) if budgets[w] is not None else 'n/a':>13}" for w, _ in cols))  # type: ignore[arg-type]  # lint baseline (issue 39)
    return rows


def format_group(title: str, g: GroupPlan) -> list[str]:
    out = [f"{title}: " + g.header[0]] + [f"  {h}" for h in g.header[1:]]
    out += _table(g)
    out += [f"  {n}" for n in g.notes]
    problems = g.problems + g.overruns()
    if g.fits:
        used = [f"{size(g.need('gpu'))} of {size(g.gpu_budget)} per GPU "
                f"({100 * g.need('gpu') / g.gpu_budget:.0f}%)"] if g.gpu_budget else []
        used += [f"{size(g.need(w))} of {size(b)} {u}" for w, b, u in
                 (("host", g.host_budget, "host RAM per node"),
                  ("nvme", g.nvme_budget, "NVMe per node")) if b is not None and g.need(w) > 0]
        out.append("  verdict: FITS" + (f" - {'; '.join(used)}" if used else ""))
    else:
        out.append("  verdict: DOES NOT FIT - " + "; ".join(problems))
    return out


def count(n: float) -> str:
    """`284.33B`, `1.81M` parameters."""
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.2f}M"


def model_line(arch: Arch) -> str:
    moe = (f", {arch.num_experts} routed experts top-{arch.top_k}" if arch.num_experts else "")
    return (f"model: {arch.model_type} ({arch.source}): {count(arch.total_params)} parameters, "
            f"{count(arch.active_params)} active per token (without the input embedding); "
            f"{arch.num_layers} layers, hidden {arch.hidden}{moe}")


def build(cfg: Config, arch: Arch, title: str, notes: list[str]) -> PlanVerdict:
    trainer, rollout = plan_trainer(cfg, arch), plan_rollout(cfg, arch)
    lines = [f"Memory plan for {title}", model_line(arch)]
    lines += [f"  {n}" for n in (*notes, *arch.notes)]
    lines += [""] + format_group("Trainer", trainer) + [""] + format_group("Rollout", rollout)
    tips = trainer_suggestions(cfg, arch, trainer)
    if tips:
        lines += ["", "Suggestions (trainer), each step re-planned:"] + tips
    tips = rollout_suggestions(cfg, arch, rollout)
    if tips:
        lines += ["", "Suggestions (rollout):"] + tips
    fits = trainer.fits and rollout.fits
    verdict = ("FITS" if fits else "DOES NOT FIT: " + ", ".join(
        g.name for g in (trainer, rollout) if not g.fits))
    time = None
    if cfg.cluster.trainer.gpus_per_node > 0 and rollout.kv is not None:
        time = estimate(cfg, arch, rollout)
        lines += ["", "Step time estimate (rl/plan/timing.py; validated in "
                  "bench/results/plan_time.md):"] + [f"  {ln}" for ln in time.lines]
    lines += ["", f"Verdict: {verdict}"]
    return PlanVerdict(fits, "\n".join(lines), trainer, rollout, arch, time)
