"""Which config changes a resume accepts: the run directory's config.yaml and each checkpoint's
config hash are compared with the new config in every key that changes what the run computes.

`RESUME_KEYS` classifies every config key by what changing it between two lives of a run does:

- `refuse`: it changes what the run computes (the algorithm, the model, the data, the sampling,
  the optimizer, the checkpoint's layout, or floating-point rounding through an engine or kernel
  choice); the resume is refused, `--force` overrides.
- `warm_start`: `sft.*` builds the run's first weights and its KL reference: refused when
  `model.warm_start` is on, ignored otherwise.
- `note`: accepted with a line saying what it changes (thread counts: the floating-point
  rounding, since a requeue may land on other nodes; `eval.*`: what is measured, not what is
  trained).
- `schedule`: `num_steps`; the learning-rate schedule keeps the horizon of the run's start
  (restored from the checkpoint, `rl.trainer.worker.TrainerWorker.load`), so a longer run
  continues at the final rate and a shorter one stops early; noted when the schedule decays.
- `content`: `data.train_path` / `data.eval_path`; compared by content, not by name
  (`rl.data.fingerprint`), so a moved file with the same bytes resumes.
- `ignore`: where the run lives and how it is run (name, cluster, checkpoints, logging, timeouts,
  the weight-sync transport and its checks, the number of reward worker processes).

A key is matched by its longest listed prefix; a key nothing covers is refused.
"""
from __future__ import annotations

import hashlib
import json
import logging

import yaml

from rl.config import MOVED_KEYS, Config, ConfigError, save_config, to_dict

log = logging.getLogger(__name__)

REFUSE, WARM_START, NOTE, SCHEDULE, CONTENT, IGNORE = (
    "refuse", "warm_start", "note", "schedule", "content", "ignore")

RESUME_KEYS: dict[str, str] = {
    # What the run computes.
    **dict.fromkeys(("seed", "model", "data", "reward", "env", "rollout", "trainer",
                     "algorithm", "sync.wire_dtype", "sync.wire_keep_bf16"), REFUSE),
    "sft": WARM_START,
    # The machine's share of the work and what is measured.
    **dict.fromkeys(("trainer.torch_threads", "rollout.torch_threads", "rollout.cpu_kvcache_gb",
                     "eval"), NOTE),
    "num_steps": SCHEDULE,
    **dict.fromkeys(("data.train_path", "data.eval_path"), CONTENT),
    # Where and how the run is run.
    **dict.fromkeys(("name", "output_dir", "cluster", "checkpoint", "logging", "plan",
                     "sft.cache_dir", "trainer.nvme_path", "sync.timeout_s", "sync.bucket_mb",
                     "sync.verify", "sync.backend", "sync.check_logprobs",
                     "sync.check_logprobs_tol", "reward.num_workers", "env.num_workers"), IGNORE),
}

_NOTES = {"eval": "changes what is evaluated, not what is trained",
          "": "may change floating-point rounding, nothing else"}

# What earlier versions ignored: checkpoints they wrote carry a config hash without these keys
# (`resume_hashes` accepts it, so no existing checkpoint is orphaned by the table above).
_LEGACY_IGNORED = ("name", "output_dir", "num_steps", "eval", "logging", "checkpoint", "cluster",
                   "sync.timeout_s", "sync.bucket_mb", "sync.verify", "trainer.torch_threads",
                   "rollout.torch_threads", "rollout.cpu_kvcache_gb", "trainer.nvme_path", "sft",
                   "plan", "reward.num_workers")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _covers(prefix: str, key: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def key_kind(key: str, *flats: dict) -> str:
    """What changing the dotted `key` on resume does (the module docstring). `flats`: the flat
    configs involved; `warm_start` resolves to `refuse` if any has model.warm_start on."""
    prefixes = [p for p in RESUME_KEYS if _covers(p, key)]
    kind = RESUME_KEYS[max(prefixes, key=len)] if prefixes else REFUSE
    if kind == WARM_START:
        kind = REFUSE if any(f.get("model.warm_start", True) for f in flats or ({},)) else IGNORE
    return kind


_ABSENT = object()


def _defaults() -> dict:
    return _flatten(to_dict(Config()))


def _changes(old: dict, new: dict) -> list[tuple[str, object, object, str]]:
    """(key, old, new, kind) of each changed key; a key the old config kept where it used to
    live (`rl.config.MOVED_KEYS`) is compared at its new place. A key the old config lacks (one
    a later version added) is a change only where the new config sets it off its default."""
    a, b = _flatten(old), _flatten(new)
    a = {MOVED_KEYS.get(k, k): v for k, v in a.items()}
    defaults = _defaults()
    return [(k, a.get(k), b.get(k), key_kind(k, a, b)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and not (k not in a and b.get(k) == defaults.get(k, _ABSENT))]


def config_differences(old: dict, new: dict) -> list[str]:
    """`key: old -> new` for each changed key a resume refuses."""
    return [f"{k}: {x!r} -> {y!r}" for k, x, y, kind in _changes(old, new) if kind == REFUSE]


def config_notes(old: dict, new: dict) -> list[str]:
    """One line per accepted change worth saying: `note` keys, and `num_steps` when the learning
    rate decays (the schedule keeps the horizon of the run's start)."""
    out = []
    for k, x, y, kind in _changes(old, new):
        if kind == NOTE:
            why = next(v for p, v in _NOTES.items() if not p or _covers(p, k))
            out.append(f"{k}: {x!r} -> {y!r} ({why})")
        elif kind == SCHEDULE and new.get("trainer", {}).get("lr_schedule") == "cosine":
            out.append(f"{k}: {x!r} -> {y!r} (the cosine learning-rate schedule keeps the horizon "
                       "it had when the run started: past it the rate stays at min_lr_ratio x "
                       "lr; --no-resume starts over with a schedule over the new num_steps)")
    return out


def _hash(cfg: Config, counted) -> str:
    defaults = _defaults()
    flat = _flatten(to_dict(cfg))
    kept = {k: v for k, v in flat.items() if counted(k, flat) and defaults.get(k, _ABSENT) != v}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def resume_hash(cfg: Config) -> str:
    """A checkpoint's config hash: the keys a resume refuses to change, those off their default
    only, so that a config key a later version adds (at its default) does not orphan existing
    checkpoints."""
    return _hash(cfg, lambda k, flat: key_kind(k, flat) == REFUSE)


def resume_hashes(cfg: Config) -> set[str]:
    """The hashes a checkpoint of `cfg`'s run may carry: `resume_hash`, and the one versions
    before `RESUME_KEYS` wrote."""
    legacy = _hash(cfg, lambda k, flat: not any(_covers(p, k) for p in _LEGACY_IGNORED))
    return {resume_hash(cfg), legacy}


def check_and_save_config(cfg: Config, resume: bool, force: bool) -> None:
    """Refuse (ConfigError) to resume a run directory whose config.yaml differs in keys that
    matter, or whose data changed since it started (`rl.data.fingerprint`), unless `force`; log
    the accepted changes worth a note; then write `cfg` and the data's fingerprint there."""
    from rl.data.fingerprint import check_fingerprint, write_fingerprint
    saved = cfg.run_dir / "config.yaml"
    if saved.exists() and resume:
        old, new = yaml.safe_load(saved.read_text()), to_dict(cfg)
        diffs = config_differences(old, new)
        if diffs and not force:
            raise ConfigError(f"{saved}: this run directory holds a run with a different config "
                              f"({'; '.join(diffs)}); use a new name or pass --force")
        if diffs:
            log.warning("resuming despite config differences (--force): %s", "; ".join(diffs))
        for note in config_notes(old, new):
            log.warning("resuming with a changed setting: %s", note)
        if changed := check_fingerprint(cfg, force):
            log.warning("resuming despite data changes (--force): %s", "; ".join(changed))
    save_config(cfg, saved)
    write_fingerprint(cfg)
