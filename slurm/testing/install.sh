#!/usr/bin/env bash
# Installs Slurm 22.05 (Debian), munge, slurmdbd and MariaDB when any is missing: with apt-get, or
# from the .deb files in $RL_SLURM_DEBS (slurm/testing/fetch_debs.sh) on a machine without
# network. The .debs are unpacked aside and only files that do not exist yet are copied into /,
# so nothing the machine already has (its own libraries) is replaced.
# Exit codes: 0 installed/already present, 3 not root, 4 no apt-get, other: apt failed.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/config.sh"
need=(munged slurmctld slurmd sbatch scontrol nsenter unshare ip)
[[ $RL_SLURM_ACCOUNTING == none ]] || need+=(slurmdbd sacct mariadbd mariadb-install-db)
missing=()
for b in "${need[@]}"; do command -v "$b" >/dev/null || [[ -x /usr/sbin/$b ]] || missing+=("$b"); done
[[ ${#missing[@]} -eq 0 ]] && exit 0
if [[ $(id -u) -ne 0 ]]; then echo "install.sh: need root to install ${missing[*]}" >&2; exit 3; fi
if [[ -n $RL_SLURM_DEBS ]]; then
  staging=$(mktemp -d)
  for deb in "$RL_SLURM_DEBS"/*.deb; do dpkg -x "$deb" "$staging"; done
  # Debian's /lib is /usr/lib on both sides; a path that exists is skipped, never overwritten
  (cd "$staging" && find . \( -type f -o -type l \) -print0) | while IFS= read -r -d '' f; do
    dest=/${f#./}
    [[ -e $dest || -L $dest ]] && continue
    mkdir -p "$(dirname "$dest")" && cp -a "$staging/$f" "$dest"
  done
  rm -rf "$staging"
  # what the packages' postinst does with update-alternatives: slurmctld -> slurmctld-wlm, ...
  for f in /usr/sbin/*-wlm; do [[ -e ${f%-wlm} ]] || ln -s "$f" "${f%-wlm}"; done
  ldconfig
  echo "install.sh: installed ${missing[*]} from $RL_SLURM_DEBS"
  exit 0
fi
if ! command -v apt-get >/dev/null; then echo "install.sh: no apt-get to install ${missing[*]}" >&2; exit 4; fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends slurm-wlm slurmdbd munge mariadb-server mariadb-client \
  iproute2 util-linux
