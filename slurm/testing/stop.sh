#!/usr/bin/env bash
# Stops the test cluster started by start.sh: every process in the node namespaces, the
# daemons named by their pid files, then the namespaces and the bridge. Keeps the state dir
# (delete it with RL_SLURM_PURGE=1) so a restart keeps the accounting database.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/config.sh"

exec 9>"$RL_SLURM_DIR.lock"; flock -w 300 9

kill_pids() {  # kill_pids PID...: TERM, wait up to 5 s, then KILL the ones still alive
  [[ $# -eq 0 ]] && return
  kill -TERM "$@" 2>/dev/null
  for _ in $(seq 50); do
    local alive=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [[ $alive -eq 0 ]] && return
    sleep 0.1
  done
  kill -KILL "$@" 2>/dev/null
}

# slurmd, job steps, Ray: everything living in our namespaces
for node in "${RL_SLURM_NODES[@]}"; do
  ns=$(ns_name "$node")
  [[ -e /run/netns/$ns ]] || continue
  mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null)
  kill_pids "${pids[@]}"
done
for f in slurmctld slurmdbd mysqld munged; do
  pid_alive "$RUN/$f.pid" && kill_pids "$(cat "$RUN/$f.pid")"
  rm -f "$RUN/$f.pid"
done
rm -f "$RUN"/slurmd-*.pid
for node in "${RL_SLURM_NODES[@]}"; do
  ip netns del "$(ns_name "$node")" 2>/dev/null
  ip link del "rlv-$node" 2>/dev/null
done
ip link del "$RL_SLURM_BRIDGE" 2>/dev/null
if [[ ${RL_SLURM_PURGE:-0} == 1 ]]; then rm -rf "$RL_SLURM_DIR"; fi
echo "stop.sh: stopped"
exit 0
