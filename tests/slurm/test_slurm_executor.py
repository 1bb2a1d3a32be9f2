"""HetJobExecutor without a cluster: generated sbatch text, parameter checks, sacct parsing."""
import os
from pathlib import Path

import pytest

from rl.config import ClusterConfig, SlurmGroupConfig
from slurm.executor import (EXTRA_SLURM_PARAMS, GENERIC_TO_SLURM, HetJobExecutor, HetJobInfoWatcher,
                            SlurmParamError)

GOLDEN = Path(__file__).parent / "golden" / "hetjob_trainer2x8_rollout1x8.sbatch"


def _executor(**kwargs) -> HetJobExecutor:
    cluster = ClusterConfig(
        kind="slurm",
        trainer=SlurmGroupConfig(nodes=2, gpus_per_node=8, cpus_per_node=64, mem_gb=512,
                                 partition="gpu", constraint="h200", time_min=240),
        rollout=SlurmGroupConfig(nodes=1, gpus_per_node=8, cpus_per_node=64, mem_gb=480.5,
                                 partition="gpu", constraint="h200", time_min=240),
        slurm_params={"account": "rl", "mail-type": "END"},
    )
    return HetJobExecutor.from_config("/shared/rl/jobs", cluster, python="/opt/rl/bin/python",
                                      **kwargs)


def test_hetjob_sbatch_text_matches_golden_file():
    text = _executor(job_name="grpo").submission_text()
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), f"regenerate with UPDATE_GOLDEN=1 if intended:\n{text}"


def test_sbatch_text_has_two_components_with_their_own_resources():
    lines = _executor().submission_text().splitlines()
    sep = lines.index("#SBATCH hetjob")
    first, second = lines[:sep], lines[sep + 1:]
    assert "#SBATCH --nodes=2" in first and "#SBATCH --nodes=1" in second
    assert "#SBATCH --mem=480GB" not in second and "#SBATCH --mem=492032MB" in second
    for comp in (first, second):  # both requeueable, both charged to the account
        assert "#SBATCH --requeue" in comp and "#SBATCH --account=rl" in comp
    # job-wide options appear once, in component 0
    assert "#SBATCH --signal=USR2@120" in first and not any("--signal" in x for x in second)
    assert "#SBATCH --mail-type=END" in first and not any("mail" in x for x in second)
    assert any(x.startswith("srun ") and "--het-group=0 --nodes=1 --ntasks=1" in x for x in second)


def test_unknown_slurm_parameter_lists_every_valid_one():
    with pytest.raises(SlurmParamError) as err:
        HetJobExecutor("/shared/jobs", trainer=SlurmGroupConfig(), rollout=SlurmGroupConfig(),
                       slurm_params={"acount": "rl", "nodes": 4})
    msg = str(err.value)
    assert "['acount', 'nodes']" in msg
    assert all(name in msg for name in EXTRA_SLURM_PARAMS)
    assert "nodes set from the trainer/rollout component fields" in msg
    assert all(name in msg for name in GENERIC_TO_SLURM)


def test_folder_with_job_id_pattern_is_refused():
    with pytest.raises(ValueError, match="%j"):
        HetJobExecutor("/shared/jobs/%j", trainer=SlurmGroupConfig(), rollout=SlurmGroupConfig())


def test_watcher_maps_hetjob_leader_to_job_id():
    sacct = ("JobID|State|NodeList\n"
             "41+0|RUNNING|n[1-2]\n41+0.batch|RUNNING|n1\n41+0.0|RUNNING|n1\n"
             "41+1|RUNNING|n3\n41+1.1|RUNNING|n3\n"
             "42|COMPLETED|n1\n")
    info = HetJobInfoWatcher().read_info(sacct)
    assert info["41"] == {"JobID": "41", "State": "RUNNING", "NodeList": "n[1-2]"}
    assert info["41+1"]["NodeList"] == "n3"
    assert info["42"]["State"] == "COMPLETED"  # plain jobs untouched
    assert not any("." in k for k in info)
