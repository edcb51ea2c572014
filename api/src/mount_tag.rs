//! The virtio-9p mount tag of a host volume: one rule for the CRD (CEL), the bootstrap overlay
//! (the guest's mount unit) and the launcher (`--host-volume TAG=PATH`), so that whatever the
//! apiserver admits also boots.
//!
//! The guest mounts a tag at `/data/<tag>`, so `.` is not allowed (`..` would mount over `/`),
//! and the launcher's `--host-volume` list is comma-separated, so neither is `,`.

/// The rule as a regular expression; the literal is written once, here.
macro_rules! pattern {
    () => {
        "^[A-Za-z0-9_-]{1,31}$"
    };
}

/// Longest tag QEMU's virtio-9p device accepts.
pub const MAX_LEN: usize = 31;

/// The rule as a regular expression (what the CRD's CEL rule matches).
pub const PATTERN: &str = pattern!();

/// The CRD's CEL rule for `spec.hostVolumes[].mountTag`.
pub const CEL_RULE: &str = concat!("self.matches('", pattern!(), "')");

/// The rule in words.
macro_rules! rule {
    () => {
        "1-31 characters long (the virtio-9p tag limit), of letters, digits, '_' and '-' only"
    };
}

/// The rule in words, for error messages of every layer.
pub const RULE: &str = rule!();

/// The CRD's message when [`CEL_RULE`] fails.
pub const CEL_MESSAGE: &str = concat!("mountTag must be ", rule!());

/// A mount tag that breaks the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("mount tag {tag:?} must be {RULE}")]
pub struct InvalidMountTag {
    /// The tag as given.
    pub tag: String,
}

/// Whether `tag` is a mount tag every layer accepts (the same rule as [`PATTERN`]).
pub fn check(tag: &str) -> Result<(), InvalidMountTag> {
    let ok = !tag.is_empty()
        && tag.len() <= MAX_LEN
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(InvalidMountTag { tag: tag.into() })
    }
}

/// Tags on both sides of the rule: the CRD test (real apiserver), the bootstrap overlay test and
/// the launcher test each check that their layer agrees with [`check`] on every one of them.
pub const EXAMPLES: &[&str] = &[
    "data",
    "Data_1",
    "a-b",
    "x",
    "a23456789012345678901234567890b",
    "",
    "a234567890123456789012345678901b",
    "a.b",
    ".",
    "..",
    "a,b",
    "a b",
    "a/b",
    "a=b",
    "dätä",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dots_commas_and_long_tags_are_refused_with_the_rule() {
        for ok in ["data", "Data_1", "a-b", &"a".repeat(31)] {
            assert_eq!(check(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            ".",
            "..",
            "a.b",
            "a,b",
            "a b",
            "a/b",
            "dätä",
            &"a".repeat(32),
        ] {
            assert_eq!(
                check(bad).unwrap_err().to_string(),
                format!("mount tag {bad:?} must be {RULE}")
            );
        }
    }

    #[test]
    fn the_cel_rule_is_the_pattern() {
        assert_eq!(CEL_RULE, format!("self.matches('{PATTERN}')"));
        assert!(PATTERN.contains(&format!("{{1,{MAX_LEN}}}")));
    }
}
