#!/usr/bin/env bash
# Runs one command inside a qemu guest that has a real (soft-RoCE) verbs device, rxe0, and the
# host's filesystem (read-only, with a tmpfs overlay), and exits with the command's exit code.
#
#   scripts/rdma_vm/run.sh [options] -- COMMAND [ARGS...]
#     --timeout SECS   limit for COMMAND inside the guest (default 600); the whole VM gets
#                      this plus 120 s for boot and shutdown
#     --mem MIB        guest memory (default 4096)      --smp N   guest CPUs (default 2)
#     --env NAME=VAL   set a variable for COMMAND (repeatable)
#     --cwd DIR        working directory inside the guest (default: the current directory;
#                      anywhere but /run, /dev and /proc, which the guest mounts itself)
#     --collect DIR    copy what COMMAND wrote under /run/rdma_vm/out (the guest's only way
#                      out: the host's / is read-only in the guest) to DIR on the host
#
# Guest: Debian's stock kernel (linux-image-amd64, unpacked, never installed), busybox
# initramfs, `qemu-system-x86_64 -accel tcg` (KVM hangs under the nested-pagetable VMs this
# project runs on; TCG makes CPU-bound work ~7x slower). Exit codes besides COMMAND's own:
# 120-122 a guest set-up step failed, 123 the VM hit its time limit, 124 COMMAND hit its
# limit, 125 the guest died without reporting.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
timeout_s=600 mem=4096 smp=2 cwd="$PWD" collect=""
envs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --timeout) timeout_s="$2"; shift 2 ;;
    --mem) mem="$2"; shift 2 ;;
    --smp) smp="$2"; shift 2 ;;
    --env) envs+=("$2"); shift 2 ;;
    --cwd) cwd="$2"; shift 2 ;;
    --collect) collect="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "rdma_vm/run.sh: unknown option '$1' (expected --timeout/--mem/--smp/--env/--cwd, then -- COMMAND)" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "rdma_vm/run.sh: no command given (usage: run.sh [options] -- COMMAND...)" >&2; exit 2; }
[[ "$timeout_s" =~ ^[0-9]+$ ]] || { echo "rdma_vm/run.sh: --timeout must be whole seconds, got '$timeout_s'" >&2; exit 2; }
command -v qemu-system-x86_64 >/dev/null || { echo "rdma_vm/run.sh: qemu-system-x86_64 not found (apt-get install qemu-system-x86)" >&2; exit 2; }

cache="$(timeout 900 "$here/build_assets.sh")"
xfer="$(mktemp -d "${TMPDIR:-/tmp}/rdma_vm.XXXXXX")"
trap 'rm -rf "$xfer"' EXIT
{
  echo "export HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8"
  echo "export DICOMM_IN_RDMA_VM=1"
  echo "mkdir -p /run/rdma_vm/out"
  for kv in "${envs[@]}"; do printf 'export %q\n' "$kv"; done
  printf 'cd %q || { echo "rdma_vm: the working directory %q is not visible in the guest" >&2; exit 121; }\n' "$cwd" "$cwd"
  printf 'exec timeout -k 10 %q' "$timeout_s"
  printf ' %q' "$@"
  echo
} > "$xfer/job.sh"

vm_limit=$((timeout_s + 120))
set +e
timeout -k 10 "$vm_limit" qemu-system-x86_64 -accel tcg -cpu max -smp "$smp" -m "$mem" \
  -nodefaults -no-reboot -display none -serial stdio -monitor none \
  -kernel "$cache/vmlinuz" -initrd "$cache/initrd.cpio.gz" \
  -append "console=ttyS0 loglevel=4 panic=-1 rdma_vm.msize=512000" \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
  -virtfs local,path="$xfer",mount_tag=xfer,security_model=none,multidevs=remap \
  < /dev/null
qrc=$?
set -e
if [ -n "$collect" ] && [ -d "$xfer/out" ]; then
  mkdir -p "$collect" && cp -r "$xfer/out/." "$collect/"
fi
if [ -f "$xfer/rc" ]; then
  exit "$(cat "$xfer/rc")"
elif [ $qrc -eq 124 ] || [ $qrc -eq 137 ]; then
  echo "rdma_vm/run.sh: the VM ran past its ${vm_limit}s limit and was killed" >&2
  exit 123
else
  echo "rdma_vm/run.sh: the guest stopped (qemu exit $qrc) without reporting an exit code" >&2
  exit 125
fi
