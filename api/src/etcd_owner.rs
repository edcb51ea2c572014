//! Who an etcd directory on an MC node belongs to: one contract for the controller (which tells
//! the machine Pod's launcher and the etcd cleanup Pod whose data it is), the launcher (which
//! writes the marker when it creates the etcd disk, and refuses a directory marked for another
//! KVMMachine) and the cleanup (`capk-launcher remove-etcd-data`, which removes only a directory
//! whose marker names the KVMMachine it was given).
//!
//! A path never says whose a directory is: a tenant chooses its namespace's name, its
//! KVMMachine's name and its `etcdStorage.hostPath`, and so can make its machine's directory
//! path name another tenant's directory, or a file in it. The marker can: only a launcher writes
//! it, as root, next to the etcd disk it creates, naming the KVMMachine's UID (unique over the
//! cluster's life). No marker means not ours: nothing is ever removed on a path's word alone.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The marker file in an etcd directory: [`EtcdOwner`] as one line of JSON.
pub const MARKER_FILE: &str = ".capk-owner";
/// The etcd disk in an etcd directory (the machine Pod's `--etcd-disk` names it).
pub const DISK_FILE: &str = "etcd.img";
/// Most bytes a marker may have: more is not a marker the launcher wrote.
pub const MAX_MARKER_BYTES: usize = 1024;
/// Exit code of `capk-launcher remove-etcd-data` when the directory is not the given
/// KVMMachine's (another's marker, no marker, not a directory): nothing was removed, and trying
/// again would not change that.
pub const CLEANUP_REFUSED_EXIT_CODE: i32 = 3;
/// Reason (the first word of the cleanup's termination message, and the controller's Warning
/// Event) of a refused cleanup.
pub const REASON_CLEANUP_REFUSED: &str = "EtcdCleanupRefused";

/// The KVMMachine an etcd directory belongs to. Written as `<namespace>/<name>/<uid>` on command
/// lines (no part holds a `/`: a namespace is a DNS label, a name a DNS subdomain, a UID a UUID)
/// and as JSON in the marker. All three must match: a KVMMachine deleted and made again under
/// the same name is another machine (another UID), and a UID alone is not a secret.
///
/// The UID is the one the machine's first Pod was made for, not necessarily the KVMMachine's
/// own: `clusterctl move` makes the KVMMachine again (same namespace and name, a new UID) while
/// its Pod and data stay, and the controller keeps naming the UID that Pod was given (it records
/// it in `status.etcdHostDir.ownerUID`, read from the Pod).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EtcdOwner {
    /// The KVMMachine's namespace (in the management cluster).
    pub namespace: String,
    /// The KVMMachine's name.
    pub name: String,
    /// The KVMMachine's UID.
    pub uid: String,
}

/// A command-line value that is not `<namespace>/<name>/<uid>`, or a marker that is not one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not <namespace>/<name>/<uid> of a KVMMachine")]
pub struct InvalidEtcdOwner(pub String);

impl EtcdOwner {
    /// Whether `marker` names this KVMMachine: namespace, name and UID.
    pub fn owns(&self, marker: &EtcdOwner) -> bool {
        self == marker
    }

    /// The marker's content: one line of JSON.
    pub fn marker(&self) -> String {
        let mut line = serde_json::to_string(self).unwrap_or_default();
        line.push('\n');
        line
    }

    /// The owner a marker names, when it is one a launcher wrote (at most
    /// [`MAX_MARKER_BYTES`], JSON, each part well formed).
    pub fn from_marker(bytes: &[u8]) -> Result<Self, InvalidEtcdOwner> {
        let shown = || {
            InvalidEtcdOwner(
                String::from_utf8_lossy(bytes)
                    .trim()
                    .chars()
                    .take(200)
                    .collect(),
            )
        };
        if bytes.len() > MAX_MARKER_BYTES {
            return Err(shown());
        }
        let owner: EtcdOwner = serde_json::from_slice(bytes).map_err(|_| shown())?;
        owner.check().map_err(|_| shown())?;
        Ok(owner)
    }

    fn check(&self) -> Result<(), ()> {
        // Letters, digits and `-` (and `.` where allowed), starting and ending in a letter
        // or digit: never `.`, `..` or anything a path or a shell would read otherwise.
        let part_ok = |s: &str, max: usize, dots: bool| {
            s.len() <= max
                && s.starts_with(|c: char| c.is_ascii_alphanumeric())
                && s.ends_with(|c: char| c.is_ascii_alphanumeric())
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || (dots && b == b'.'))
        };
        let ok = part_ok(&self.namespace, crate::constants::MAX_LABEL_LEN, false)
            && part_ok(&self.name, crate::constants::MAX_SUBDOMAIN_LEN, true)
            && part_ok(&self.uid, 128, false);
        if ok { Ok(()) } else { Err(()) }
    }
}

impl fmt::Display for EtcdOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.namespace, self.name, self.uid)
    }
}

impl FromStr for EtcdOwner {
    type Err = InvalidEtcdOwner;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = || InvalidEtcdOwner(s.to_owned());
        let mut parts = s.split('/');
        let (Some(namespace), Some(name), Some(uid), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(invalid());
        };
        let owner = EtcdOwner {
            namespace: namespace.into(),
            name: name.into(),
            uid: uid.into(),
        };
        owner.check().map_err(|_| invalid())?;
        Ok(owner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner() -> EtcdOwner {
        EtcdOwner {
            namespace: "team-a".into(),
            name: "demo-cp-x7k2p".into(),
            uid: "6f1c2a8e-0b7d-4c1e-9a53-2f0e8d7c6b5a".into(),
        }
    }

    #[test]
    fn the_command_line_and_the_marker_carry_the_same_owner() {
        let o = owner();
        let flag = o.to_string();
        assert_eq!(
            flag,
            "team-a/demo-cp-x7k2p/6f1c2a8e-0b7d-4c1e-9a53-2f0e8d7c6b5a"
        );
        assert_eq!(flag.parse::<EtcdOwner>().unwrap(), o);
        let marker = o.marker();
        assert!(
            marker.ends_with('\n') && marker.lines().count() == 1,
            "{marker}"
        );
        assert_eq!(EtcdOwner::from_marker(marker.as_bytes()).unwrap(), o);
    }

    #[test]
    fn namespace_name_and_uid_all_decide() {
        let o = owner();
        let recreated = EtcdOwner {
            uid: "0a0a0a0a-0000-4000-8000-000000000000".into(),
            ..o.clone()
        };
        assert!(!o.owns(&recreated), "same name, another machine");
        let elsewhere = EtcdOwner {
            namespace: "team-b".into(),
            ..o.clone()
        };
        assert!(!o.owns(&elsewhere), "same UID named by another namespace");
        let renamed = EtcdOwner {
            name: "demo-cp-other".into(),
            ..o.clone()
        };
        assert!(!o.owns(&renamed), "same UID named by another machine");
        assert!(o.owns(&o.clone()));
    }

    #[test]
    fn what_is_not_an_owner_is_refused() {
        for bad in [
            "",
            "team-a/demo",
            "team-a/demo/uid/extra",
            "team-a//uid",
            "../demo/uid",
            "team a/demo/uid",
        ] {
            assert!(bad.parse::<EtcdOwner>().is_err(), "{bad:?}");
        }
        for bad in [
            &b"not json"[..],
            br#"{"namespace":"a","name":"b"}"#,
            br#"{"namespace":"a/b","name":"b","uid":"c"}"#,
        ] {
            assert!(EtcdOwner::from_marker(bad).is_err(), "{bad:?}");
        }
        let huge = format!(
            r#"{{"namespace":"a","name":"b","uid":"c","pad":"{}"}}"#,
            "x".repeat(MAX_MARKER_BYTES)
        );
        assert!(EtcdOwner::from_marker(huge.as_bytes()).is_err());
    }
}
