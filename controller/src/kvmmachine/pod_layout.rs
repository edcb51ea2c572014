//! Where things are in the machine Pod: the directories the launcher is pointed at, and the
//! volumes and mounts that put them there.

use k8s_openapi::api::core::v1::{HostPathVolumeSource, Volume, VolumeMount};

/// Where the Ignition Secret is mounted in the machine Pod.
pub const IGNITION_DIR: &str = "/etc/capk/ignition";
/// Where the launcher writes the merged Ignition config for QEMU (`--secret-dir`): a memory
/// volume, so bootstrap secrets never reach the node's disk.
pub const SECRET_DIR: &str = "/run/capk-secret";
/// Size limit of the memory volume at [`SECRET_DIR`]: the merged config is at most
/// `capk_bootstrap::MAX_OUTPUT_BYTES` (960 KiB) and is removed once QEMU has read it.
pub const SECRET_VOLUME_SIZE: &str = "2Mi";
/// Where the VM disks live in the Pod (an emptyDir: survives container restarts).
pub const STATE_DIR: &str = "/var/lib/capk/state";
/// Where the node image is mounted read-only.
pub const IMAGE_DIR: &str = "/var/lib/capk/image";
/// Where the etcd disk's directory is mounted (control plane).
pub const ETCD_DIR: &str = "/var/lib/capk/etcd";

/// A hostPath volume.
pub fn host_path(name: &str, path: &str, type_: &str) -> Volume {
    Volume {
        name: name.into(),
        host_path: Some(HostPathVolumeSource {
            path: path.into(),
            type_: Some(type_.into()),
        }),
        ..Default::default()
    }
}

/// A volume mount, read-only when `read_only`.
pub fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: read_only.then_some(true),
        ..Default::default()
    }
}
