#!/bin/bash
# The node image's integration of upstream Ignition's dracut module (30ignition, installed
# unmodified with the `ignition` binary next to it by images/node/build.sh). Ignition's module
# only comes in when a distribution module asks for it; this is that module. What it adds:
# qemu_fw_cfg (the `qemu` platform's config source) and the virtio drivers of the launcher's VMs;
# ignition-disks with one Go thread (Ignition v2.26 races when it creates filesystems in
# parallel; see ignition-disks-gomaxprocs.conf); the initramfs journal's errors on the console.
# First-boot detection is the kernel's ignition.firstboot argument (syslinux.cfg), which
# capk-firstboot-done.service removes after the first boot.

check() {
    return 0
}

depends() {
    echo ignition
}

installkernel() {
    instmods qemu_fw_cfg virtio_pci virtio_blk virtio_scsi virtio_net virtio_console virtio_rng ext4 xfs
}

install() {
    # shellcheck disable=SC2154 # dracut sets moddir to this module's directory
    inst_simple "$moddir/ignition-disks-gomaxprocs.conf" \
        /etc/systemd/system/ignition-disks.service.d/10-capk-gomaxprocs.conf
    inst_simple "$moddir/journald-console.conf" /etc/systemd/journald.conf.d/10-capk-console.conf
}
