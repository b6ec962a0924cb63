#!/usr/bin/env bash
# Builds (once, cached) what the rdma qemu harness boots: Debian's stock kernel unpacked from
# the linux-image-amd64 .deb with `dpkg -x` (never installed on the host) and a busybox
# initramfs carrying only the modules the guest needs.
#
# Usage: scripts/rdma_vm/build_assets.sh [CACHE_DIR]      (default: build/rdma_vm)
# Prints the cache dir on success. Needs: apt-get (for `apt-get download`), dpkg, kmod's
# depmod/modprobe, busybox-static, cpio, gzip.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${1:-$repo/build/rdma_vm}"
mkdir -p "$cache/debs"
cache="$(cd "$cache" && pwd)"

die() { echo "rdma_vm/build_assets: $*" >&2; exit 1; }
for tool in dpkg depmod modprobe cpio gzip; do
  command -v "$tool" >/dev/null || die "missing host tool '$tool' (apt-get install kmod cpio dpkg)"
done
busybox="$(command -v busybox || true)"
[ -n "$busybox" ] || die "missing busybox (apt-get install busybox-static)"
# A dynamically linked busybox would need the host's libc inside the initramfs.
if file_out="$(LC_ALL=C readelf -l "$busybox" 2>/dev/null)" && grep -q 'INTERP' <<<"$file_out"; then
  die "$busybox is dynamically linked; install busybox-static"
fi

# 1. The kernel: the versioned package linux-image-amd64 points at.
deb="$(ls "$cache"/debs/linux-image-*-amd64_*.deb 2>/dev/null | head -n1 || true)"
if [ -z "$deb" ]; then
  resolve() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}'; }
  pkg="$(resolve)"
  if [ -z "$pkg" ] && [ "$(id -u)" = 0 ]; then  # a fresh machine may have no package lists yet
    timeout 900 apt-get update -qq >/dev/null 2>&1 || true
    pkg="$(resolve)"
  fi
  [ -n "$pkg" ] || die "apt-cache cannot resolve linux-image-amd64 (run apt-get update)"
  (cd "$cache/debs" && timeout 600 apt-get download -q "$pkg" >/dev/null 2>&1) \
    || die "apt-get download $pkg failed"
  deb="$(ls "$cache"/debs/linux-image-*-amd64_*.deb | head -n1)"
fi
if [ ! -f "$cache/kernel/.unpacked" ]; then
  rm -rf "$cache/kernel"
  dpkg -x "$deb" "$cache/kernel"
  touch "$cache/kernel/.unpacked"
fi
kver="$(ls "$cache/kernel/lib/modules" | head -n1)"
[ -n "$kver" ] || die "no modules in $deb"
vmlinuz="$cache/kernel/boot/vmlinuz-$kver"
[ -f "$vmlinuz" ] || die "no $vmlinuz in $deb"
[ -f "$cache/kernel/lib/modules/$kver/modules.dep" ] || depmod -b "$cache/kernel" "$kver"

# 2. The initramfs. Rebuilt when init.sh or the kernel changes.
stamp="$(cat "$here/init.sh" "$0" | sha1sum | cut -c1-12)-$kver"
initrd="$cache/initrd-$stamp.cpio.gz"
if [ ! -f "$initrd" ]; then
  stage="$(mktemp -d "$cache/initrd-stage.XXXXXX")"
  trap 'rm -rf "$stage"' EXIT
  mkdir -p "$stage"/{bin,sbin,proc,sys,dev,mnt/lower,mnt/rw,mnt/xfer,newroot,lib/modules}
  cp "$busybox" "$stage/bin/busybox"
  for applet in $("$stage/bin/busybox" --list); do
    [ -e "$stage/bin/$applet" ] || ln -s busybox "$stage/bin/$applet"
  done
  # Ordered insmod list: dependencies first, as modprobe would load them. The modules that
  # boot needs (virtio, 9p, overlay) come first; the rdma ones are loaded later by init.
  : > "$stage/lib/modules/load.boot"
  : > "$stage/lib/modules/load.rdma"
  add_module() {  # add_module <list> <module>
    modprobe -d "$cache/kernel" -S "$kver" --show-depends "$2" | awk '$1=="insmod"{print $2}' |
      while read -r ko; do
        rel="${ko#"$cache/kernel/lib/modules/$kver/"}"
        name="$(basename "$rel")"
        if ! grep -qx "$name" "$stage/lib/modules/"load.* ; then
          cp "$ko" "$stage/lib/modules/$name"
          echo "$name" >> "$stage/lib/modules/$1"
        fi
      done
  }
  for m in virtio_pci 9pnet_virtio 9p overlay; do add_module load.boot "$m"; done
  # rxe asks the crypto API for "crc32" (its ICRC) at link-add time; the kernel would
  # request_module it, but nothing in the initramfs can resolve that, so load it up front.
  for m in dummy crc32_generic ib_uverbs rdma_ucm rdma_rxe; do add_module load.rdma "$m"; done
  cp "$here/init.sh" "$stage/init"
  chmod +x "$stage/init"
  (cd "$stage" && find . -print0 | cpio --null -o -H newc --quiet | gzip -1) > "$initrd.tmp"
  mv "$initrd.tmp" "$initrd"
fi
ln -sfn "$(basename "$initrd")" "$cache/initrd.cpio.gz"
ln -sfn "kernel/boot/vmlinuz-$kver" "$cache/vmlinuz"
echo "$cache"
