#!/usr/bin/env bash
# Starts a real Slurm cluster on this one machine (idempotent: running parts are kept).
#
#   munged (own key and socket) -> MariaDB -> slurmdbd -> slurmctld -> slurmd n1 n2 n3
#
# Each slurmd runs in its own network namespace (bridge + veth, one IP per node) and its own
# UTS/mount namespace (hostname nX, a private /etc/hosts), so Ray inside a job sees 3 machines.
# n1,n2 carry the feature `trainer`, n3 `rollout`; partitions: `batch` (default, low priority,
# GraceTime=20, preempted jobs are requeued) and `urgent` (high priority).
# Clients source $RL_SLURM_DIR/env.sh (SLURM_CONF). Deliberately left out: cgroups.
# GPUs (RL_SLURM_GPUS="n1=0 n3=1", config.sh) become GRES `gpu` of those nodes; without cgroups
# nothing hides a node's other GPUs, so a TaskProlog (task_prolog.sh) points CUDA_VISIBLE_DEVICES
# at the machine's device numbers Slurm allocated.
# RL_SLURM_ACCOUNTING=none: no MariaDB/slurmdbd (sacct does not work then).
# Exit codes: 0 ready, 3 not root, 4 no apt-get, 5 timed out waiting for the nodes.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/config.sh"

if [[ $(id -u) -ne 0 ]]; then echo "start.sh: needs root (namespaces, daemons)" >&2; exit 3; fi
"$HERE/install.sh"
# one start/stop at a time (two test sessions may start the cluster together)
mkdir -p "$(dirname "$RL_SLURM_DIR")"
# (every daemon below is started with `9>&-`: one inheriting the lock would hold it forever)
exec 9>"$RL_SLURM_DIR.lock"; flock -w 300 9
mkdir -p "$ETC" "$RUN/munge" "$LOG" "$RL_SLURM_DIR/ctld"
for node in "${RL_SLURM_NODES[@]}"; do mkdir -p "$RL_SLURM_DIR/spool/$node"; done
chmod 755 "$RL_SLURM_DIR" "$RUN" "$RUN/munge"   # munge refuses a socket dir others can write
t0=$SECONDS
step() { echo "start.sh: [$((SECONDS - t0))s] $*"; }

# ---------------------------------------------------------------- network namespaces
if ! ip link show "$RL_SLURM_BRIDGE" >/dev/null 2>&1; then
  ip link add "$RL_SLURM_BRIDGE" type bridge
  ip addr add "$RL_SLURM_HOST_IP/24" dev "$RL_SLURM_BRIDGE"
  ip link set "$RL_SLURM_BRIDGE" up
fi
{
  echo "127.0.0.1 localhost"
  echo "$RL_SLURM_HOST_IP $(hostname -s) rl-ctl"
  for i in "${!RL_SLURM_NODES[@]}"; do echo "${RL_SLURM_NODE_IPS[$i]} ${RL_SLURM_NODES[$i]}"; done
} >"$ETC/hosts"
for i in "${!RL_SLURM_NODES[@]}"; do
  node=${RL_SLURM_NODES[$i]} ns=$(ns_name "${RL_SLURM_NODES[$i]}")
  if [[ ! -e /run/netns/$ns ]]; then
    ip netns add "$ns"
    ip link add "rlv-$node" type veth peer name eth0 netns "$ns"
    ip link set "rlv-$node" master "$RL_SLURM_BRIDGE" up
    ip -n "$ns" addr add "${RL_SLURM_NODE_IPS[$i]}/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  fi
done

# ---------------------------------------------------------------- configuration files
[[ -f $ETC/slurm.conf ]] && cp "$ETC/slurm.conf" "$ETC/slurm.conf.old"
source "$HERE/write_config.sh"
# cgroup v2 without systemd (cgroup.conf's IgnoreSystemd): slurmd makes its stepds' scope itself
[[ -f $ETC/cgroup.conf ]] && mkdir -p /sys/fs/cgroup/system.slice

if [[ -f $ETC/slurm.conf.old ]] && pid_alive "$RUN/slurmctld.pid" && ! cmp -s "$ETC/slurm.conf"{,.old}; then
  echo "start.sh: WARNING: slurm.conf changed while the cluster runs; run stop.sh, then start.sh" >&2
fi

# ---------------------------------------------------------------- munge
if ! pid_alive "$RUN/munged.pid"; then
  [[ -s $ETC/munge.key ]] || (umask 077; dd if=/dev/urandom of="$ETC/munge.key" bs=1024 count=1 status=none)
  munged --force --key-file="$ETC/munge.key" --socket="$MUNGE_SOCKET" --pid-file="$RUN/munged.pid" \
    --seed-file="$RL_SLURM_DIR/munge.seed" --log-file="$LOG/munged.log" 9>&-
  step "munged started"
fi

# ---------------------------------------------------------------- MariaDB + slurmdbd
db() { mariadb --no-defaults --socket="$DB_SOCKET" -uroot "$@"; }
if [[ $RL_SLURM_ACCOUNTING != none ]]; then
  if ! pid_alive "$RUN/mysqld.pid"; then
    if [[ ! -d $RL_SLURM_DIR/mysql/mysql ]]; then
      mariadb-install-db --no-defaults --user=root --datadir="$RL_SLURM_DIR/mysql" \
        --auth-root-authentication-method=normal --skip-test-db >"$LOG/mariadb-install.log" 2>&1
    fi
    # setsid: its own session, so that killing the caller's process group (a test runner's
    # timeout) does not take the database down with it (the other daemons daemonize themselves)
    setsid mariadbd --no-defaults --user=root --datadir="$RL_SLURM_DIR/mysql" --socket="$DB_SOCKET" \
      --port="$RL_SLURM_DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
      --pid-file="$RUN/mysqld.pid" --log-error="$LOG/mariadb.log" \
      --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 >/dev/null 2>&1 9>&- &
    for _ in $(seq 60); do db -e 'select 1' >/dev/null 2>&1 && break; sleep 0.5; done
    if ! db -e 'select 1' >/dev/null 2>&1; then
      echo "start.sh: MariaDB did not come up; $LOG/mariadb.log:" >&2; tail -20 "$LOG/mariadb.log" >&2; exit 1
    fi
    db -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$(cat "$db_pass_file")';
           GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
    step "mariadb started"
  fi
  if ! pid_alive "$RUN/slurmdbd.pid"; then
    slurmdbd 9>&-
    for _ in $(seq 40); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.5; done
    if ! sacctmgr -n list cluster >/dev/null 2>&1; then
      echo "start.sh: slurmdbd not answering; $LOG/slurmdbd.log:" >&2; tail -20 "$LOG/slurmdbd.log" >&2; exit 1
    fi
    step "slurmdbd started"
  fi
  if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$RL_SLURM_CLUSTER"; then
    sacctmgr -i add cluster "$RL_SLURM_CLUSTER" >/dev/null
  fi
fi

# ---------------------------------------------------------------- slurmctld + slurmd per node
if ! pid_alive "$RUN/slurmctld.pid"; then
  slurmctld 9>&-
  step "slurmctld started"
  # Jobs in the saved state belong to a cluster that died (machine restart, killed session):
  # cancel them so they neither rerun (they are requeueable) nor hold nodes. The state itself
  # is kept: job ids keep growing, so sacct never confuses a new job with an old record.
  for _ in $(seq 20); do scontrol ping >/dev/null 2>&1 && break; sleep 0.5; done
  orphans=$(squeue -h -o %i 2>/dev/null | sed 's/+.*//' | sort -u | tr '\n' ' ')
  if [[ -n ${orphans// /} ]]; then scancel $orphans; step "cancelled leftover jobs: $orphans"; fi
fi
for node in "${RL_SLURM_NODES[@]}"; do
  pid_alive "$RUN/slurmd-$node.pid" && continue
  # nsenter, not `ip netns exec`: the latter remounts /sys, which breaks slurmd's cgroup check.
  # Without the private hosts file, name lookups inside the namespace stall ~20 s each.
  nsenter --net="/run/netns/$(ns_name "$node")" unshare --uts --mount sh -c \
    "mount --bind '$ETC/hosts' /etc/hosts && hostname '$node' && exec slurmd -N '$node'" 9>&-
  step "slurmd $node started"
done

cat >"$RL_SLURM_DIR/env.sh" <<ENV
# Source this to use the test cluster: sinfo, sbatch, sacct, submitit.
export SLURM_CONF=$SLURM_CONF
export RL_SLURM_DIR=$RL_SLURM_DIR
ENV

# ---------------------------------------------------------------- wait for responding nodes
# idle, or busy with jobs of a reused cluster; a trailing `*` means "not responding"
deadline=$((SECONDS + RL_SLURM_START_TIMEOUT_S))
while :; do
  states=$(sinfo -h -N -p batch -o '%N %t' 2>/dev/null | sort -u || true)
  up=$(grep -cE ' (idle|mix|alloc|comp)$' <<<"$states" || true)
  [[ $up -eq ${#RL_SLURM_NODES[@]} ]] && break
  # a node left down/drained by an earlier run comes back on its own only after a while
  for n in $(awk '$2 ~ /down|drain/ {print $1}' <<<"$states"); do
    scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true
  done
  if ((SECONDS > deadline)); then
    echo "start.sh: nodes not up after ${RL_SLURM_START_TIMEOUT_S}s:" >&2; echo "$states" >&2
    echo "start.sh: see logs in $LOG" >&2; exit 5
  fi
  sleep 1
done
step "ready: $(tr '\n' ' ' <<<"$states")(source $RL_SLURM_DIR/env.sh)"
