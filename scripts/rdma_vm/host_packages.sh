#!/usr/bin/env bash
# Installs (as root, with apt) the host packages the rdma harness needs, when any is missing:
# qemu for the guest, busybox/cpio/kmod for its initramfs, rdma-core and friends for the guest's
# soft-RoCE user space (the guest runs the host's / over 9p), libibverbs-dev to build the rdma
# transport, python3-pyverbs for the independent verbs peer and `ditorch info`. Safe to rerun: does nothing once everything is there.
set -euo pipefail
pkgs=(qemu-system-x86 seabios busybox-static cpio kmod rdma-core ibverbs-providers ibverbs-utils
      iproute2 libibverbs-dev librdmacm-dev python3-pyverbs)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "rdma_vm: missing packages: ${missing[*]} (install them as root: apt-get install ${missing[*]})" >&2
  exit 2
fi
echo "rdma_vm: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
timeout 900 apt-get update -qq
timeout 1200 apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
