"""The job's console (`rl.console`): library chatter to RUN_DIR/logs/job.log, errors and our own
lines to the console."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from rl.console import ConsoleFilter

ROOT = Path(__file__).resolve().parents[2]

# Lines as the demo's job log holds them (Ray prefixes worker output with the actor and pid).
NOISE = [
    "(EngineHost pid=6318) (MainProcess pid=6318) INFO 11-30 14:07:01 [scheduler.py:307] Chunked "
    "prefill is enabled with max_num_batched_tokens=4096.",
    "(EngineHost pid=6318) (MainProcess pid=6318) WARNING 11-30 14:07:08 [cpu_worker.py:114] "
    "libtcmalloc is not found in LD_PRELOAD.",
    "\x1b[36m(TrainerWorker pid=6277)\x1b[0m [2026-11-30 14:04:51,614] [WARNING] "
    "[real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.",
    "2026-11-30 14:04:31,604\tINFO worker.py:2038 -- Started a local Ray instance.",
    "Loading weights: 100%|##########| 47/47 [00:00<00:00, 824.95it/s]",
    "(TrainerWorker pid=6277) /x/c10d_logger.py:83: FutureWarning: `all_gather_into_tensor` is "
    "deprecated.",
    "INFO rl.sft: sft step   50/200  loss 1.2345  12s",
    "WARNING deepspeed.runtime: some library warning",
    "step    1/2 | reward 0.000 | len 3.1",
]
ERRORS = [
    "(EngineHost pid=6318) (MainProcess pid=6318) ERROR 11-30 14:07:01 [core.py:1] engine died",
    "(TrainerWorker pid=6277) [2026-11-30 14:04:51,614] [ERROR] [engine.py:9] NaN in loss",
    "2026-11-30 14:04:31,604\tERROR worker.py:420 -- Unhandled error: ray::TrainerWorker.train()",
    "(TrainerWorker pid=6277) [E1130 14:07:08.152461069 ProcessGroupGloo.cpp:143] Gloo timeout",
    "CRITICAL torch.distributed: rank 1 lost",
    "WARNING rl.loop: step 3: dropping 2 of 16 prompt groups older than max_staleness 1",
    "ERROR rl.loop: 3 non-finite steps in a row: aborting with a checkpoint",
    "INFO rl.runtime: runtime ready in 61.2s: 2 trainer ranks, 1 engines (ray)",
    "INFO rl.checkpoint: checkpoint /tmp/run/checkpoints/step_000002 written in 0.4s",
]
TRACEBACK = [
    "(TrainerWorker pid=6277) Traceback (most recent call last):",
    '(TrainerWorker pid=6277)   File "/x/trainer.py", line 12, in train',
    "(TrainerWorker pid=6277)     loss.backward()",
    "(TrainerWorker pid=6277) RuntimeError: boom",
    "",
    "The above exception was the direct cause of the following exception:",
    "",
    "Traceback (most recent call last):",
    '  File "/x/loop.py", line 3, in run',
    "ValueError: outer",
]


def test_filter_keeps_errors_tracebacks_and_our_progress_drops_library_chatter():
    f = ConsoleFilter()
    assert [line for line in NOISE if f.keep(line)] == []
    assert [line for line in ERRORS if f.keep(line)] == ERRORS
    kept = [line for line in TRACEBACK + NOISE[:2] if f.keep(line)]
    # the blank line between two chained tracebacks is the only thing left out
    assert kept == TRACEBACK[:4] + TRACEBACK[5:6] + TRACEBACK[7:]


JOB = textwrap.dedent("""
    import logging, os, subprocess, sys
    from rl.console import job_console, say
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with job_console(sys.argv[1], sys.argv[2] == "verbose") as log_path:
        print("python-level noise")
        os.write(2, b"fd-level noise\\n")
        subprocess.run(["sh", "-c", "echo child noise; echo 'ERROR 11-30 [x.py:1] child failed' >&2"])
        logging.getLogger("rl.runtime").info("runtime ready in 1.0s")
        logging.getLogger("rl.sft").info("sft step 1/2")
        say("step    1/2 | reward 0.500")
        print("more noise", flush=True)
        sys.stderr.write("Traceback (most recent call last):\\n  File 'x', line 1\\nKeyError: 'k'\\n")
        say("summary")
    print("after the console:", log_path)
""")


def _run_job(tmp_path, mode: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", JOB, str(tmp_path), mode], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines() + out.stderr.splitlines()


def test_job_console_sends_chatter_to_the_log_and_keeps_errors_on_the_console(tmp_path):
    console = _run_job(tmp_path, "quiet")
    log = tmp_path / "logs" / "job.log"
    assert console == ["ERROR 11-30 [x.py:1] child failed", "INFO rl.runtime: runtime ready in 1.0s",
                       "step    1/2 | reward 0.500", "Traceback (most recent call last):",
                       "  File 'x', line 1", "KeyError: 'k'", "summary",
                       f"after the console: {log}"]
    text = log.read_text()
    for line in ("python-level noise", "fd-level noise", "child noise", "more noise",
                 "INFO rl.sft: sft step 1/2", "step    1/2 | reward 0.500", "summary"):
        assert line in text, line


def test_verbose_prints_everything_and_writes_no_log(tmp_path):
    console = _run_job(tmp_path, "verbose")
    assert {"python-level noise", "fd-level noise", "child noise", "more noise",
            "INFO rl.sft: sft step 1/2", "summary"} <= set(console)
    assert not (tmp_path / "logs").exists()
