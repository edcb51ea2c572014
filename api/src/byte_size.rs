//! Sizes as the controller writes them: Kubernetes quantities (`8Gi`, `40G`) or plain bytes,
//! parsed by the quantity parser the controller reads the spec with.

use std::fmt;
use std::str::FromStr;

use crate::quantity::{QuantityError, parse_bytes};

/// A size in bytes, parsed from a Kubernetes quantity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct ByteSize(pub u64);

/// Why a size could not be parsed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid size: {0}")]
pub struct ParseSizeError(#[from] QuantityError);

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

impl ByteSize {
    /// Size from mebibytes.
    pub const fn mib(n: u64) -> Self {
        ByteSize(n * MIB)
    }

    /// Size from gibibytes.
    pub const fn gib(n: u64) -> Self {
        ByteSize(n << 30)
    }

    /// Whole mebibytes, rounded up (what QEMU's `-m` takes).
    pub fn as_mib_ceil(self) -> u64 {
        self.0.div_ceil(MIB)
    }

    /// Bytes rounded up to a whole KiB (QEMU and the kernel want block-aligned disks).
    pub fn aligned_kib(self) -> u64 {
        self.0.div_ceil(KIB) * KIB
    }
}

impl FromStr for ByteSize {
    type Err = ParseSizeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(ByteSize(parse_bytes(s)?))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        if b != 0 && b.is_multiple_of(1 << 30) {
            write!(f, "{}Gi", b >> 30)
        } else if b != 0 && b.is_multiple_of(MIB) {
            write!(f, "{}Mi", b >> 20)
        } else {
            write!(f, "{b}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kubernetes_quantities() {
        assert_eq!("8Gi".parse(), Ok(ByteSize::gib(8)));
        assert_eq!("512Mi".parse(), Ok(ByteSize::mib(512)));
        assert_eq!("40G".parse(), Ok(ByteSize(40_000_000_000)));
        assert_eq!("1048576".parse(), Ok(ByteSize::mib(1)));
    }

    /// What the CRD admits (and the controller reads as a quantity) parses to the same value;
    /// what Kubernetes refuses is refused with the quantity parser's message.
    #[test]
    fn agrees_with_the_api_on_every_form() {
        for s in [
            "1.5Gi",
            "0.5Gi",
            "1e3",
            "+2k",
            "1500m",
            "1Pi",
            "8Gi",
            "40G",
            "1GB",
            "8 gigs",
            "K",
            "2K",
            "-1Gi",
            "",
            "99999999999999Ti",
        ] {
            assert_eq!(
                s.parse::<ByteSize>().ok().map(|b| b.0),
                parse_bytes(s).ok(),
                "{s:?}"
            );
        }
        assert_eq!("1.5Gi".parse(), Ok(ByteSize::mib(1536)));
        assert_eq!(
            "1GB".parse::<ByteSize>().unwrap_err().to_string(),
            "invalid size: \"1GB\" is not a Kubernetes quantity (examples: 1Gi, 512Mi, 20G)"
        );
    }

    #[test]
    fn rejects_garbage_and_overflow() {
        for bad in ["", "Gi", "-1Gi", "8 gigs", "99999999999999Ti"] {
            assert!(bad.parse::<ByteSize>().is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn rounds_memory_up_to_mib() {
        assert_eq!(ByteSize(8_000_000_000).as_mib_ceil(), 7630);
        assert_eq!(ByteSize::gib(2).as_mib_ceil(), 2048);
    }
}
