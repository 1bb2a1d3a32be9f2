"""SFT warm start: teach the tiny preset the synthetic task's format so RL has signal.

Deliberately simple: one process, plain AdamW, teacher forcing on `<bos> prompt answer <eos>` with
the loss on the answer and EOS only. The result is cached under `sft.cache_dir`, keyed by
everything that determines it, and reused by later runs (the RL loop starts from it when
`model.warm_start` is true).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import shutil
import time
import uuid
from pathlib import Path

import torch

from rl.config import Config, to_dict
from rl.console import say
from rl.data.datasets import build_datasets, encode_prompt
from rl.models.loading import DEFAULT_CACHE_ROOT, load_model, load_tokenizer, resolve_model_dir
from rl.models.presets import preset_dir_name, save_model

log = logging.getLogger(__name__)

_ABSENT = object()
# {data key: its default}: keys DataConfig gained after the cache key's format 1.
_ADDED_DATA_KEYS = {"prompt_format": "auto",
                    "deepseek_v4": {"thinking": True, "reasoning_effort": "high"}}
# {sft key: its default}: likewise for SftConfig.
_ADDED_SFT_KEYS = {"target_accuracy": None, "check_every": 10, "check_examples": 256,
                   "target_field": None}


def _sft_dir(config: dict) -> Path:
    """`sft_dir` of a resolved config as a dict (`to_dict(cfg)`, or a run's config.yaml)."""
    model, sft = config["model"], config["sft"]
    if model.get("path") is None:
        # A preset's directory name carries its fields' fingerprint: a changed preset is a new key.
        name, base = model["preset"], preset_dir_name(model["preset"], model["seed"])
    else:
        name, base = Path(model["path"]).name, None
    # Data keys added after format 1 enter the key only off their defaults, so that cached warm
    # starts of configs that do not use them stay valid.
    data = {k: v for k, v in config["data"].items() if _ADDED_DATA_KEYS.get(k, _ABSENT) != v}
    sft = {k: v for k, v in sft.items()
           if k != "cache_dir" and _ADDED_SFT_KEYS.get(k, _ABSENT) != v}
    blob = json.dumps({"model": model, "data": data, "sft": sft,
                       "seed": config["seed"], "format": 1, "preset_dir": base}, sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return Path(config["sft"]["cache_dir"]) / f"{name}-{digest}"


def sft_dir(cfg: Config) -> Path:
    return _sft_dir(to_dict(cfg))


def run_model_dir(config: dict) -> Path:
    """The model directory a run started from, from its resolved config as a dict (RUN_DIR/
    config.yaml), without building anything: what `warm_start_dir` returned for that run.
    Relative paths are relative to the directory the run was started from."""
    model = config["model"]
    if model.get("warm_start"):
        return _sft_dir(config)
    if model.get("path") is not None:
        return Path(model["path"])
    return DEFAULT_CACHE_ROOT / preset_dir_name(model["preset"], model["seed"])


def find_run_model_dir(run_dir: Path, holds: str = "") -> tuple[Path | None, Path | None]:
    """(named, found): the model directory RUN_DIR/config.yaml names (`run_model_dir`; None
    when config.yaml is missing or unreadable) and where it is. A relative path is relative to
    the directory the run was started from: tried from the current directory, then from each
    directory above RUN_DIR. `found` is the first candidate that exists (and holds the file
    `holds`, when given), None when there is none."""
    saved = Path(run_dir) / "config.yaml"
    if not saved.is_file():
        return None, None
    import yaml
    try:
        named = run_model_dir(yaml.safe_load(saved.read_text()))
    except (yaml.YAMLError, KeyError, TypeError, AttributeError):
        return None, None
    bases = [Path()] if named.is_absolute() else [Path.cwd(), *Path(run_dir).resolve().parents]
    for base in bases:
        candidate = base / named
        if (candidate / holds).is_file() if holds else candidate.is_dir():
            return named, candidate
    return named, None


def warm_start_dir(cfg: Config) -> Path:
    """The model directory RL starts from (the SFT result when `model.warm_start`)."""
    if not cfg.model.warm_start:
        return resolve_model_dir(cfg.model)
    out = sft_dir(cfg)
    if (out / "config.json").is_file():
        say(f"SFT warm start: reusing {out} ({_cached_accuracy(out)})")
        return out
    run_sft(cfg)
    return out


def _cached_accuracy(out: Path) -> str:
    try:
        return f"greedy eval accuracy {json.loads((out / 'sft.json').read_text())['eval_accuracy']:.3f}"
    except (OSError, ValueError, KeyError, TypeError):
        return "accuracy not recorded"


def _encode(tok, cfg: Config, examples) -> list[tuple[list[int], list[int]]]:
    out, field = [], cfg.sft.target_field
    for ex in examples:
        target = ex.meta.get(field, ex.answer) if field is not None else ex.answer
        answer = tok(str(target), add_special_tokens=False)["input_ids"]
        out.append((encode_prompt(ex, tok, cfg.data), answer + [tok.eos_token_id]))
    return out


@torch.no_grad()
def greedy_accuracy(model, tok, cfg: Config, examples, max_new_tokens: int, batch_size: int = 256,
                    rewards=None) -> float:
    """Greedy pass@1, scored by the run's reward rules: `rewards`, a `RewardComputer(cfg.reward)`
    (None: one for this call, its workers ended after it)."""
    from rl.rewards.computer import RewardComputer
    from rl.rollout.base import cut_at_stop, decode_response
    if rewards is None:
        with RewardComputer(cfg.reward) as rewards:
            return greedy_accuracy(model, tok, cfg, examples, max_new_tokens, batch_size, rewards)
    model.eval()
    correct = 0.0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        prompts = [p for p, _ in _encode(tok, cfg, chunk)]
        width = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
        # As the engines decode (reasoning markers kept), each row up to its first EOS.
        texts = [decode_response(tok, *cut_at_stop(row, {tok.eos_token_id}))
                 for row in out[:, width:].tolist()]
        correct += sum(c >= 1.0 for c in rewards.score(texts, chunk).correctness)
    return correct / max(len(examples), 1)


def run_sft(cfg: Config) -> tuple[Path, float]:
    """Train, evaluate, save atomically into `sft_dir(cfg)`; returns (dir, greedy eval accuracy)."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(f"sft:{cfg.seed}")
    base = resolve_model_dir(cfg.model)
    tok = load_tokenizer(base)
    model = load_model(base, torch.float32).train()
    train, evals = build_datasets(cfg.data, cfg.seed)
    data = _encode(tok, cfg, train)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr, weight_decay=0.0)
    s = cfg.sft

    def lr_at(step: int) -> float:
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (step - s.warmup_steps) / max(s.steps - s.warmup_steps, 1)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    until = "" if s.target_accuracy is None else (
        f" (or until {s.target_accuracy:.2f} greedy accuracy on {len(train[:s.check_examples])} "
        f"training problems, checked every {s.check_every})")
    say(f"SFT warm start: training {s.steps} steps{until} x {s.batch_size} examples on "
        f"{len(train)} prompts (model {base}); cached for later runs")
    t0 = time.perf_counter()
    from rl.rewards.computer import RewardComputer, protected_paths
    # The reward workers for every check (ended below; on an exception, when it is collected).
    rewards = RewardComputer(cfg.reward, protect=protected_paths(cfg))
    checks: list[tuple[int, float]] = []
    steps_done = s.steps
    for step in range(s.steps):
        batch = [data[rng.randrange(len(data))] for _ in range(s.batch_size)]
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        for i, (p, a) in enumerate(batch):
            ids[i, :len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
        loss = model(input_ids=ids, attention_mask=(labels != -100) | (ids != tok.pad_token_id),
                     labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if (step + 1) % 50 == 0 or step == 0:
            # Progress goes to the log: the console shows one line when it starts, one when done.
            log.info("sft step %4d/%d  loss %.4f  %.0fs", step + 1, s.steps, loss.item(),
                     time.perf_counter() - t0)
        if s.target_accuracy is not None and (step + 1) % s.check_every == 0:
            checks.append((step + 1, greedy_accuracy(model, tok, cfg, train[:s.check_examples],
                                                     cfg.rollout.max_new_tokens,
                                                     rewards=rewards)))
            model.train()
            log.info("sft step %4d: %.3f greedy accuracy on training problems", *checks[-1])
            if checks[-1][1] >= s.target_accuracy:
                steps_done = step + 1
                break
    accuracy = greedy_accuracy(model, tok, cfg, evals[: cfg.eval.num_prompts], cfg.rollout.max_new_tokens,
                               rewards=rewards)
    rewards.close()
    out = sft_dir(cfg)
    tmp = out.with_name(f".tmp-{out.name}-{uuid.uuid4().hex[:6]}")
    tmp.mkdir(parents=True)
    save_model(model, tmp)  # the layout both HF and vLLM read (original names for DeepSeek-V4)
    tok.save_pretrained(tmp)
    (tmp / "sft.json").write_text(json.dumps({"eval_accuracy": accuracy, "steps": steps_done,
                                              "checks": checks, "base": str(base)}, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    say(f"SFT done in {time.perf_counter() - t0:.0f}s ({steps_done} steps): greedy eval "
        f"accuracy {accuracy:.3f} -> {out}")
    return out, accuracy
