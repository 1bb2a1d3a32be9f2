#!/usr/bin/env bash
# Installs Slurm 22.05 (Debian), munge, slurmdbd and MariaDB when any is missing.
# Exit codes: 0 installed/already present, 3 not root, 4 no apt-get, other: apt failed.
set -euo pipefail
need=(munged slurmctld slurmd slurmdbd sbatch sacct mariadbd mariadb-install-db nsenter unshare ip)
missing=()
for b in "${need[@]}"; do command -v "$b" >/dev/null || [[ -x /usr/sbin/$b ]] || missing+=("$b"); done
[[ ${#missing[@]} -eq 0 ]] && exit 0
if [[ $(id -u) -ne 0 ]]; then echo "install.sh: need root to install ${missing[*]}" >&2; exit 3; fi
if ! command -v apt-get >/dev/null; then echo "install.sh: no apt-get to install ${missing[*]}" >&2; exit 4; fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends slurm-wlm slurmdbd munge mariadb-server mariadb-client \
  iproute2 util-linux
