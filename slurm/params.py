"""The sbatch options a run may set, and their check; no submitit import, so `launch.plan` and
`launch.checks` validate `cluster.slurm_params` on the submitting host in milliseconds.
`slurm.executor` writes the options; it re-exports these names."""
from __future__ import annotations

import typing as tp

# The ONE table mapping our generic component fields (`rl.config.SlurmGroupConfig`) to Slurm's
# sbatch option names (submitit spelling, underscores for dashes). Each component runs one task
# per node; that task owns all the node's CPUs, hence cpus_per_node -> cpus_per_task.
GENERIC_TO_SLURM: dict[str, str] = {
    "nodes": "nodes",
    "gpus_per_node": "gpus_per_node",
    "cpus_per_node": "cpus_per_task",
    "mem_gb": "mem",
    "partition": "partition",
    "constraint": "constraint",
    "time_min": "time",
}

# Extra sbatch options a user may add (`ClusterConfig.slurm_params`), with where they go:
# "each" = written into both components, "job" = job-wide, written once into component 0.
EXTRA_SLURM_PARAMS: dict[str, str] = {
    "account": "each",
    "qos": "each",
    "reservation": "each",
    "exclude": "each",
    "exclusive": "each",
    "comment": "job",
    "dependency": "job",
    "mail_type": "job",
    "mail_user": "job",
    "wckey": "job",
}

# Options the executor sets itself; a user value for one would silently fight ours.
_OWNED = {"job_name", "ntasks_per_node", "signal", "requeue", "output", "error", "open_mode",
          *GENERIC_TO_SLURM.values()}


# `rl.config.NetworkConfig` field -> the environment variables it sets in the job script.
NETWORK_ENV: dict[str, tuple[str, ...]] = {
    "ib_hca": ("NCCL_IB_HCA",),
    "socket_ifname": ("NCCL_SOCKET_IFNAME",),
    "gloo_socket_ifname": ("GLOO_SOCKET_IFNAME",),
    "ib_gid_index": ("NCCL_IB_GID_INDEX",),
    "net_gdr_level": ("NCCL_NET_GDR_LEVEL",),
    "ib_timeout": ("NCCL_IB_TIMEOUT",),
    "ib_retry_cnt": ("NCCL_IB_RETRY_CNT",),
    "debug": ("NCCL_DEBUG",),
    "debug_subsys": ("NCCL_DEBUG_SUBSYS",),
}


def network_env(network: tp.Any) -> dict[str, str]:
    """{variable: value} for a `NetworkConfig`: set fields only (null leaves NCCL's default),
    `ib_disable` as NCCL_IB_DISABLE=1, then `extra_env`."""
    env = {var: str(getattr(network, name)) for name, variables in NETWORK_ENV.items()
           if getattr(network, name) is not None for var in variables}
    if network.ib_disable:
        env["NCCL_IB_DISABLE"] = "1"
    env.update({k: str(v) for k, v in network.extra_env.items()})
    return env


class SlurmParamError(ValueError):
    """An sbatch option we do not know or do not let users set; lists every valid one."""


def validate_slurm_params(params: tp.Mapping[str, tp.Any]) -> dict[str, tp.Any]:
    """Normalises keys (`mail-type` -> `mail_type`) and rejects unknown ones.

    Raises:
        SlurmParamError naming the unknown key(s) and listing every valid key.
    """
    normalised = {str(k).replace("-", "_"): v for k, v in params.items()}
    unknown = sorted(set(normalised) - set(EXTRA_SLURM_PARAMS))
    if unknown:
        owned = sorted(set(unknown) & _OWNED)
        hint = (f" ({', '.join(owned)} set from the trainer/rollout component fields "
                f"{sorted(GENERIC_TO_SLURM)})") if owned else ""
        raise SlurmParamError(
            f"unknown Slurm parameter(s) {unknown}{hint}; valid: {sorted(EXTRA_SLURM_PARAMS)}")
    return normalised
