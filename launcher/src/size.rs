//! Sizes as the controller writes them: Kubernetes quantities (`8Gi`, `40G`) or plain bytes.

use std::fmt;
use std::str::FromStr;

/// A size in bytes, parsed from a Kubernetes-style quantity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct ByteSize(pub u64);

/// Why a size could not be parsed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "invalid size {input:?}: expected a number with an optional unit (Ki, Mi, Gi, Ti, K, M, G, T, KB, MB, GB, TB)"
)]
pub struct ParseSizeError {
    input: String,
}

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
        let err = || ParseSizeError {
            input: s.to_string(),
        };
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        if num.is_empty() {
            return Err(err());
        }
        let n: u64 = num.parse().map_err(|_| err())?;
        let mult: u64 = match unit.trim() {
            "" => 1,
            "Ki" => 1 << 10,
            "Mi" => 1 << 20,
            "Gi" => 1 << 30,
            "Ti" => 1 << 40,
            "K" | "KB" | "k" => 1_000,
            "M" | "MB" => 1_000_000,
            "G" | "GB" => 1_000_000_000,
            "T" | "TB" => 1_000_000_000_000,
            _ => return Err(err()),
        };
        n.checked_mul(mult).map(ByteSize).ok_or_else(err)
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
        assert_eq!("8GB".parse(), Ok(ByteSize(8_000_000_000)));
        assert_eq!("1048576".parse(), Ok(ByteSize::mib(1)));
    }

    #[test]
    fn rejects_garbage_and_overflow() {
        for bad in ["", "Gi", "-1Gi", "1.5Gi", "8 gigs", "99999999999999Ti"] {
            assert!(bad.parse::<ByteSize>().is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn rounds_memory_up_to_mib() {
        assert_eq!(ByteSize(8_000_000_000).as_mib_ceil(), 7630);
        assert_eq!(ByteSize::gib(2).as_mib_ceil(), 2048);
    }
}
