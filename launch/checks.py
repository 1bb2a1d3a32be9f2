"""Checks `launch.submit` makes on the submitting host before anything starts (no Ray, no engine,
no allocation): the Slurm options, the run directory's config on resume, and the data files.

Each failure is one line on stderr and exit status 2 (`launch.common.fail`). The job repeats the
resume check (`rl.resume.check_and_save_config`) as a safety net; the data it reads is the same.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from launch.common import fail, quiet_libraries
from rl.config import Config, ConfigError, to_dict


def check_slurm_params_or_exit(cfg: Config) -> None:
    """Exit 2 when `cluster.slurm_params` holds a key that the job's executor would refuse,
    listing the valid ones (`slurm.params.validate_slurm_params`, which `slurm.executor` uses).
    Only for `cluster.kind: slurm`; a local run ignores these options."""
    if cfg.cluster.kind != "slurm":
        return
    from slurm.params import SlurmParamError, validate_slurm_params
    try:
        validate_slurm_params(cfg.cluster.slurm_params)
    except SlurmParamError as e:
        fail(f"config error: cluster.slurm_params: {e}")


def check_resume_or_exit(cfg: Config, force: bool) -> None:
    """Exit 2 when RUN_DIR/config.yaml holds a config that differs from `cfg` in keys that matter
    (`rl.resume.RESUME_IGNORED` lists those that do not). `force`: resume anyway."""
    saved = cfg.run_dir / "config.yaml"
    if not saved.is_file():
        return
    from rl.resume import config_differences
    try:
        old = yaml.safe_load(saved.read_text())
    except (OSError, yaml.YAMLError) as e:
        fail(f"config error: {saved}: cannot read the saved config ({e}); pass --no-resume to "
             "start over")
    if not isinstance(old, dict):
        fail(f"config error: {saved}: expected a mapping, got {type(old).__name__}; pass "
             "--no-resume to start over")
    diffs = config_differences(old, to_dict(cfg))
    if diffs and force:
        print(f"resuming despite config differences (--force): {'; '.join(diffs)}", flush=True)
    elif diffs:
        fail(f"config error: {saved}: refusing to resume, the config differs in {len(diffs)} "
             f"key(s) that matter: {'; '.join(diffs)} (pass --force to resume anyway, "
             "--no-resume to start over, or use another name)")


def check_data_or_exit(cfg: Config) -> None:
    """Read every row of both splits as the job will (`rl.data.build_datasets`) and, for a file
    source, measure each prompt with the run's tokenizer when it is at hand; exit 2 on the
    first problem, naming `file:line`."""
    from rl.data import DataError, build_datasets
    try:
        train, evals = build_datasets(cfg.data, cfg.seed)
        if cfg.data.source == "file":
            _check_prompt_lengths(cfg, train + evals)
    except DataError as e:
        hint = " (pass --no-data-check if only the job's nodes can read it)" if str(e).endswith(
            ": no such file") else ""
        fail(f"data error: {e}{hint}")
    except ConfigError as e:
        fail(f"config error: {e}")


def _check_prompt_lengths(cfg: Config, examples) -> None:
    """DataError naming the first prompt longer than data.max_prompt_tokens (the job would keep
    only its last tokens). Skipped when the tokenizer is not on this machine."""
    tokenizer = _tokenizer(cfg)
    if tokenizer is None:
        return
    from rl.data import DataError
    from rl.data.datasets import prompt_ids
    # A prompt must also leave the engine room for one generated token (vLLM refuses it
    # otherwise, inside the job): the binding limit is the smaller of the two.
    room = cfg.rollout.max_model_len - 1
    limit = min(cfg.data.max_prompt_tokens, room)
    lengths = [(ex, len(prompt_ids(ex, tokenizer, cfg.data))) for ex in examples]
    too_long = [(ex, n) for ex, n in lengths if n > limit]
    if too_long:
        ex, n = too_long[0]
        more = f" ({len(too_long) - 1} more prompts are too long)" if len(too_long) > 1 else ""
        what = (f"data.max_prompt_tokens ({limit})" if limit == cfg.data.max_prompt_tokens else
                f"rollout.max_model_len - 1 ({limit}: one generated token must fit)")
        raise DataError(f"{ex.meta['source']}: prompt is {n} tokens with the run's tokenizer, "
                        f"expected at most {what}{more}; raise data.max_prompt_tokens and "
                        "rollout.max_model_len, or shorten the prompt")
    longest = max((n for _, n in lengths), default=0)
    if longest + cfg.rollout.max_new_tokens > cfg.rollout.max_model_len:
        print(f"note: the longest prompt ({longest} tokens) + rollout.max_new_tokens "
              f"({cfg.rollout.max_new_tokens}) exceeds rollout.max_model_len "
              f"({cfg.rollout.max_model_len}): its responses end early (finish reason 'length')",
              flush=True)


def _tokenizer(cfg: Config):
    """The run's tokenizer when it is cheap to get: the presets' character tokenizer (the SFT
    warm start saves the same one), or `model.path`'s when that directory is here; else None."""
    quiet_libraries()  # transformers warns about every prompt longer than model_max_length
    if cfg.model.path is None:
        from rl.models.tokenizer import build_char_tokenizer
        return build_char_tokenizer()
    if not (Path(cfg.model.path) / "config.json").is_file():
        return None
    from rl.models.loading import load_tokenizer
    return load_tokenizer(Path(cfg.model.path))
