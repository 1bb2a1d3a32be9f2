#!/usr/bin/env bash
# Downloads (on a Debian 12 machine with network) the .deb files install.sh needs on a machine
# without network: Slurm 22.05 without accounting, munge, iproute2 and the libraries they link
# that an Ubuntu 24.04 image lacks. ~7 MB.   bash slurm/testing/fetch_debs.sh DIR
set -euo pipefail
dir=${1:?usage: fetch_debs.sh DIR}
mkdir -p "$dir" && cd "$dir"
apt-get download slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge libmunge2 \
  libhwloc15 libjson-c5 liblua5.1-0 liblz4-1 libnuma1 libyaml-0-2 libreadline8 libdbus-1-3 \
  libgcrypt20 libbz2-1.0 iproute2 libbpf1 libelf1 libmnl0 libxtables12 libcap2 libatm1 libdb5.3
ls "$dir"
