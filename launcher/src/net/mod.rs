//! Pod network binding (the KubeVirt "bridge" recipe; steps in launcher/README.md, "Network"): the
//! VM takes the Pod's IP and MAC, the launcher keeps the IP on a dummy link (so the CNI's CHECK
//! still finds it) and serves DHCP to exactly that MAC. Known limits of the recipe upstream: no
//! IPv6, no live migration, no ipvlan CNIs.

pub mod apply;
pub mod dhcp;
pub mod netns;
pub mod observe;
pub mod plan;
pub mod resolv;
pub mod tap;

use std::fmt;
use std::str::FromStr;

/// An Ethernet MAC address.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// A random unicast, locally administered address from 6 random bytes.
    pub fn locally_administered(mut bytes: [u8; 6]) -> Self {
        bytes[0] = (bytes[0] & 0xfc) | 0x02;
        MacAddr(bytes)
    }

    /// A fresh random locally administered address.
    pub fn random() -> Self {
        let mut b = [0u8; 6];
        // Failure to read the kernel's RNG is not a reason to fail: fall back to time-based bytes.
        if std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
            .is_err()
        {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default();
            b.copy_from_slice(&t.to_le_bytes()[..6]);
        }
        Self::locally_administered(b)
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            b[0], b[1], b[2], b[3], b[4], b[5]
        )
    }
}

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl serde::Serialize for MacAddr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for MacAddr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Why a MAC address could not be parsed.
#[derive(Debug, thiserror::Error)]
#[error("invalid MAC address {0:?}")]
pub struct ParseMacError(String);

impl FromStr for MacAddr {
    type Err = ParseMacError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for byte in &mut out {
            let p = parts.next().ok_or_else(|| ParseMacError(s.into()))?;
            *byte = u8::from_str_radix(p, 16).map_err(|_| ParseMacError(s.into()))?;
        }
        if parts.next().is_some() {
            return Err(ParseMacError(s.into()));
        }
        Ok(MacAddr(out))
    }
}

impl TryFrom<&[u8]> for MacAddr {
    type Error = ParseMacError;
    fn try_from(v: &[u8]) -> Result<Self, Self::Error> {
        let a: [u8; 6] = v
            .try_into()
            .map_err(|_| ParseMacError(format!("{v:02x?}")))?;
        Ok(MacAddr(a))
    }
}
