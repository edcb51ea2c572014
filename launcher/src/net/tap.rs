//! Tap creation through `/dev/net/tun` (the kernel refuses tap creation over rtnetlink).
#![allow(unsafe_code)]

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Where the tun/tap clone device lives.
pub const TUN_DEVICE: &str = "/dev/net/tun";

const IFF_TAP: libc_short = 0x0002;
const IFF_NO_PI: libc_short = 0x1000;
const IFF_VNET_HDR: libc_short = 0x4000;
const IFNAMSIZ: usize = 16;

#[allow(non_camel_case_types)]
type libc_short = i16;

/// `struct ifreq` as TUNSETIFF reads it: the name and the flags union member.
#[repr(C)]
struct IfReq {
    name: [u8; IFNAMSIZ],
    flags: libc_short,
    _pad: [u8; 22],
}

nix::ioctl_write_int!(tun_set_persist, b'T', 203);
nix::ioctl_write_ptr!(tun_set_iff, b'T', 202, libc_int);

#[allow(non_camel_case_types)]
type libc_int = i32;

/// Tap creation failures.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    /// `/dev/net/tun` missing or not openable.
    #[error(
        "open {TUN_DEVICE}: the Pod needs the tun device (mount /dev/net/tun, privileged or NET_ADMIN)"
    )]
    OpenTun(#[source] std::io::Error),
    /// Name too long for the kernel.
    #[error("tap name {0:?} is longer than 15 bytes")]
    Name(String),
    /// TUNSETIFF failed.
    #[error("TUNSETIFF {0}")]
    SetIff(String, #[source] nix::Error),
    /// TUNSETPERSIST failed.
    #[error("TUNSETPERSIST {0}")]
    Persist(String, #[source] nix::Error),
}

/// Whether the tun device node exists (checked before touching the network).
pub fn tun_available() -> bool {
    Path::new(TUN_DEVICE).exists()
}

/// Creates a persistent tap named `name` (QEMU attaches to it by name later), or makes an
/// existing one persistent again. Returns when the device exists.
pub fn create_persistent_tap(name: &str) -> Result<(), TapError> {
    if name.len() >= IFNAMSIZ {
        return Err(TapError::Name(name.into()));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(TUN_DEVICE)
        .map_err(TapError::OpenTun)?;
    let mut req = IfReq {
        name: [0; IFNAMSIZ],
        flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is an open /dev/net/tun descriptor owned by `file`, alive for this call;
    // `req` is a properly sized, initialised `struct ifreq` (name NUL-terminated because
    // name.len() < IFNAMSIZ) that the kernel only reads and writes within its 40 bytes.
    unsafe { tun_set_iff(fd, (&raw const req).cast::<libc_int>()) }
        .map_err(|e| TapError::SetIff(name.into(), e))?;
    // SAFETY: `fd` is the tun descriptor attached to the tap above; TUNSETPERSIST takes an
    // integer argument by value and touches no user memory.
    unsafe { tun_set_persist(fd, 1) }.map_err(|e| TapError::Persist(name.into(), e))?;
    Ok(())
}
