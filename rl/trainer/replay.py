"""Routing replay on a trainer rank (`algorithm.routing_replay`).

- `r3`: the old-policy pass and every update pass replay the rollout engine's routing
  (`Micro.routing`, rows the engine reported; the last token and padding keep their own).
- `r2`: the old-policy pass records the trainer's own routing; the update passes replay it, so
  the PPO ratio compares the same sub-network while the weights move.

Statistics (rank-local sums; the worker reduces them over ranks):
- r3: `routing_agree` / `routing_total` (the trainer's own choice vs the engine's, old pass), and
  the same old pass without replay for comparison: `noreplay_tis_ratio_*` and the mean
  |logp_trainer - logp_rollout| with and without replay (`rollout_logp_absdiff`,
  `noreplay_rollout_logp_absdiff`). That comparison costs one extra forward per micro-batch.
- r2: the update passes' own choice vs the recorded one.
"""
from __future__ import annotations

import contextlib

import torch

from rl.models.routing import RoutingReplay
from rl.trainer import losses


class TrainerReplay:
    def __init__(self, model: torch.nn.Module, mode: str, tis_cap: float | None):
        self.mode = mode
        self.tis_cap = tis_cap
        self.routers = RoutingReplay(model)
        self._recorded: dict[int, torch.Tensor] = {}
        self.sums: dict[str, float] = {}

    def reset(self) -> None:
        self._recorded.clear()
        self.sums = {}

    def _add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def old_pass(self, forward, mb) -> torch.Tensor:
        """The old-policy log-probs of `mb` (`forward()` runs the model), under this mode."""
        if self.mode == "r2":
            with self.routers.capture() as cap:
                logp = forward()
            self._recorded[id(mb)] = self.routers.recorded_BLNK(cap, tuple(mb.input_ids.shape))
            return logp
        if mb.routing is None:
            raise ValueError("routing_replay r3: the batch carries no routing (the rollout "
                             "engine did not return it)")
        own = forward()  # the trainer's own routing: the comparison the metrics report
        with self.routers.capture(mb.routing, mb.routing_mask) as cap:
            logp = forward()
        if mb.weight > 0:
            self._add("routing_agree", cap.agree)
            self._add("routing_total", cap.total)
            mask = mb.train_mask[:, 1:].to(logp.device).bool()
            rollout = mb.rollout_logp[:, 1:].to(logp.device)
            tokens = float(mask.sum())
            self._add("tokens", tokens)
            self._add("rollout_logp_absdiff", float((logp - rollout).abs()[mask].sum()))
            self._add("noreplay_rollout_logp_absdiff", float((own - rollout).abs()[mask].sum()))
            if self.tis_cap is not None:
                _, st = losses.tis_weights(own, rollout, self.tis_cap, mask)
                for k in ("tis_ratio_mean", "tis_capped_frac"):
                    self._add("noreplay_" + k, float(st[k]) * tokens)
        return logp

    def update_pass(self, mb):
        """Context for an update pass over `mb` (replays what `old_pass` chose to replay)."""
        if self.mode == "r2":
            return self._counted(self.routers.capture(self._recorded[id(mb)], None), mb)
        return self.routers.capture(mb.routing, mb.routing_mask)

    @contextlib.contextmanager
    def _counted(self, ctx, mb):
        with ctx as cap:
            yield cap
        if mb.weight > 0:
            self._add("routing_agree", cap.agree)
            self._add("routing_total", cap.total)

    def stats(self) -> dict[str, float]:
        """Rank-local statistics for the worker to reduce: sums, then ratios."""
        s = self.sums
        out = {"routing_agree": s.get("routing_agree", 0.0),
               "routing_total": s.get("routing_total", 0.0)}
        if self.mode == "r3":
            for k in ("tokens", "rollout_logp_absdiff", "noreplay_rollout_logp_absdiff",
                      "noreplay_tis_ratio_mean", "noreplay_tis_capped_frac"):
                out[k] = s.get(k, 0.0)
        return out


def reduce_stats(sums: dict[str, float], mode: str) -> dict[str, float]:
    """Metrics from statistics summed over ranks."""
    agree = sums["routing_agree"] / max(sums["routing_total"], 1.0)
    if mode == "r2":
        return {"train/routing_agreement": agree}
    tokens = max(sums["tokens"], 1.0)
    out = {"rollout/routing_agreement": agree,
           "train/rollout_logp_absdiff": sums["rollout_logp_absdiff"] / tokens,
           "train/noreplay_rollout_logp_absdiff": sums["noreplay_rollout_logp_absdiff"] / tokens}
    if "noreplay_tis_ratio_mean" in sums and sums["noreplay_tis_ratio_mean"]:
        out["train/noreplay_tis_ratio_mean"] = sums["noreplay_tis_ratio_mean"] / tokens
        out["train/noreplay_tis_capped_frac"] = sums["noreplay_tis_capped_frac"] / tokens
    return out
