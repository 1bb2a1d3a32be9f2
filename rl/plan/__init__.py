"""Memory planner: will this config fit on its GPUs? Decided from config.json alone.

`check(cfg)` plans the trainer group (DeepSpeed ZeRO stages, offload, activations) and the
rollout group (FP8 / BF16 weights under tensor parallelism, KV-cache room in tokens and
sequences) and returns a `PlanVerdict` (`.fits`, `.report`). `python -m launch.plan CONFIG`
prints the report; `launch.submit` refuses a Slurm job that does not fit.

Modules: `arch` (parameter tensors by formula per architecture), `kv` (KV bytes per token),
`activations`, `memory` (per-GPU / per-node tables), `report` (verdicts, suggestions), `source`
(where config.json comes from). No torch or transformers import: a 284B plan takes milliseconds.
"""
from __future__ import annotations

from rl.config import Config
from rl.plan.report import PlanVerdict

__all__ = ["PlanVerdict", "check"]


def check(cfg: Config, title: str = "config") -> PlanVerdict:
    """Plan `cfg`. Raises ConfigError when the model's config.json cannot be found or parsed."""
    from rl.plan import arch, report, source
    config, where, notes = source.model_config(cfg)
    return report.build(cfg, arch.parse(config, where), title, notes)
