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

ETC=$RL_SLURM_DIR/etc
RUN=$RL_SLURM_DIR/run
LOG=$RL_SLURM_DIR/log
MUNGE_SOCKET=$RUN/munge/munge.socket.2
DB_SOCKET=$RUN/mysqld.sock
export SLURM_CONF=$ETC/slurm.conf

ns_name() { echo "rl-$1"; }

# True when the pid in file $1 names a live process.
pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
