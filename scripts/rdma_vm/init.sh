#!/bin/sh
# /init of the rdma harness guest (busybox). Mounts the host's / read-only over 9p under a
# tmpfs overlay, brings up soft-RoCE (rxe0 on dummy0), runs the job the host left in the
# `xfer` 9p share, writes its exit code back there and powers off. Every step is bounded:
# a step that fails or times out ends the guest with a message and a distinct exit code.
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null

say() { echo "rdma_vm[guest]: $*" > /dev/console; }
XFER_OK=0
finish() {  # finish <rc> [message]
  [ -n "$2" ] && say "$2"
  if [ "$XFER_OK" = 1 ]; then echo "$1" > /mnt/xfer/rc; sync; fi
  poweroff -f
  sleep 5
}
step() {  # step <seconds> <description> <command...>: run with a time limit, die on failure
  secs="$1"; what="$2"; shift 2
  timeout "$secs" "$@" || finish 120 "step failed or timed out after ${secs}s: $what"
}
# /proc/cmdline carries rdma_vm.msize=N (9p message size).
msize=512000
for kv in $(cat /proc/cmdline); do
  case "$kv" in rdma_vm.msize=*) msize="${kv#rdma_vm.msize=}" ;; esac
done

for m in $(cat /lib/modules/load.boot); do step 30 "insmod $m" insmod "/lib/modules/$m"; done
step 30 "mount xfer share" mount -t 9p -o trans=virtio,version=9p2000.L,msize=$msize xfer /mnt/xfer
XFER_OK=1
[ -f /mnt/xfer/job.sh ] || finish 121 "no job.sh in the xfer share"
# The host root: read-only, cached (it does not change during a run), under a tmpfs overlay
# so the guest can write anywhere without touching the host.
step 60 "mount host root" mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=$msize hostroot /mnt/lower
step 10 "mount overlay tmpfs" mount -t tmpfs -o mode=0755 tmpfs /mnt/rw
mkdir -p /mnt/rw/upper /mnt/rw/work
step 30 "mount overlay" mount -t overlay overlay \
  -o lowerdir=/mnt/lower,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work /newroot
R=/newroot
mount -t proc proc $R/proc
mount -t sysfs sysfs $R/sys
mount -t devtmpfs devtmpfs $R/dev
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts devpts $R/dev/pts
mount -t tmpfs tmpfs $R/dev/shm
# /tmp stays the host's, through the overlay (writable, changes stay in the guest): the job's
# working directory may be a checkout under /tmp, as on CI machines.
mount -t tmpfs tmpfs $R/run
mkdir -p $R/run/rdma_vm
mount --bind /mnt/xfer $R/run/rdma_vm

# Soft-RoCE: the verbs modules, a dummy netdev with an IPv4 address (GID index 1), rxe0 on it.
for m in $(cat /lib/modules/load.rdma); do step 30 "insmod $m" insmod "/lib/modules/$m"; done
step 10 "lo up" ip link set lo up
# dummy.ko creates dummy0 itself (numdummies=1); add it only if a kernel did not.
[ -d /sys/class/net/dummy0 ] || step 10 "add dummy0" ip link add dummy0 type dummy
step 10 "address dummy0" ip addr add 10.77.0.1/24 dev dummy0
step 10 "dummy0 up" ip link set dummy0 up
step 30 "rdma link add rxe0" chroot $R rdma link add rxe0 type rxe netdev dummy0
n=0
until grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null; do
  n=$((n + 1)); [ $n -gt 100 ] && finish 122 "rxe0 port 1 never became ACTIVE"
  sleep 0.1
done
say "rxe0 ready: $(cat /sys/class/infiniband/rxe0/ports/1/state), gid[1] $(cat /sys/class/infiniband/rxe0/ports/1/gids/1 2>/dev/null)"

# The job: job.sh (written by run.sh) sets the environment, cwd and the command with its limit.
chroot $R /bin/sh /run/rdma_vm/job.sh > /dev/console 2>&1
rc=$?
say "job exited with $rc"
finish $rc
