# Writes the test cluster's configuration files into $ETC: slurm.conf, gres.conf, cgroup.conf
# (cgroup v2 hosts), task_prolog.sh (with GPUs) and slurmdbd.conf. Sourced by start.sh after
# config.sh; tests/slurm/test_slurm_config.py sources it alone to check what it writes.
# (No shebang on purpose: it runs in start.sh's shell, under its `set -euo pipefail`.)
# Defines db_pass_file, which start.sh's MariaDB step reads.
cat >"$ETC/slurm.conf" <<CONF
ClusterName=$RL_SLURM_CLUSTER
SlurmctldHost=$(hostname -s)($RL_SLURM_HOST_IP)
SlurmctldPort=$RL_SLURM_CTLD_PORT
SlurmdPort=$RL_SLURM_SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again only after this many seconds (default 120)
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$RL_SLURM_DIR/ctld
SlurmdSpoolDir=$RL_SLURM_DIR/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# pgid: linuxproc leaks processes after scancel; no cgroups here
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# the advertised CPUs/memory are more than the machine has: trust slurm.conf
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
# without these, a submitted job waits ~11 s for the scheduler
SchedulerParameters=bf_interval=1,sched_interval=1
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# 22.05 has no PreemptParameters; this makes preemption send the job's --signal first
SlurmctldParameters=preempt_send_user_signal
MinJobAge=3600
KillWait=5
InactiveLimit=0
SlurmdTimeout=60
MessageTimeout=10
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
CONF
if [[ $RL_SLURM_ACCOUNTING == none ]]; then
  echo "AccountingStorageType=accounting_storage/none" >>"$ETC/slurm.conf"
else
  cat >>"$ETC/slurm.conf" <<CONF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$RL_SLURM_HOST_IP
AccountingStoragePort=$RL_SLURM_DBD_PORT
# for slurmdbd this names the munge socket that clients (sacct, sacctmgr) use to reach it
AccountingStoragePass=$MUNGE_SOCKET
CONF
fi
: >"$ETC/gres.conf"
# cgroup v2 without systemd (the GPU machine): slurmd would ask systemd over D-Bus for a scope
# for its slurmstepds and fail. Nothing here constrains with cgroups (pgid, task/none).
rm -f "$ETC/cgroup.conf"
if [[ $(stat -fc %T /sys/fs/cgroup 2>/dev/null) == cgroup2fs && ! -S /run/dbus/system_bus_socket ]]; then
  printf 'CgroupPlugin=cgroup/v2\nIgnoreSystemd=yes\n' >"$ETC/cgroup.conf"
fi
if [[ -n $RL_SLURM_GPUS ]]; then
  cat >>"$ETC/slurm.conf" <<CONF
GresTypes=gpu
TaskProlog=$ETC/task_prolog.sh
CONF
  sed "s|@GRES_CONF@|$ETC/gres.conf|" "$(dirname "${BASH_SOURCE[0]}")/task_prolog.sh" >"$ETC/task_prolog.sh"
  chmod 755 "$ETC/task_prolog.sh"
fi
for i in "${!RL_SLURM_NODES[@]}"; do
  node=${RL_SLURM_NODES[$i]} gres=""
  gpus=$(node_gpus "$node")
  if [[ -n $gpus ]]; then
    IFS=, read -ra ids <<<"$gpus"
    gres=" Gres=gpu:${#ids[@]}"
    for g in "${ids[@]}"; do echo "NodeName=$node Name=gpu File=/dev/nvidia$g" >>"$ETC/gres.conf"; done
  fi
  echo "NodeName=$node NodeAddr=${RL_SLURM_NODE_IPS[$i]} CPUs=$RL_SLURM_NODE_CPUS RealMemory=$RL_SLURM_NODE_MEM_MB Features=${RL_SLURM_FEATURES[$i]}$gres State=UNKNOWN" >>"$ETC/slurm.conf"
done
all_nodes=$(IFS=,; echo "${RL_SLURM_NODES[*]}")
cat >>"$ETC/slurm.conf" <<CONF
PartitionName=batch Nodes=$all_nodes Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=20 MaxTime=INFINITE State=UP
PartitionName=urgent Nodes=$all_nodes PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP
CONF

db_pass_file=$ETC/db_pass
[[ -s $db_pass_file ]] || (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$db_pass_file")
(umask 077; cat >"$ETC/slurmdbd.conf" <<CONF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=$(hostname -s)
DbdAddr=$RL_SLURM_HOST_IP
DbdPort=$RL_SLURM_DBD_PORT
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$RL_SLURM_DB_PORT
StorageUser=slurm
StoragePass=$(cat "$db_pass_file")
StorageLoc=slurm_acct_db
CONF
)
