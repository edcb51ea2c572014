//! Pod resources beyond the VM's own: QEMU's device and code buffers, the launcher, and the
//! kernel's per-process overhead; requests = limits so machine Pods get Guaranteed QoS.
//!
//! Measured (`make bench-launcher`, TCG, 1 vCPU, 256 MiB guest, test guest): QEMU RSS 391 MiB,
//! i.e. about 135 MiB beyond the guest's whole RAM; launcher RSS 8.4 MiB. The fixed 256 MiB
//! covers that with room for TCG's translation cache, which the launcher bounds at 128 MiB
//! (QEMU's default is 1 GiB). Under KVM there is no translation cache; a real Flatcar guest's
//! numbers come with the end-to-end benchmark.

use capk_api::v1alpha1::Accel;

/// Fixed memory overhead per machine Pod, MiB.
pub const FIXED_MIB: u64 = 256;
/// Memory overhead per vCPU, MiB.
pub const PER_VCPU_MIB: u64 = 16;
/// Memory overhead per GiB of VM memory (page tables, QEMU's RAM bookkeeping), MiB.
pub const PER_GIB_MIB: u64 = 16;
/// CPU overhead in millicores for the launcher, QEMU's I/O threads and the DHCP server.
pub const CPU_MILLIS: u64 = 250;

/// The TCG translation cache the fixed overhead already covers, MiB (the launcher's default).
pub const COVERED_TCG_CACHE_MIB: u64 = 128;

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
    let mib = FIXED_MIB
        + PER_VCPU_MIB * vcpus
        + PER_GIB_MIB * vm_bytes.div_ceil(1 << 30)
        + tcg_cache_mib.saturating_sub(COVERED_TCG_CACHE_MIB);
    mib << 20
}
