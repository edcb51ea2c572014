//! Whether the launcher runs in the host's own (initial) network namespace. There, binding "the
//! Pod's interface" would hand the node's address and MAC to the VM and serve DHCP on the node's
//! network, so `run` refuses before it touches any link.
//!
//! A container may have its own PID namespace, so comparing our netns with PID 1's proves
//! nothing (we may be PID 1). The kernel answers instead: it registers some `net.core` sysctls
//! only for the initial network namespace (the global table, for state that exists once per
//! kernel: the per-CPU backlog, the net message rate limit) and the rest once per namespace.
//! `/proc/sys/net` shows the sysctls of the reader's network namespace, whichever procfs mount
//! or PID namespace it reads through. Checked on this project's Debian 12 kernel (6.1):
//! `ip netns exec X ls /proc/sys/net/core` lists `somaxconn` but none of
//! [`INITIAL_NETNS_ONLY`]; the host's lists both. (`rmem_max` and `wmem_max` are no help: this
//! kernel registers them in every namespace.)

use std::path::Path;

/// Where the kernel shows the reader's `net.core` sysctls.
pub const CORE_SYSCTLS: &str = "/proc/sys/net/core";

/// `net.core` sysctls the kernel registers only for the initial network namespace. Any one of
/// them present means this is the host's namespace.
pub const INITIAL_NETNS_ONLY: [&str; 3] = ["netdev_max_backlog", "message_cost", "dev_weight"];

/// A `net.core` sysctl registered in every network namespace: its absence means `/proc/sys/net`
/// cannot be read at all, and then nothing can be told.
pub const EVERY_NETNS: &str = "somaxconn";

/// Which network namespace the launcher is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetnsKind {
    /// The host's own: the node's interfaces.
    Initial,
    /// A namespace of its own (a Pod's).
    Own,
}

/// The namespace could not be told.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot tell whether this is the host's network namespace: {0}/{EVERY_NETNS} is missing; \
     mount /proc (the launcher also needs /proc/sys/net for its bridge)"
)]
pub struct NetnsUnknown(pub String);

/// Classifies the namespace from the `net.core` sysctl directory the reader sees
/// ([`CORE_SYSCTLS`] in production).
pub fn classify(core_sysctls: &Path) -> Result<NetnsKind, NetnsUnknown> {
    if !core_sysctls.join(EVERY_NETNS).exists() {
        return Err(NetnsUnknown(core_sysctls.display().to_string()));
    }
    if INITIAL_NETNS_ONLY
        .iter()
        .any(|name| core_sysctls.join(name).exists())
    {
        Ok(NetnsKind::Initial)
    } else {
        Ok(NetnsKind::Own)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn core_dir(files: &[&str]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for f in files {
            std::fs::write(d.path().join(f), "0\n").unwrap();
        }
        d
    }

    #[test]
    fn global_sysctls_mean_the_initial_namespace() {
        let d = core_dir(&["somaxconn", "rmem_max", "netdev_max_backlog"]);
        assert_eq!(classify(d.path()).unwrap(), NetnsKind::Initial);
        let d = core_dir(&["somaxconn", "rmem_max", "wmem_max"]);
        assert_eq!(classify(d.path()).unwrap(), NetnsKind::Own);
        let d = core_dir(&[]);
        assert_eq!(
            classify(d.path()).unwrap_err().to_string(),
            format!(
                "cannot tell whether this is the host's network namespace: {}/somaxconn is \
                 missing; mount /proc (the launcher also needs /proc/sys/net for its bridge)",
                d.path().display()
            )
        );
    }

    /// The kernel's answer, not a fixture: a thread that moves to a fresh network namespace sees
    /// it as one of its own through the same /proc path.
    #[test]
    fn a_fresh_namespace_is_not_the_initial_one() {
        use nix::sched::{CloneFlags, unshare};
        let got = std::thread::spawn(|| {
            unshare(CloneFlags::CLONE_NEWNET)?;
            Ok::<_, nix::Error>(classify(Path::new(CORE_SYSCTLS)))
        })
        .join()
        .unwrap();
        match got {
            Ok(kind) => assert_eq!(kind.unwrap(), NetnsKind::Own),
            Err(e) => {
                assert!(
                    std::env::var_os("CI").is_none(),
                    "this test needs root to create a network namespace (run the tests as root): {e}"
                );
                eprintln!("skipping: unshare(CLONE_NEWNET): {e}");
            }
        }
    }
}
