//! Errors of the conversion. Every message names the key or value at fault and says what to do,
//! because the controller shows it verbatim in a condition and an Event.

use std::fmt;

/// Why bootstrap data could not be turned into an Ignition v3 config.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConvertError {
    /// The input is larger than [`crate::MAX_INPUT_BYTES`].
    #[error(
        "bootstrap data is {size} bytes, over the {limit}-byte limit; \
         move large files out of the KubeadmConfig (for example into the node image)"
    )]
    InputTooLarge { size: usize, limit: usize },

    /// The converted config is larger than [`crate::MAX_OUTPUT_BYTES`].
    #[error(
        "the Ignition config is {size} bytes, over the {limit}-byte limit \
         (it is stored in a Secret and read by the guest over fw_cfg); shrink the bootstrap files"
    )]
    OutputTooLarge { size: usize, limit: usize },

    /// The bootstrap Secret's `format` key holds something else than `cloud-config` or `ignition`.
    #[error("unknown bootstrap data format `{0}`; expected `cloud-config` or `ignition`")]
    UnknownFormat(String),

    /// The input is not UTF-8 text.
    #[error("bootstrap data is not valid UTF-8 (first bad byte at offset {offset})")]
    NotUtf8 { offset: usize },

    /// The cloud-config lacks its `#cloud-config` header line.
    #[error(
        "cloud-config does not start with a `#cloud-config` line (after an optional \
         `## template: jinja` line); shell scripts and MIME multipart user data are not supported"
    )]
    NotCloudConfig,

    /// A Jinja expression other than the machine placeholders.
    #[error(
        "unsupported Jinja expression `{expression}` on line {line}; only the hostname and \
         instance-id placeholders ({supported}) are substituted"
    )]
    UnsupportedTemplate {
        expression: String,
        line: usize,
        supported: &'static str,
    },

    /// The cloud-config is not YAML of the expected shape.
    #[error("cloud-config is not valid: {0}")]
    ParseCloudConfig(String),

    /// The Ignition input is not JSON of the expected shape.
    #[error("Ignition config is not valid: {0}")]
    ParseIgnition(String),

    /// The Ignition input declares a spec version this converter does not read.
    #[error(
        "Ignition spec version `{version}` is not supported; \
         give spec 2.3.0 (CABPK's `format: ignition`) or 3.0.0 to 3.5.0"
    )]
    UnsupportedIgnitionVersion { version: String },

    /// A key that has no faithful equivalent in the generated Ignition config.
    #[error("unsupported key `{key}`: {reason}")]
    UnsupportedKey { key: KeyPath, reason: String },

    /// A known key whose value cannot be converted.
    #[error("invalid value for `{key}`: {reason}")]
    InvalidValue { key: KeyPath, reason: String },

    /// The machine facts given by the caller are unusable.
    #[error("invalid machine {field} `{value}`: {reason}")]
    InvalidFacts {
        field: &'static str,
        value: String,
        reason: String,
    },
}

impl ConvertError {
    pub(crate) fn unsupported(key: impl Into<KeyPath>, reason: impl Into<String>) -> Self {
        Self::UnsupportedKey {
            key: key.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn invalid(key: impl Into<KeyPath>, reason: impl Into<String>) -> Self {
        Self::InvalidValue {
            key: key.into(),
            reason: reason.into(),
        }
    }
}

/// A key's location in the input, printed as `write_files[2].encoding`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyPath(String);

impl KeyPath {
    /// The path as printed in messages.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub(crate) fn field(&self, name: &str) -> KeyPath {
        if self.0.is_empty() {
            KeyPath(name.to_owned())
        } else {
            KeyPath(format!("{}.{name}", self.0))
        }
    }

    pub(crate) fn index(&self, i: usize) -> KeyPath {
        KeyPath(format!("{}[{i}]", self.0))
    }
}

impl From<&str> for KeyPath {
    fn from(s: &str) -> Self {
        KeyPath(s.to_owned())
    }
}

impl From<String> for KeyPath {
    fn from(s: String) -> Self {
        KeyPath(s)
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Formats a `serde_ignored` path as `a[0].b`.
pub(crate) fn ignored_path(path: &serde_ignored::Path<'_>) -> KeyPath {
    fn walk(path: &serde_ignored::Path<'_>, out: &mut String) {
        use serde_ignored::Path;
        match path {
            Path::Root => {}
            Path::Seq { parent, index } => {
                walk(parent, out);
                out.push_str(&format!("[{index}]"));
            }
            Path::Map { parent, key } => {
                walk(parent, out);
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Path::Some { parent }
            | Path::NewtypeStruct { parent }
            | Path::NewtypeVariant { parent } => walk(parent, out),
        }
    }
    let mut out = String::new();
    walk(path, &mut out);
    KeyPath(out)
}
