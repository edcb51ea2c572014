//! Pod resources beyond the VM's own: QEMU's device and code buffers, the launcher, and the
//! kernel's per-process overhead; requests = limits so machine Pods get Guaranteed QoS.
//!
//! Measured: `make bench-launcher` (TCG, 1 vCPU, 256 MiB test guest): QEMU RSS 391 MiB; launcher
//! RSS 8.4 MiB. A Kubernetes worker of the node image (TCG, 1 vCPU, 1.5 GiB, 1 GiB translation
//! cache), killed by its Pod's memory limit while it imported images: QEMU's anonymous RSS was
//! 2727 MiB, i.e. guest RAM + the full translation cache + 167 MiB; the Pod's page cache (the
//! raw disks are written through the host's cache) came on top. The model used to count the
//! first 128 MiB of the cache inside the fixed 256 MiB, which left nothing for the page cache
//! and the launcher: the translation cache now counts in full, beside the fixed part. Under KVM
//! there is no translation cache. The memory emptyDir holding the merged Ignition until QEMU has
//! read it (at most 960 KiB, limited to 2 MiB) is charged to the Pod's memory too, within the
//! fixed part.

use capk_api::v1alpha1::Accel;

/// Fixed memory overhead per machine Pod, MiB.
pub const FIXED_MIB: u64 = 256;
/// Memory overhead per vCPU, MiB.
pub const PER_VCPU_MIB: u64 = 16;
/// Memory overhead per GiB of VM memory (page tables, QEMU's RAM bookkeeping), MiB.
pub const PER_GIB_MIB: u64 = 16;
/// CPU overhead in millicores for the launcher, QEMU's I/O threads and the DHCP server.
pub const CPU_MILLIS: u64 = 250;

/// The TCG translation cache a machine of `accel` may use, MiB: none under KVM, else the
/// controller's `--tcg-translation-cache-mib` (QEMU under `auto` falls back to TCG when KVM does
/// not work, and its cache then lives in the Pod's memory).
pub fn tcg_cache_mib(accel: Accel, configured_mib: u32) -> u64 {
    match accel {
        Accel::Kvm => 0,
        Accel::Auto | Accel::Tcg => u64::from(configured_mib),
    }
}

/// Memory overhead in bytes for a VM of `vcpus` vCPUs and `vm_bytes` of memory whose QEMU may
/// use a TCG translation cache of `tcg_cache_mib`.
pub fn memory_bytes(vcpus: u64, vm_bytes: u64, tcg_cache_mib: u64) -> u64 {
    let mib =
        FIXED_MIB + PER_VCPU_MIB * vcpus + PER_GIB_MIB * vm_bytes.div_ceil(1 << 30) + tcg_cache_mib;
    mib << 20
}

/// Ephemeral storage a machine Pod writes outside its sized volumes, MiB: the launcher's console
/// copy (at most two files of 4 MiB, launcher/src/console.rs), the container's log as the kubelet
/// keeps it (counted as the Pod's ephemeral storage; by default up to 5 files of 10 MiB,
/// `containerLogMaxFiles` × `containerLogMaxSize`), the tools emptyDir of a copied node image
/// (busybox, about 2 MiB), the runtime directory's sockets and the launcher's state file; the
/// rest is headroom for a kubelet that keeps a little more log.
pub const WRITABLE_MIB: u64 = 128;

/// The machine Pod's ephemeral-storage limit in bytes. The kubelet counts disk-backed emptyDirs
/// (the VM disks' volume; etcd's when it has no storage of its own) against the Pod's limit
/// together with the writable layer and the logs, so the limit is their size limits
/// (`volume_bytes`) plus [`WRITABLE_MIB`]: a limit of the writable part alone would evict the
/// Pod as soon as the guest filled its root disk's overlay.
pub fn ephemeral_storage_limit_bytes(volume_bytes: u64) -> u64 {
    volume_bytes + (WRITABLE_MIB << 20)
}
