# Shared settings of the single-machine test Slurm cluster; sourced by install/start/stop.
# Every value can be overridden from the environment before calling the scripts.
RL_SLURM_DIR=${RL_SLURM_DIR:-/tmp/rl-slurm}          # all state, logs, configs, sockets
RL_SLURM_CLUSTER=${RL_SLURM_CLUSTER:-rltest}
RL_SLURM_NET=${RL_SLURM_NET:-10.213.7}                # /24 private to our namespaces (no route out)
RL_SLURM_BRIDGE=${RL_SLURM_BRIDGE:-rlbr0}
RL_SLURM_HOST_IP=${RL_SLURM_NET}.1                    # bridge address: slurmctld, slurmdbd
RL_SLURM_NODES=(n1 n2 n3)
RL_SLURM_NODE_IPS=("${RL_SLURM_NET}.11" "${RL_SLURM_NET}.12" "${RL_SLURM_NET}.13")
RL_SLURM_FEATURES=(trainer trainer rollout)
RL_SLURM_NODE_CPUS=${RL_SLURM_NODE_CPUS:-4}           # advertised; oversubscribes the real cores
RL_SLURM_NODE_MEM_MB=${RL_SLURM_NODE_MEM_MB:-4000}
RL_SLURM_CTLD_PORT=${RL_SLURM_CTLD_PORT:-6817}
RL_SLURM_SLURMD_PORT=${RL_SLURM_SLURMD_PORT:-6818}    # same port on every node: each has its own IP
RL_SLURM_DBD_PORT=${RL_SLURM_DBD_PORT:-6819}
RL_SLURM_DB_PORT=${RL_SLURM_DB_PORT:-3307}             # MariaDB, loopback only
RL_SLURM_START_TIMEOUT_S=${RL_SLURM_START_TIMEOUT_S:-90}
# GPUs as GRES, per node: "n1=0 n3=1" gives n1 /dev/nvidia0 and n3 /dev/nvidia1 ("n3=2,3": two).
# Empty (the default, CI): no GRES at all.
RL_SLURM_GPUS=${RL_SLURM_GPUS:-}
# `slurmdbd` (MariaDB + slurmdbd, sacct works) or `none` (no accounting: a machine that has no
# MariaDB, e.g. the GPU machine; sacct then fails, `launch.submit --wait` still ends on the
# job's result file).
RL_SLURM_ACCOUNTING=${RL_SLURM_ACCOUNTING:-slurmdbd}
# A folder of .deb files to install from instead of apt-get (a machine without network); see
# slurm/testing/fetch_debs.sh.
RL_SLURM_DEBS=${RL_SLURM_DEBS:-}

export PATH=$PATH:/usr/sbin:/sbin                     # the daemons (not in PATH everywhere)
ETC=$RL_SLURM_DIR/etc
RUN=$RL_SLURM_DIR/run
LOG=$RL_SLURM_DIR/log
MUNGE_SOCKET=$RUN/munge/munge.socket.2
DB_SOCKET=$RUN/mysqld.sock
export SLURM_CONF=$ETC/slurm.conf

ns_name() { echo "rl-$1"; }

# The GPU indices RL_SLURM_GPUS gives node $1 ("0,1"), empty when none.
node_gpus() {
  local kv
  for kv in $RL_SLURM_GPUS; do if [[ ${kv%%=*} == "$1" ]]; then echo "${kv#*=}"; fi; done
}

# True when the pid in file $1 names a live process of the daemon the file is named after
# (RUN/slurmd-n1.pid: slurmd; mysqld.pid: mysqld or mariadbd).
# A SIGKILLed daemon stays a zombie until its parent (here pid 1) reaps it, and `kill -0` still
# succeeds on a zombie: it counts as dead (a lost node is started again at once). A daemon killed
# without removing its pid file leaves a pid the kernel hands out again (pid_max is often 32,768):
# a live process of another name is not the daemon (start.sh once skipped slurmctld for a test's
# process that had its old pid, and stop.sh would have killed that process).
pid_alive() {
  [[ -s $1 ]] || return 1
  local pid name comm; pid=$(cat "$1")
  name=$(basename "$1" .pid); name=${name%%-*}
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  [[ $comm == "$name" || ($name == mysqld && $comm == mariadbd) ]] || return 1
  kill -0 "$pid" 2>/dev/null && ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null
}
