//! `<file>.DIGESTS` of a Flatcar release, and checking a file's SHA-512 against it.
//!
//! The format (Gentoo's, written by Flatcar's `create_digests`): a `# <ALGO> HASH` header line
//! per algorithm, each followed by `sha512sum`-style lines `<hex>  <file name>`:
//!
//! ```text
//! # MD5 HASH
//! 0123…  flatcar_production_qemu_image.img
//! # SHA1 HASH
//! 89ab…  flatcar_production_qemu_image.img
//! # SHA512 HASH
//! cdef…  flatcar_production_qemu_image.img
//! ```

use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Errors of parsing a DIGESTS file or of checking a file against it.
#[derive(Debug, Error)]
pub enum DigestsError {
    /// A digest line before any `# ALGO HASH` header.
    #[error("DIGESTS line {0}: digest before any '# <ALGO> HASH' header")]
    NoSection(usize),
    /// A line that is neither a header nor `<hex>  <name>`.
    #[error("DIGESTS line {line}: expected '<hex>  <file name>', found {text:?}")]
    Syntax {
        /// 1-based line number.
        line: usize,
        /// The offending line.
        text: String,
    },
    /// A digest of the wrong length or with non-hex characters.
    #[error("DIGESTS line {line}: {algorithm} digest must be {len} hex digits, found {text:?}")]
    BadDigest {
        /// 1-based line number.
        line: usize,
        /// The section's algorithm.
        algorithm: String,
        /// Expected number of hex digits.
        len: usize,
        /// The offending digest.
        text: String,
    },
    /// The clearsigned `.DIGESTS.asc` was given where the plain file was expected.
    #[error(
        "this is the clearsigned .DIGESTS.asc; pass the plain .DIGESTS file (its signature is \
         checked through the image's .sig)"
    )]
    Clearsigned,
    /// No SHA-512 digest for the file.
    #[error("DIGESTS has no SHA512 digest for {name:?} (it lists {listed:?}): wrong DIGESTS file?")]
    NotListed {
        /// The file name looked up.
        name: String,
        /// The names with a SHA-512 digest.
        listed: Vec<String>,
    },
    /// Two different SHA-512 digests for the same file.
    #[error("DIGESTS lists two different SHA512 digests for {0:?}")]
    Ambiguous(String),
    /// Reading the file to hash failed.
    #[error("read {path} to compute its SHA-512")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The file's digest differs from the listed one.
    #[error(
        "SHA-512 of {path} is {actual}, but DIGESTS lists {expected} for {name:?}: the download \
         is incomplete or was altered; delete it and fetch again"
    )]
    Mismatch {
        /// The file checked.
        path: PathBuf,
        /// Its name in DIGESTS.
        name: String,
        /// The listed digest.
        expected: String,
        /// The computed digest.
        actual: String,
    },
}

/// A hash algorithm of a DIGESTS section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HashAlgorithm {
    /// `# MD5 HASH`.
    Md5,
    /// `# SHA1 HASH`.
    Sha1,
    /// `# SHA512 HASH`.
    Sha512,
    /// Any other `# <NAME> HASH` section (e.g. a future BLAKE2); kept, never trusted.
    Other(String),
}

impl HashAlgorithm {
    fn from_header(name: &str) -> Self {
        match name.to_ascii_uppercase().as_str() {
            "MD5" => HashAlgorithm::Md5,
            "SHA1" => HashAlgorithm::Sha1,
            "SHA512" => HashAlgorithm::Sha512,
            other => HashAlgorithm::Other(other.into()),
        }
    }

    /// Hex digits of a digest, when known.
    fn hex_len(&self) -> Option<usize> {
        match self {
            HashAlgorithm::Md5 => Some(32),
            HashAlgorithm::Sha1 => Some(40),
            HashAlgorithm::Sha512 => Some(128),
            HashAlgorithm::Other(_) => None,
        }
    }

    fn name(&self) -> &str {
        match self {
            HashAlgorithm::Md5 => "MD5",
            HashAlgorithm::Sha1 => "SHA1",
            HashAlgorithm::Sha512 => "SHA512",
            HashAlgorithm::Other(name) => name,
        }
    }
}

/// One `<hex>  <name>` line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DigestEntry {
    /// The section it is in.
    pub algorithm: HashAlgorithm,
    /// The digest, lower-case hex.
    pub hex: String,
    /// The file name (a `*` binary-mode marker removed).
    pub name: String,
}

/// A parsed DIGESTS file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Digests {
    /// Entries in file order.
    pub entries: Vec<DigestEntry>,
}

impl Digests {
    /// Parses a DIGESTS file.
    pub fn parse(text: &str) -> Result<Self, DigestsError> {
        if text.starts_with("-----BEGIN PGP SIGNED MESSAGE-----") {
            return Err(DigestsError::Clearsigned);
        }
        let mut section: Option<HashAlgorithm> = None;
        let mut entries = Vec::new();
        for (index, raw) in text.lines().enumerate() {
            let line = index + 1;
            let trimmed = raw.trim_end();
            if trimmed.trim().is_empty() {
                continue;
            }
            let syntax = || DigestsError::Syntax {
                line,
                text: raw.into(),
            };
            if let Some(header) = trimmed.strip_prefix('#') {
                let mut words = header.split_whitespace();
                match (words.next(), words.next(), words.next()) {
                    (Some(name), Some(hash), None) if hash.eq_ignore_ascii_case("HASH") => {
                        section = Some(HashAlgorithm::from_header(name));
                        continue;
                    }
                    _ => return Err(syntax()),
                }
            }
            let algorithm = section.clone().ok_or(DigestsError::NoSection(line))?;
            let (hex, rest) = trimmed.split_once(' ').ok_or_else(syntax)?;
            // sha512sum writes two spaces (text mode) or " *" (binary mode).
            let name = rest
                .strip_prefix(' ')
                .or_else(|| rest.strip_prefix('*'))
                .ok_or_else(syntax)?;
            if name.is_empty() || name.contains('/') {
                return Err(syntax());
            }
            let hex_ok = hex.bytes().all(|b| b.is_ascii_hexdigit())
                && algorithm.hex_len().is_none_or(|len| hex.len() == len);
            if !hex_ok {
                return Err(DigestsError::BadDigest {
                    line,
                    algorithm: algorithm.name().into(),
                    len: algorithm.hex_len().unwrap_or(0),
                    text: hex.into(),
                });
            }
            entries.push(DigestEntry {
                algorithm,
                hex: hex.to_ascii_lowercase(),
                name: name.into(),
            });
        }
        Ok(Digests { entries })
    }

    /// The SHA-512 digest listed for `name`.
    pub fn sha512_of(&self, name: &str) -> Result<&str, DigestsError> {
        let mut found: Option<&str> = None;
        for entry in self
            .entries
            .iter()
            .filter(|e| e.algorithm == HashAlgorithm::Sha512 && e.name == name)
        {
            match found {
                Some(hex) if hex != entry.hex => {
                    return Err(DigestsError::Ambiguous(name.into()));
                }
                _ => found = Some(&entry.hex),
            }
        }
        found.ok_or_else(|| DigestsError::NotListed {
            name: name.into(),
            listed: self
                .entries
                .iter()
                .filter(|e| e.algorithm == HashAlgorithm::Sha512)
                .map(|e| e.name.clone())
                .collect(),
        })
    }

    /// Checks `path` against the SHA-512 listed for `name`; returns the digest.
    pub fn verify_sha512(&self, path: &Path, name: &str) -> Result<String, DigestsError> {
        let expected = self.sha512_of(name)?;
        let actual = sha512_file(path).map_err(|source| DigestsError::Read {
            path: path.into(),
            source,
        })?;
        if actual != expected {
            return Err(DigestsError::Mismatch {
                path: path.into(),
                name: name.into(),
                expected: expected.into(),
                actual,
            });
        }
        Ok(actual)
    }
}

/// The SHA-512 of a file, lower-case hex.
pub fn sha512_file(path: &Path) -> io::Result<String> {
    digest_file(path, &ring::digest::SHA512)
}

/// The SHA-256 of a file, lower-case hex (what `spec.image.url` is checked against).
pub fn sha256_file(path: &Path) -> io::Result<String> {
    digest_file(path, &ring::digest::SHA256)
}

/// Hashes a file in 1 MiB blocks (images are ~500 MiB).
fn digest_file(path: &Path, algorithm: &'static ring::digest::Algorithm) -> io::Result<String> {
    let mut file = File::open(path)?;
    let mut context = ring::digest::Context::new(algorithm);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        context.update(&buf[..n]);
    }
    Ok(hex(context.finish().as_ref()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // SHA-512 of the empty input (FIPS 180-4 test vector).
    const SHA512_EMPTY: &str = "cf83e1357eefb8bdf1542850d66d8007d620e4050b5715dc83f4a921d36ce9ce\
                                47d0d13c5d85f2b0ff8318d2877eec2f63b931bd47417a81a538327af927da3e";

    fn digests_for(name: &str, sha512: &str) -> String {
        format!(
            "# MD5 HASH\n{md5}  {name}\n# SHA1 HASH\n{sha1}  {name}\n# SHA512 HASH\n{sha512}  {name}\n",
            md5 = "d41d8cd98f00b204e9800998ecf8427e",
            sha1 = "da39a3ee5e6b4b0d3255bfef95601890afd80709",
        )
    }

    #[test]
    fn parses_flatcar_digests_sections() {
        let digests = Digests::parse(&digests_for("image.img", SHA512_EMPTY)).unwrap();
        assert_eq!(digests.entries.len(), 3);
        assert_eq!(digests.entries[0].algorithm, HashAlgorithm::Md5);
        assert_eq!(digests.entries[1].algorithm, HashAlgorithm::Sha1);
        assert_eq!(digests.sha512_of("image.img").unwrap(), SHA512_EMPTY);
    }

    #[test]
    fn accepts_binary_mode_markers_upper_case_hex_and_unknown_sections() {
        let text = format!(
            "# sha512 hash\n{} *a.img\n# B2 HASH\nabcdef  a.img\n\n",
            SHA512_EMPTY.to_uppercase()
        );
        let digests = Digests::parse(&text).unwrap();
        assert_eq!(digests.sha512_of("a.img").unwrap(), SHA512_EMPTY);
        assert_eq!(
            digests.entries[1].algorithm,
            HashAlgorithm::Other("B2".into())
        );
    }

    #[test]
    fn malformed_digests_are_rejected() {
        let cases = [
            (
                format!("{SHA512_EMPTY}  a.img\n"),
                "DIGESTS line 1: digest before any '# <ALGO> HASH' header",
            ),
            (
                "# SHA512 HASH\nnot-a-line\n".to_owned(),
                "DIGESTS line 2: expected '<hex>  <file name>', found \"not-a-line\"",
            ),
            (
                "# SHA512\n".to_owned(),
                "DIGESTS line 1: expected '<hex>  <file name>', found \"# SHA512\"",
            ),
            (
                "# SHA512 HASH\nabc  a.img\n".to_owned(),
                "DIGESTS line 2: SHA512 digest must be 128 hex digits, found \"abc\"",
            ),
            (
                format!("# SHA512 HASH\n{SHA512_EMPTY}  ../a.img\n"),
                "DIGESTS line 2: expected '<hex>  <file name>', found",
            ),
            (
                format!("# MD5 HASH\n{SHA512_EMPTY}  a.img\n"),
                "DIGESTS line 2: MD5 digest must be 32 hex digits",
            ),
            (
                "-----BEGIN PGP SIGNED MESSAGE-----\nHash: SHA512\n".to_owned(),
                "this is the clearsigned .DIGESTS.asc",
            ),
        ];
        for (text, want) in cases {
            let err = Digests::parse(&text).unwrap_err().to_string();
            assert!(err.starts_with(want), "{text:?}: {err}");
        }
    }

    #[test]
    fn lookup_names_the_listed_files_and_refuses_ambiguity() {
        let digests = Digests::parse(&digests_for("other.img", SHA512_EMPTY)).unwrap();
        assert_eq!(
            digests.sha512_of("image.img").unwrap_err().to_string(),
            "DIGESTS has no SHA512 digest for \"image.img\" (it lists [\"other.img\"]): wrong DIGESTS file?"
        );
        let twice = format!(
            "# SHA512 HASH\n{SHA512_EMPTY}  a.img\n{}  a.img\n",
            "0".repeat(128)
        );
        assert!(matches!(
            Digests::parse(&twice).unwrap().sha512_of("a.img"),
            Err(DigestsError::Ambiguous(_))
        ));
    }

    #[test]
    fn a_file_matching_its_digest_verifies_and_a_changed_one_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("image.img");
        std::fs::write(&path, b"").unwrap();
        let digests = Digests::parse(&digests_for("image.img", SHA512_EMPTY)).unwrap();
        assert_eq!(
            digests.verify_sha512(&path, "image.img").unwrap(),
            SHA512_EMPTY
        );

        std::fs::write(&path, b"flatcar\n").unwrap();
        let actual = sha512_file(&path).unwrap();
        assert_ne!(actual, SHA512_EMPTY);
        let err = digests.verify_sha512(&path, "image.img").unwrap_err();
        assert!(matches!(&err, DigestsError::Mismatch { actual: a, .. } if *a == actual));
        let message = err.to_string();
        assert!(
            message.contains(&format!(
                "but DIGESTS lists {SHA512_EMPTY} for \"image.img\""
            )),
            "{message}"
        );
        assert!(message.ends_with("delete it and fetch again"), "{message}");
    }

    #[test]
    fn digests_match_coreutils() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        // Larger than one read block, so the streaming path is exercised.
        let data: Vec<u8> = (0..(3 << 20) + 17).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let ours = sha512_file(&path).unwrap();
        // coreutils is Essential on Debian.
        let out = std::process::Command::new("sha512sum")
            .arg(&path)
            .output()
            .expect("run sha512sum (Debian package coreutils)");
        assert!(out.status.success());
        let theirs = String::from_utf8(out.stdout).unwrap();
        assert_eq!(theirs.split_whitespace().next(), Some(ours.as_str()));
        let out = std::process::Command::new("sha256sum")
            .arg(&path)
            .output()
            .unwrap();
        let theirs = String::from_utf8(out.stdout).unwrap();
        let ours = sha256_file(&path).unwrap();
        assert_eq!(theirs.split_whitespace().next(), Some(ours.as_str()));
    }
}
