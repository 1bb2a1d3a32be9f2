"""Submit ONE heterogeneous Slurm job (trainer component + rollout component) with submitit.

`HetJobExecutor` is submitit's `SlurmExecutor` with three template hooks filled in:

- `_make_submission_file_text`: submitit writes the sbatch file for component 0 (trainer) as
  usual; we insert `#SBATCH hetjob` and component 1's (rollout) flags after its last `#SBATCH`.
- the submitted function runs ONCE, as a one-task step on the first trainer node
  (`srun --het-group=0 --nodes=1 --ntasks=1`); it reaches the other nodes itself (see
  `slurm.ray_cluster`), so `_num_tasks` is 1 and job arrays are refused.
- `HetJobInfoWatcher`: `sacct` lists a hetjob as `N+0`, `N+1`; we map `N+0` (the leader, which
  runs the function) back to `N` so `job.state`, `job.done()` and `job.result()` work.

Users keep submitit's `Job` objects, logs, pickled results and `Checkpointable` requeueing. The
job is requeueable (`--requeue`) and gets submitit's preemption signal (`USR2` unless
`SUBMITIT_PREEMPT_SIGNAL` says otherwise) `signal_delay_s` seconds before its time limit.

Deliberately left out: job arrays of hetjobs, more than two components.
"""
from __future__ import annotations

import re
import shlex
import shutil
import sys
import typing as tp
from pathlib import Path

from submitit.core import core, utils
from submitit.slurm import slurm as submitit_slurm

from rl.config import ClusterConfig, SlurmGroupConfig
# The option tables live in a module without submitit, so launch.plan checks them cheaply.
from slurm.params import (EXTRA_SLURM_PARAMS, GENERIC_TO_SLURM, SlurmParamError,  # noqa: F401
                          validate_slurm_params)


def component_params(group: SlurmGroupConfig) -> dict[str, tp.Any]:
    """Slurm options (submitit names) for one component; unset/zero fields are left out."""
    values = {
        "nodes": group.nodes,
        "gpus_per_node": group.gpus_per_node or None,
        "cpus_per_node": group.cpus_per_node or None,
        "mem_gb": submitit_slurm._convert_mem(group.mem_gb) if group.mem_gb else None,
        "partition": group.partition,
        "constraint": group.constraint,
        "time_min": group.time_min,
    }
    assert set(values) == set(GENERIC_TO_SLURM), "table and component fields diverged"
    out = {GENERIC_TO_SLURM[k]: v for k, v in values.items() if v is not None}
    out["ntasks_per_node"] = 1
    return out


class HetJobInfoWatcher(submitit_slurm.SlurmInfoWatcher):
    """Reads `sacct` output of hetjobs: the leader line `N+0` is reported as job `N`.

    Lines of other components (`N+1`, ...) are kept under their own ids; the leader's state is
    the job's state because the submitted function runs in component 0.
    """

    _LEADER = re.compile(r"^(\d+)\+0$")

    def read_info(self, string: tp.Union[bytes, str]) -> dict[str, dict[str, str]]:
        if not isinstance(string, str):
            string = string.decode()
        lines = string.splitlines()
        if len(lines) < 2:
            return {}
        names = lines[0].split("|")
        col = names.index("JobID") if "JobID" in names else 0
        rewritten = [lines[0]]
        for line in lines[1:]:
            fields = line.split("|")
            if len(fields) > col:
                fields[col] = self._LEADER.sub(r"\1", fields[col].strip())
            rewritten.append("|".join(fields))
        return super().read_info("\n".join(rewritten))


class HetJob(submitit_slurm.SlurmJob[core.R]):
    """A submitit job whose state comes from the hetjob leader (`N+0`)."""

    watcher = HetJobInfoWatcher(delay_s=600)


class HetJobExecutor(submitit_slurm.SlurmExecutor):
    """Submits a function as one hetjob: component 0 = trainer nodes, 1 = rollout nodes.

    Args:
        folder: submitit's folder for pickles and logs; shared by all nodes; must not contain
            `%j` (tasks of het group 1 then fail with `Slurmd could not connect IO`).
        trainer, rollout: resources of each component (`rl.config.SlurmGroupConfig`).
        slurm_params: extra sbatch options (keys of `EXTRA_SLURM_PARAMS`), e.g. `account`.
        signal_delay_s: the preemption/time-limit signal arrives this many seconds early.
        max_num_timeout: requeues submitit allows after time-outs (Checkpointable functions).
        job_name, python, setup: as in submitit (`setup`: shell lines run before the srun).

    Raises:
        SlurmParamError for an unknown Slurm parameter; ValueError for a `%` in `folder`.
    """

    job_class = HetJob

    def __init__(
        self,
        folder: tp.Union[str, Path],
        *,
        trainer: SlurmGroupConfig,
        rollout: SlurmGroupConfig,
        slurm_params: tp.Mapping[str, tp.Any] | None = None,
        signal_delay_s: int = 120,
        max_num_timeout: int = 3,
        job_name: str = "rl",
        python: str | None = None,
        setup: tp.Sequence[str] = (),
    ) -> None:
        if "%" in str(folder):
            raise ValueError(f"folder {str(folder)!r} must not contain '%' patterns such as %j: "
                             "tasks of het group 1 cannot open their output then")
        # Not SlurmExecutor.__init__: it refuses to exist without `srun` on PATH, and the
        # sbatch text (dry runs, golden tests) needs no Slurm. `submit` checks for srun.
        core.PicklingExecutor.__init__(self, folder, max_num_timeout=max_num_timeout)
        self.python = shlex.quote(sys.executable) if python is None else python
        extras = validate_slurm_params(slurm_params or {})
        per_component = {k: v for k, v in extras.items() if EXTRA_SLURM_PARAMS[k] == "each"}
        self._rollout_params = {**component_params(rollout), **per_component, "requeue": True}
        self.update_parameters(
            job_name=job_name,
            signal_delay_s=signal_delay_s,
            # The function runs once, on the first trainer node; it starts everything else.
            srun_args=["--het-group=0", "--nodes=1", "--ntasks=1"],
            setup=list(setup) or None,
            additional_parameters={**extras, "requeue": True},
            **component_params(trainer),
        )

    @classmethod
    def from_config(cls, folder: tp.Union[str, Path], cluster: ClusterConfig,
                    **kwargs: tp.Any) -> "HetJobExecutor":
        """The executor `cluster` describes (components, extra params, signal, requeues)."""
        return cls(folder, trainer=cluster.trainer, rollout=cluster.rollout,
                   slurm_params=cluster.slurm_params, signal_delay_s=cluster.signal_before_end_s,
                   max_num_timeout=cluster.max_requeues, **kwargs)

    def submission_text(self) -> str:
        """The sbatch file `submit` would write (for dry runs and golden tests)."""
        return self._make_submission_file_text(self._submitit_command_str, "dry-run")

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        text = super()._make_submission_file_text(command, uid)
        lines = text.split("\n")
        last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH "))
        # job-wide options (signal, output, ...) stay in component 0; these describe component 1
        het = ["#SBATCH hetjob"] + [submitit_slurm._as_sbatch_flag(k, v)
                                    for k, v in sorted(self._rollout_params.items())]
        return "\n".join(lines[: last + 1] + het + lines[last + 1:])

    def _submit_command(self, command: str) -> core.Job[tp.Any]:
        if shutil.which("sbatch") is None:
            raise RuntimeError("sbatch not found on PATH: is this a Slurm cluster "
                               "(and SLURM_CONF set)?")
        return super()._submit_command(command)

    def _num_tasks(self) -> int:
        return 1

    def _internal_process_submissions(
        self, delayed_submissions: list[utils.DelayedSubmission]
    ) -> list[core.Job[tp.Any]]:
        # SlurmExecutor turns several submissions into a job array; hetjobs cannot be arrays,
        # so each submission becomes its own hetjob.
        return core.PicklingExecutor._internal_process_submissions(self, delayed_submissions)
