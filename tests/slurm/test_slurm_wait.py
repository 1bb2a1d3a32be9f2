"""`launch.submit --wait` (`slurm.sbatch.wait_for`) against the real test cluster: it follows a
job through its requeues, streaming every life's output, and returns EXIT_REQUEUE (75) when the
job stops at `cluster.max_requeues`.

The job is `slurm.allocation.slurm_main` with Ray and the RL loop replaced by a life that stops
at once (`probes.stop_every_life_probe`), so the test takes about a minute instead of a Ray and
vLLM start per life. The full RL job under `--wait` is test_slurm_rl.py's reference run.
"""
import signal
from pathlib import Path

import pytest

from job.lifecycle import read_jsonl
from rl.config import load_config
from rl.signals import EXIT_REQUEUE
from slurm.sbatch import make_executor, wait_for
from slurm.testing import probes
from slurm.testing.client import backfill_kicked

pytestmark = pytest.mark.slurm
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "slurm_cpu_test.yaml"


@pytest.mark.timeout(300)
def test_wait_follows_requeues_and_exits_75_at_the_requeue_limit(slurm_cluster, tmp_path, capsys):
    cfg = load_config(CONFIG, [f"output_dir={tmp_path}", "cluster.max_requeues=1"])
    cfg.run_dir.mkdir(parents=True)
    job = make_executor(cfg).submit(probes.stop_every_life_probe, cfg)
    sigint = signal.getsignal(signal.SIGINT)  # wait_for takes Ctrl-C over
    try:
        with backfill_kicked(job.job_id):  # the requeued life starts once eligible
            rc = wait_for(job)
    except BaseException:
        job.cancel(check=False)  # leave no job behind on failure
        raise
    finally:
        signal.signal(signal.SIGINT, sigint)
    out, err = capsys.readouterr()
    assert rc == EXIT_REQUEUE, (out, err)
    # Both lives' output was streamed: the wait went on through the requeue.
    assert "life 0 on " in out and "life 1 on " in out, out
    requeued = out.index(f"requeued job {job.job_id} (restart 1 of at most 1)")
    assert out.index("life 0 on ") < requeued < out.index("life 1 on ")
    # The second stop hit the limit: one line saying why and what to do.
    assert (f"stopped on SIGUSR2 at step 2; not requeueing: job {job.job_id} was already "
            "requeued 1 times (cluster.max_requeues=1). Submit the same config again to resume.") \
        in err.splitlines(), err
    events = read_jsonl(cfg.run_dir / "lifecycle.jsonl")
    assert [(e["event"], e["restart_count"]) for e in events] == [("requeued", 0),
                                                                  ("requeue_limit", 1)]
