"""Find the model's config.json for planning (never weights).

Order: `plan.model_config` if set; `model.path/config.json` if that exists on this machine; the
config shipped in `rl/plan/known/` for a known model whose directory name matches
`model.path`'s last component (a cluster path like `/shared/models/DeepSeek-V4-Flash` can be
planned on a laptop); for a preset, its built directory, else the preset's config (this one
imports transformers: seconds, fine for the tiny CPU presets).
"""
from __future__ import annotations

import json
from pathlib import Path

from rl.config import Config, ConfigError

KNOWN_DIR = Path(__file__).parent / "known"
PRESET_ROOT = Path("checkpoints/models")
_SUFFIXES = ("-base", "-instruct", "-bf16")


def known_models() -> dict[str, Path]:
    """Lower-cased model name -> shipped config.json (published configs, see tests/fixtures)."""
    return {p.stem.lower(): p for p in sorted(KNOWN_DIR.glob("*.json"))}


def known_name(path: str) -> str | None:
    """The known model a directory name refers to (`.../DeepSeek-V4-Flash-Base` -> deepseek-v4-flash)."""
    name = Path(path.rstrip("/")).name.lower()
    candidates = [name] + [name[: -len(s)] for s in _SUFFIXES if name.endswith(s)]
    return next((c for c in candidates if c in known_models()), None)


def _read(path: Path, key: str) -> dict:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {str(path)!r} ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}: {str(path)!r} is not valid JSON (line {e.lineno}: {e.msg})") from None


def model_config(cfg: Config) -> tuple[dict, str, list[str]]:
    """(config dict, where it came from, notes). Raises ConfigError naming the key to fix."""
    if cfg.plan.model_config is not None:
        path = Path(cfg.plan.model_config)
        return _read(path, "plan.model_config"), str(path), []
    if cfg.model.path is not None:
        local = Path(cfg.model.path) / "config.json"
        if local.is_file():
            return _read(local, "model.path"), str(local), []
        name = known_name(cfg.model.path)
        if name is None:
            raise ConfigError(
                f"model.path: {cfg.model.path!r} has no config.json on this machine and is not a "
                f"known model ({', '.join(known_models())}); set plan.model_config to a config.json")
        shipped = known_models()[name]
        return _read(shipped, "model.path"), f"known:{shipped.stem}", [
            f"{cfg.model.path}/config.json is not on this machine: planned with the published "
            f"config of {shipped.stem} (rl/plan/known/{shipped.name})"]
    from rl.models.presets import padded_vocab_size, preset_config, preset_dir_name
    from rl.models.tokenizer import build_char_tokenizer
    built = PRESET_ROOT / preset_dir_name(cfg.model.preset, cfg.model.seed) / "config.json"  # type: ignore[arg-type]  # lint baseline (issue 39)
    if built.is_file():
        return _read(built, "model.preset"), str(built), []
    config = preset_config(cfg.model.preset, padded_vocab_size(len(build_char_tokenizer())))  # type: ignore[arg-type]  # lint baseline (issue 39)
    return config.to_dict(), f"preset:{cfg.model.preset}", []
