"""What `launch.submit` refuses on the submitting host before anything starts: a resume with a
config that differs from the run directory's, and malformed data. Through the command line, as a
user runs it; each refusal must come before Ray, engines or sbatch, so these take seconds."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.config import load_config, save_config

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "configs" / "local.yaml")


def submit(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "launch.submit", LOCAL, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def assert_refused_in_one_line(proc, *needles):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]


def saved_run(tmp_path, *overrides):
    """A run directory holding the config.yaml a run of local.yaml with `overrides` wrote."""
    cfg = load_config(LOCAL, [f"output_dir={tmp_path}", "name=r", *overrides])
    cfg.run_dir.mkdir(parents=True)
    save_config(cfg, cfg.run_dir / "config.yaml")
    return cfg.run_dir


@pytest.mark.parametrize("kind", ["local", "slurm"])
def test_resume_with_a_different_config_is_refused_before_anything_starts(tmp_path, kind):
    run_dir = saved_run(tmp_path, f"cluster.kind={kind}")
    proc = submit(f"output_dir={tmp_path}", "name=r", f"cluster.kind={kind}",
                  "algorithm.clip_low=0.3", "trainer.lr=1e-3", "num_steps=3")
    assert_refused_in_one_line(proc, f"{run_dir}/config.yaml: refusing to resume",
                               "algorithm.clip_low: 0.2 -> 0.3", "trainer.lr: 0.0003 -> 0.001",
                               "--force", "--no-resume")
    assert "num_steps" not in proc.stderr  # rl.resume.RESUME_KEYS: a longer run resumes
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]  # no job, no submitit


@pytest.mark.parametrize("overrides, needle", [
    (["trainer.expert_parallel_size=3"],
     "trainer.expert_parallel_size: got 3, expected a divisor of num_ranks (2)"),
    (["trainer.num_ranks=6", "trainer.expert_parallel_size=3"],
     "trainer.expert_parallel_size: got 3, expected a divisor of the model's 8 routed experts"),
])
def test_expert_parallel_size_is_checked_before_anything_starts(tmp_path, overrides, needle):
    proc = submit(f"output_dir={tmp_path}", *overrides)
    assert_refused_in_one_line(proc, needle)
    assert not any(tmp_path.iterdir())  # no run directory: refused before anything ran


@pytest.mark.parametrize("overrides, needles", [
    (["trainer.device=cpu", "sync.backend=nccl"],
     ["config error: sync.backend: nccl needs the trainer and the engines on GPUs",
      "set sync.backend=auto (gloo here) or gloo"]),
    (["cluster.kind=slurm", "sync.backend=ipc"],
     ["config error: sync.backend: ipc shares memory within one machine", "other nodes",
      "set sync.backend=auto"]),
])
def test_sync_backend_that_cannot_work_is_refused_before_anything_starts(tmp_path, overrides,
                                                                         needles):
    proc = submit(f"output_dir={tmp_path}", *overrides)
    assert_refused_in_one_line(proc, *needles)
    assert not any(tmp_path.iterdir())  # no run directory: refused before anything ran


def test_unknown_slurm_params_are_refused_before_anything_starts(tmp_path):
    proc = submit(f"output_dir={tmp_path}", "cluster.kind=slurm", "cluster.slurm_params.acount=rl",
                  "cluster.slurm_params.job-name=x", "cluster.slurm_params.qos=low")
    assert_refused_in_one_line(
        proc, "config error: cluster.slurm_params: unknown Slurm parameter(s) ['acount', "
              "'job_name'] (job_name set from the trainer/rollout component fields",
        "valid: ['account', 'comment', 'dependency', 'exclude', 'exclusive', 'mail_type', "
        "'mail_user', 'qos', 'reservation', 'wckey']")
    assert list(tmp_path.iterdir()) == []  # no run directory, no submitit folder


@pytest.mark.parametrize("section", ["wandb", "mlflow"])
def test_an_enabled_tracker_without_its_package_is_refused_in_one_line(tmp_path, section):
    """W&B / MLflow on, their package not importable (shadowed by one that raises ImportError, as
    a missing install does): exit 2 naming the key and the extra, before anything starts."""
    shadow = tmp_path / "site" / section
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(f"raise ImportError(\"No module named '{section}'\")\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}"}
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "launch.submit", LOCAL, f"output_dir={runs}",
                           f"logging.{section}.enabled=true", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert_refused_in_one_line(
        proc, f"config error: logging.{section}.enabled: got true, but {section} cannot be "
              f"imported (No module named '{section}'); install it with pip install -e "
              f"'.[{section}]', or set logging.{section}.enabled: false")
    assert not runs.exists()


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


MALFORMED = [
    ('{"question": "1+1=", "answer": 4', "invalid JSON"),
    ('{"question": "1+1=", "solution": "2"}', "missing key 'answer'"),
    ('{"question": "", "answer": "2"}', "key 'question': got '', expected a non-empty string"),
]


@pytest.mark.parametrize("row, what", MALFORMED)
def test_malformed_row_is_named_by_file_and_line(tmp_path, row, what):
    bad = write_jsonl(tmp_path / "train.jsonl", ['{"question": "2+2=", "answer": "4"}', "", row])
    proc = submit(f"output_dir={tmp_path}", "data.source=file", f"data.train_path={bad}")
    assert_refused_in_one_line(proc, f"data error: {bad}:3: {what}")
    assert not (tmp_path / "demo").exists()  # the run directory was never made


def test_eval_split_is_checked_too_and_slurm_is_refused_before_submission(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ['{"question": "2+2=", "answer": "4"}'])
    bad = write_jsonl(tmp_path / "eval.jsonl", ['{"question": "3+3=", "answer": "6"}', "[1, 2]"])
    proc = submit(f"output_dir={tmp_path}", "cluster.kind=slurm", "--no-plan-check",
                  "data.source=file", f"data.train_path={train}", f"data.eval_path={bad}")
    assert_refused_in_one_line(proc, f"{bad}:2: got list [1, 2], expected a JSON object")


def test_unreadable_file_suggests_no_data_check(tmp_path):
    proc = submit(f"output_dir={tmp_path}", "data.source=file",
                  f"data.train_path={tmp_path}/nowhere.jsonl")
    assert_refused_in_one_line(proc, "nowhere.jsonl: no such file", "--no-data-check")


# ---- in process: what passes the checks reaches the launcher --------------------------------
@pytest.fixture
def launched(monkeypatch):
    """main()'s call of run_local, recorded instead of starting a job (Ray, vLLM, DeepSpeed)."""
    import launch.submit
    calls = []
    monkeypatch.setattr(launch.submit, "run_local", lambda cfg, args: calls.append((cfg, args)) or 0)
    return calls


def main(*args):
    from launch.submit import main as submit_main
    return submit_main([LOCAL, *args])


def test_force_and_no_resume_pass_the_resume_check(tmp_path, launched, capsys):
    saved_run(tmp_path)
    changed = [f"output_dir={tmp_path}", "name=r", "algorithm.clip_high=0.3"]
    with pytest.raises(SystemExit) as e:
        main(*changed)
    assert e.value.code == 2 and not launched
    assert main(*changed, "--force") == 0
    assert "resuming despite config differences (--force): algorithm.clip_high" in capsys.readouterr().out
    assert main(*changed, "--no-resume") == 0
    assert [args.force for _, args in launched] == [True, False]


def test_no_data_check_skips_reading_the_files(tmp_path, launched):
    missing = [f"output_dir={tmp_path}", "data.source=file", f"data.train_path={tmp_path}/x.jsonl"]
    with pytest.raises(SystemExit):
        main(*missing)
    assert main(*missing, "--no-data-check") == 0
    assert launched[0][0].data.train_path == f"{tmp_path}/x.jsonl"


def test_prompt_longer_than_max_prompt_tokens_is_refused(tmp_path, launched, capsys):
    # The presets' character tokenizer: one token per character, plus BOS.
    rows = [json.dumps({"question": "1+1=", "answer": "2"}),
            json.dumps({"question": "9" * 10 + "=", "answer": "9"}),
            json.dumps({"question": "8" * 12 + "=", "answer": "8"})]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    base = [f"output_dir={tmp_path}", "data.source=file", f"data.train_path={path}",
            "data.eval_fraction=0"]
    with pytest.raises(SystemExit) as e:
        main(*base, "data.max_prompt_tokens=11")
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and not launched
    assert err == (f"data error: {path}:2: prompt is 12 tokens with the run's tokenizer, expected "
                   "at most data.max_prompt_tokens (11) (1 more prompts are too long); raise "
                   "data.max_prompt_tokens and rollout.max_model_len, or shorten the prompt")
    assert main(*base, "data.max_prompt_tokens=14") == 0
    # The engine's context binds too: a prompt must leave room for one generated token.
    with pytest.raises(SystemExit) as e:
        main(*base, "data.max_prompt_tokens=14", "rollout.max_model_len=12",
             "rollout.max_new_tokens=4")
    assert "expected at most rollout.max_model_len - 1 (11: one generated token must fit)" in (
        capsys.readouterr().err)
    assert main(*base, "data.max_prompt_tokens=14", "rollout.max_model_len=15",
                "rollout.max_new_tokens=4") == 0
    assert "the longest prompt (14 tokens) + rollout.max_new_tokens (4) exceeds" in (
        capsys.readouterr().out)


def test_eval_note_is_printed_before_the_run(tmp_path, launched, capsys):
    path = write_jsonl(tmp_path / "train.jsonl",
                       [json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) for i in range(40)])
    assert main(f"output_dir={tmp_path}", "data.source=file", f"data.train_path={path}") == 0
    assert f"holding out 0.05 of the prompts of {path} as the eval set" in capsys.readouterr().out
    assert main(f"output_dir={tmp_path}", "data.source=file", f"data.train_path={path}",
                "data.eval_fraction=0") == 0
    assert "evaluation is off" in capsys.readouterr().out


def test_no_resume_moves_the_old_run_aside_and_the_job_resumes(tmp_path, launched, capsys):
    """--no-resume starts over by moving the old run directory away (nothing deleted); the job is
    then asked to resume, so every requeued life of it resumes from its own checkpoints."""
    run_dir = saved_run(tmp_path)
    (run_dir / "checkpoints" / "step_000004").mkdir(parents=True)
    (run_dir / "trajectories.h5").write_bytes(b"old")
    assert main(f"output_dir={tmp_path}", "name=r", "--no-resume") == 0
    old = [p for p in tmp_path.iterdir() if p.name.startswith("r.old-")]
    assert len(old) == 1 and (old[0] / "trajectories.h5").read_bytes() == b"old"
    assert (old[0] / "checkpoints" / "step_000004").is_dir()
    assert list(run_dir.iterdir()) == []  # a fresh run directory (made 0700 before the job)
    assert f"--no-resume: moved the previous run to {old[0]}" in capsys.readouterr().out
    # Twice in the same second: a numbered name, nothing overwritten; an empty dir stays.
    from job.rundir import archive_run_dir
    moved = [archive_run_dir(saved_run(tmp_path / "b"), now=0.0) for _ in range(2)]
    assert [p.name for p in moved] == ["r.old-19700101-000000", "r.old-19700101-000000-2"]
    (tmp_path / "b" / "r").mkdir()
    assert archive_run_dir(tmp_path / "b" / "r") is None


def test_the_job_is_always_asked_to_resume(tmp_path, monkeypatch):
    """What the launcher pickles for the job never says "do not resume" (on Slurm it is reused by
    every requeued life)."""
    import submitit

    import launch.submit
    submitted = []

    class Executor:
        def __init__(self, folder):
            pass

        def update_parameters(self, **kw):
            pass

        def submit(self, fn, *args, **kwargs):
            submitted.append((args, kwargs))
            raise SystemExit(0)

    monkeypatch.setattr(submitit, "LocalExecutor", Executor)
    saved_run(tmp_path)
    with pytest.raises(SystemExit):
        launch.submit.main([LOCAL, f"output_dir={tmp_path}", "name=r", "--no-resume"])
    (args, kwargs), = submitted
    # `resume` is never passed (it defaults to True); the first life is restart 0
    assert args[1:] == () and kwargs == {"force": False, "restart_count": 0}


def _v4_rollout_dir(tmp_path, expert_dtype):
    d = tmp_path / f"v4-{expert_dtype}"
    d.mkdir()
    config = {"model_type": "deepseek_v4", "expert_dtype": expert_dtype,
              "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    if expert_dtype is None:  # the published Flash config: vLLM's default, MXFP4
        del config["expert_dtype"]
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("expert_dtype", ["fp4", None])
def test_v4_rollout_checkpoint_with_fp4_experts_is_refused_before_anything_starts(
        tmp_path, expert_dtype):
    # The published checkpoint and `launch.convert --rollout-experts fp4` hold MXFP4 experts;
    # the sync sends FP8 ones
    d = _v4_rollout_dir(tmp_path, expert_dtype)
    proc = submit(f"output_dir={tmp_path}", "name=v4fp4", f"rollout.model_path={d}")
    assert_refused_in_one_line(proc, "rollout.model_path", "MXFP4", "expert_dtype fp4",
                               "launch.convert SRC --rollout-out DIR --rollout-experts fp8")


def test_v4_rollout_checkpoint_with_fp8_experts_passes_the_check(tmp_path):
    from launch.checks import check_rollout_checkpoint_or_exit
    d = _v4_rollout_dir(tmp_path, "fp8")
    check_rollout_checkpoint_or_exit(load_config(LOCAL, [f"rollout.model_path={d}"]))


def test_packing_a_sliding_window_checkpoint_is_refused_before_anything_starts(tmp_path):
    """trainer.pack_sequences with a model.path whose config.json (read alone) has
    sliding-window layers: the packed attention has no window."""
    d = tmp_path / "sliding"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}))
    runs = tmp_path / "runs"
    proc = submit(f"output_dir={runs}", f"model.path={d}", "trainer.pack_sequences=true")
    assert_refused_in_one_line(proc, "trainer.pack_sequences: got true, expected false for "
                                     "qwen3 with sliding-window attention layers")
    assert not runs.exists()  # refused before anything ran
