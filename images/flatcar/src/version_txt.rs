//! `version.txt` of a release directory: how `current` becomes a concrete version.
//!
//! Flatcar's `build_image` writes it as shell assignments:
//!
//! ```text
//! FLATCAR_BUILD=4230
//! FLATCAR_BRANCH=2
//! FLATCAR_PATCH=3
//! FLATCAR_VERSION=4230.2.3
//! FLATCAR_VERSION_ID=4230.2.3
//! FLATCAR_BUILD_ID=""
//! FLATCAR_SDK_VERSION=4230.0.0
//! ```
//!
//! Official releases have an empty build id and `FLATCAR_VERSION == FLATCAR_VERSION_ID`;
//! development builds append `+<build id>` and are refused here.

use std::collections::BTreeMap;

use thiserror::Error;

use crate::release::{FlatcarVersion, canonical_number};

/// Errors of parsing a `version.txt`.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum VersionTxtError {
    /// A line that is not `KEY=VALUE`.
    #[error("version.txt line {line}: expected KEY=VALUE, found {text:?}")]
    Syntax {
        /// 1-based line number.
        line: usize,
        /// The offending line.
        text: String,
    },
    /// A key given twice.
    #[error("version.txt line {line}: {key} is set twice")]
    Duplicate {
        /// 1-based line number of the second assignment.
        line: usize,
        /// The key.
        key: String,
    },
    /// A required key is absent.
    #[error("version.txt has no {0}: is this a Flatcar release directory?")]
    Missing(&'static str),
    /// A field that is not what Flatcar writes.
    #[error("version.txt: {key}={value:?} is not {expected}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// Its value.
        value: String,
        /// What it should look like.
        expected: &'static str,
    },
    /// Fields that contradict each other.
    #[error("version.txt is inconsistent: {0}")]
    Inconsistent(String),
}

/// The facts of a release's `version.txt`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionTxt {
    /// The release, from `FLATCAR_VERSION_ID` (checked against BUILD/BRANCH/PATCH and VERSION).
    pub version: FlatcarVersion,
    /// `FLATCAR_SDK_VERSION`, when present.
    pub sdk_version: Option<String>,
}

impl VersionTxt {
    /// Parses and cross-checks a `version.txt`.
    pub fn parse(text: &str) -> Result<Self, VersionTxtError> {
        let mut fields = BTreeMap::new();
        for (index, raw) in text.lines().enumerate() {
            let line = index + 1;
            let trimmed = raw.trim();
            if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
            let syntax = || VersionTxtError::Syntax {
                line,
                text: raw.into(),
            };
            let (key, value) = trimmed.split_once('=').ok_or_else(syntax)?;
            let key_ok = !key.is_empty()
                && key
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
            if !key_ok {
                return Err(syntax());
            }
            let value = unquote(value).ok_or_else(syntax)?;
            if fields.insert(key.to_owned(), value.to_owned()).is_some() {
                return Err(VersionTxtError::Duplicate {
                    line,
                    key: key.into(),
                });
            }
        }
        let get = |key: &'static str| {
            fields
                .get(key)
                .map(String::as_str)
                .ok_or(VersionTxtError::Missing(key))
        };
        let number = |key: &'static str| -> Result<u32, VersionTxtError> {
            let value = get(key)?;
            canonical_number(value).ok_or_else(|| VersionTxtError::Invalid {
                key,
                value: value.into(),
                expected: "a decimal number",
            })
        };

        let id_text = get("FLATCAR_VERSION_ID")?;
        let version: FlatcarVersion = id_text.parse().map_err(|_| VersionTxtError::Invalid {
            key: "FLATCAR_VERSION_ID",
            value: id_text.into(),
            expected: "a release version like 4230.2.3",
        })?;
        let parts = FlatcarVersion {
            build: number("FLATCAR_BUILD")?,
            branch: number("FLATCAR_BRANCH")?,
            patch: number("FLATCAR_PATCH")?,
        };
        if parts != version {
            return Err(VersionTxtError::Inconsistent(format!(
                "FLATCAR_VERSION_ID is {version} but BUILD.BRANCH.PATCH is {parts}"
            )));
        }
        let full = get("FLATCAR_VERSION")?;
        if full != id_text {
            return Err(VersionTxtError::Inconsistent(format!(
                "FLATCAR_VERSION {full:?} differs from FLATCAR_VERSION_ID {id_text:?}: \
                 a development build, not an official release"
            )));
        }
        if let Some(build_id) = fields.get("FLATCAR_BUILD_ID").filter(|b| !b.is_empty()) {
            return Err(VersionTxtError::Inconsistent(format!(
                "FLATCAR_BUILD_ID is {build_id:?}: a development build, not an official release"
            )));
        }
        Ok(VersionTxt {
            version,
            sdk_version: fields.get("FLATCAR_SDK_VERSION").cloned(),
        })
    }
}

/// The value of a shell assignment: bare, or in one pair of double quotes without escapes.
fn unquote(value: &str) -> Option<&str> {
    let inner = match value.strip_prefix('"') {
        Some(rest) => rest.strip_suffix('"')?,
        None => value,
    };
    let plain = inner
        .chars()
        .all(|c| !c.is_whitespace() && !c.is_control() && !"\"'\\$`".contains(c));
    plain.then_some(inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    const STABLE: &str = "FLATCAR_BUILD=4230\nFLATCAR_BRANCH=2\nFLATCAR_PATCH=3\n\
        FLATCAR_VERSION=4230.2.3\nFLATCAR_VERSION_ID=4230.2.3\nFLATCAR_BUILD_ID=\"\"\n\
        FLATCAR_SDK_VERSION=4230.0.0\n";

    #[test]
    fn a_stable_release_resolves_to_its_version() {
        let parsed = VersionTxt::parse(STABLE).unwrap();
        assert_eq!(parsed.version.to_string(), "4230.2.3");
        assert_eq!(parsed.sdk_version.as_deref(), Some("4230.0.0"));
    }

    #[test]
    fn comments_blank_lines_crlf_and_quotes_are_accepted() {
        let text = "# written by build_image\r\n\r\nFLATCAR_BUILD=\"3602\"\r\nFLATCAR_BRANCH=0\r\n\
            FLATCAR_PATCH=0\r\nFLATCAR_VERSION=3602.0.0\r\nFLATCAR_VERSION_ID=\"3602.0.0\"\r\n";
        let parsed = VersionTxt::parse(text).unwrap();
        assert_eq!(parsed.version.to_string(), "3602.0.0");
        assert_eq!(parsed.sdk_version, None);
    }

    fn with(replace: &str, by: &str) -> String {
        assert!(STABLE.contains(replace), "{replace}");
        STABLE.replace(replace, by)
    }

    #[test]
    fn malformed_files_are_rejected_with_the_reason() {
        let cases: Vec<(String, VersionTxtError)> =
            vec![
            (
                with("FLATCAR_PATCH=3\n", "FLATCAR_PATCH 3\n"),
                VersionTxtError::Syntax {
                    line: 3,
                    text: "FLATCAR_PATCH 3".into(),
                },
            ),
            (
                with("FLATCAR_PATCH=3\n", "FLATCAR_PATCH=$(reboot)\n"),
                VersionTxtError::Syntax {
                    line: 3,
                    text: "FLATCAR_PATCH=$(reboot)".into(),
                },
            ),
            (
                with("FLATCAR_BUILD=4230\n", "flatcar_build=4230\n"),
                VersionTxtError::Syntax {
                    line: 1,
                    text: "flatcar_build=4230".into(),
                },
            ),
            (
                format!("{STABLE}FLATCAR_PATCH=4\n"),
                VersionTxtError::Duplicate {
                    line: 8,
                    key: "FLATCAR_PATCH".into(),
                },
            ),
            (
                with("FLATCAR_VERSION_ID=4230.2.3\n", ""),
                VersionTxtError::Missing("FLATCAR_VERSION_ID"),
            ),
            (
                with("FLATCAR_BRANCH=2\n", ""),
                VersionTxtError::Missing("FLATCAR_BRANCH"),
            ),
            (
                "<html><body>404 Not Found</body></html>\n".into(),
                VersionTxtError::Syntax {
                    line: 1,
                    text: "<html><body>404 Not Found</body></html>".into(),
                },
            ),
            (String::new(), VersionTxtError::Missing("FLATCAR_VERSION_ID")),
            (
                with("FLATCAR_VERSION_ID=4230.2.3", "FLATCAR_VERSION_ID=4230.2"),
                VersionTxtError::Invalid {
                    key: "FLATCAR_VERSION_ID",
                    value: "4230.2".into(),
                    expected: "a release version like 4230.2.3",
                },
            ),
            (
                with("FLATCAR_PATCH=3", "FLATCAR_PATCH=x"),
                VersionTxtError::Invalid {
                    key: "FLATCAR_PATCH",
                    value: "x".into(),
                    expected: "a decimal number",
                },
            ),
            (
                with("FLATCAR_PATCH=3", "FLATCAR_PATCH=4"),
                VersionTxtError::Inconsistent(
                    "FLATCAR_VERSION_ID is 4230.2.3 but BUILD.BRANCH.PATCH is 4230.2.4".into(),
                ),
            ),
            (
                with(
                    "FLATCAR_VERSION=4230.2.3",
                    "FLATCAR_VERSION=4230.2.3+nightly-20260821-2100",
                ),
                VersionTxtError::Inconsistent(
                    "FLATCAR_VERSION \"4230.2.3+nightly-20260821-2100\" differs from \
                     FLATCAR_VERSION_ID \"4230.2.3\": a development build, not an official release"
                        .into(),
                ),
            ),
            (
                with(
                    "FLATCAR_BUILD_ID=\"\"",
                    "FLATCAR_BUILD_ID=\"nightly-20260821-2100\"",
                ),
                VersionTxtError::Inconsistent(
                    "FLATCAR_BUILD_ID is \"nightly-20260821-2100\": a development build, not an \
                     official release"
                        .into(),
                ),
            ),
        ];
        for (text, want) in cases {
            assert_eq!(VersionTxt::parse(&text), Err(want), "{text}");
        }
    }

    #[test]
    fn errors_read_as_sentences() {
        let err = VersionTxt::parse("").unwrap_err();
        assert_eq!(
            err.to_string(),
            "version.txt has no FLATCAR_VERSION_ID: is this a Flatcar release directory?"
        );
    }
}
