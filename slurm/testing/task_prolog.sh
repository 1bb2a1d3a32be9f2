#!/bin/sh
# TaskProlog of the test cluster when it has GPUs (start.sh installs it with @GRES_CONF@ filled).
# Slurm without cgroups (task/none) gives a task CUDA_VISIBLE_DEVICES as the positions of its
# GPUs in the node's own gres.conf list: n3's only GPU, /dev/nvidia1, arrives as "0" (seen with
# Slurm 22.05), which on one shared machine is another node's GPU. This maps each position to its
# device file's number: what a cgroup-constrained node would show as its devices 0..k-1.
# Stdout lines `export NAME=VALUE` set the task's environment (Slurm's TaskProlog protocol).
[ -n "$CUDA_VISIBLE_DEVICES" ] || exit 0
node=${SLURMD_NODENAME:-$(hostname)}
mapped=$(awk -v node="$node" -v pos="$CUDA_VISIBLE_DEVICES" '
  $1 == "NodeName=" node { f = $3; sub(/^File=\/dev\/nvidia/, "", f); dev[n++] = f }
  END {
    k = split(pos, p, ","); s = ""
    for (i = 1; i <= k; i++) { if (!(p[i] in dev)) exit 1; s = s (i > 1 ? "," : "") dev[p[i]] }
    print s
  }' "@GRES_CONF@") || exit 0
echo "export CUDA_VISIBLE_DEVICES=$mapped"
echo "export RL_SLURM_GPUS_MAPPED=$CUDA_VISIBLE_DEVICES:$mapped"
