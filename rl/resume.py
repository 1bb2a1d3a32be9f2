"""Which config changes a resume accepts: the run directory's config.yaml and each checkpoint's
config hash are compared with the new config in every key that changes what the run computes."""
from __future__ import annotations

import hashlib
import json
import logging

import yaml

from rl.config import MOVED_KEYS, Config, ConfigError, save_config, to_dict

log = logging.getLogger(__name__)

# Keys that may change between a run and its resume without changing what it computes.
RESUME_IGNORED = ("name", "output_dir", "num_steps", "eval", "logging", "checkpoint", "cluster",
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


def _ignored(key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in RESUME_IGNORED)


_ABSENT = object()


def _defaults() -> dict:
    return _flatten(to_dict(Config()))


def config_differences(old: dict, new: dict) -> list[str]:
    """`key: old -> new` for each key that matters; a key the old config kept where it used to
    live (`rl.config.MOVED_KEYS`) is compared at its new place. A key the old config lacks (one a
    later version added) is a difference only where the new config sets it off its default."""
    a, b = _flatten(old), _flatten(new)
    a = {MOVED_KEYS.get(k, k): v for k, v in a.items()}
    defaults = _defaults()
    keys = sorted(set(a) | set(b))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys
            if a.get(k) != b.get(k) and not _ignored(k)
            and not (k not in a and b.get(k) == defaults.get(k, _ABSENT))]


def resume_hash(cfg: Config) -> str:
    """A checkpoint's config hash: the keys that matter, those off their default only, so that a
    config key a later version adds (at its default) does not orphan existing checkpoints."""
    defaults = _defaults()
    flat = {k: v for k, v in _flatten(to_dict(cfg)).items()
            if not _ignored(k) and defaults.get(k, _ABSENT) != v}
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_and_save_config(cfg: Config, resume: bool, force: bool) -> None:
    """Refuse (ConfigError) to resume a run directory whose config.yaml differs in keys that
    matter, unless `force`; then write `cfg` there."""
    saved = cfg.run_dir / "config.yaml"
    if saved.exists() and resume:
        diffs = config_differences(yaml.safe_load(saved.read_text()), to_dict(cfg))
        if diffs and not force:
            raise ConfigError(f"{saved}: this run directory holds a run with a different config "
                              f"({'; '.join(diffs)}); use a new name or pass --force")
        if diffs:
            log.warning("resuming despite config differences (--force): %s", "; ".join(diffs))
    save_config(cfg, saved)
