//! Tap creation through `/dev/net/tun` (the kernel refuses tap creation over rtnetlink).
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::Path;

use nix::errno::Errno;
use nix::libc::{self, IFF_NO_PI, IFF_TAP, IFF_VNET_HDR, IFNAMSIZ, TUNSETIFF, TUNSETPERSIST};

/// Where the tun/tap clone device lives.
pub const TUN_DEVICE: &str = "/dev/net/tun";

/// The flags the tap is created with: a tap (Ethernet frames), no packet-info header, and the
/// virtio-net header QEMU's vhost/offloads use.
const TAP_FLAGS: libc::c_int = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;

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

/// Opens `/dev/net/tun` attached to the tap `name` (created when absent): a descriptor that
/// reads and writes the tap's frames.
fn attach(name: &str) -> Result<File, TapError> {
    if name.len() >= IFNAMSIZ {
        return Err(TapError::Name(name.into()));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(TUN_DEVICE)
        .map_err(TapError::OpenTun)?;
    // SAFETY: `ifreq` is a plain C struct (a name array and a union of integers and
    // pointers) for which all-zero bytes are a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.as_bytes()) {
        *dst = *src as libc::c_char;
    }
    // The flags member of the union is a C short; the IFF_* values fit in it.
    req.ifr_ifru.ifru_flags = TAP_FLAGS as libc::c_short;
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is an open /dev/net/tun descriptor owned by `file`, alive for this call;
    // `req` is an initialised `struct ifreq` (name NUL-terminated because name.len() <
    // IFNAMSIZ) that TUNSETIFF reads and writes only within its own size.
    Errno::result(unsafe { libc::ioctl(fd, TUNSETIFF, &raw mut req) })
        .map_err(|e| TapError::SetIff(name.into(), e))?;
    Ok(file)
}

/// Creates a persistent tap named `name`, or makes an existing one persistent again. Returns
/// when the device exists.
pub fn create_persistent_tap(name: &str) -> Result<(), TapError> {
    let file = attach(name)?;
    let persist: libc::c_ulong = 1;
    // SAFETY: the descriptor is the tun file attached to the tap above, alive for this call;
    // TUNSETPERSIST takes an integer argument by value and touches no user memory.
    Errno::result(unsafe { libc::ioctl(file.as_raw_fd(), TUNSETPERSIST, persist) })
        .map_err(|e| TapError::Persist(name.into(), e))?;
    Ok(())
}

/// Opens the existing tap `name` for QEMU: the launcher holds the rights to open
/// `/dev/net/tun`, QEMU gets the descriptor (`-netdev tap,fd=N`). Close-on-exec like every
/// descriptor the launcher opens; the QEMU child keeps exactly the ones it is handed.
pub fn open_tap(name: &str) -> Result<File, TapError> {
    attach(name)
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    /// /proc/self belongs to the effective user.
    fn running_as_root() -> bool {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
    }

    /// A real tap in a network namespace of its own: created persistent, as a tap without the
    /// packet-info header and with the vnet header (what QEMU's `-netdev tap,vnet_hdr=on` needs).
    #[test]
    fn creates_a_persistent_tap_with_vnet_header() {
        if crate::testsupport::require_tool("ip", "apt-get install iproute2").is_none() {
            return;
        }
        if !tun_available() || !running_as_root() {
            assert!(
                std::env::var_os("CI").is_none(),
                "this test needs root and {TUN_DEVICE} (run the tests as root)"
            );
            eprintln!("skipping: needs root and {TUN_DEVICE}");
            return;
        }
        let ns = format!("capk-tap-{}", std::process::id());
        let ip = |args: &[&str]| {
            let out = Command::new("ip").args(args).output().unwrap();
            assert!(out.status.success(), "ip {args:?}: {out:?}");
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        ip(&["netns", "add", &ns]);
        let netns = format!("/run/netns/{ns}");
        let created = std::thread::spawn(move || {
            let f = std::fs::File::open(netns).unwrap();
            nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            create_persistent_tap("capk-tap0")
        })
        .join()
        .unwrap();
        let shown = ip(&["-n", &ns, "-d", "link", "show", "capk-tap0"]);
        ip(&["netns", "del", &ns]);
        created.unwrap();
        assert!(
            shown.contains("tun type tap pi off vnet_hdr on persist on"),
            "{shown}"
        );
        assert!(matches!(
            create_persistent_tap("a-name-of-16-chr"),
            Err(TapError::Name(_))
        ));
    }
}
