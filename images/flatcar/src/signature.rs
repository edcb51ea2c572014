//! Detached OpenPGP signatures, checked by `gpgv` against one trusted key.
//!
//! `gpgv` (Debian package `gpgv`) is GnuPG's verify-only tool: no agent, no trust database, no
//! network. It runs with an empty scratch home directory, so nothing from the caller's keyrings
//! takes part, and with the trusted key as its only keyring. Its machine-readable status lines
//! (`--status-fd`) decide the outcome, not its exit code or messages alone; and when a primary
//! key fingerprint is expected (the Flatcar key's, by default), a valid signature must come from
//! that key or one of its subkeys.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use base64::Engine as _;
use thiserror::Error;

/// The Flatcar image signing key ("Flatcar Buildbot (Official Builds)
/// <buildbot@flatcar-linux.org>"), armored, with its signing subkeys (the one valid from
/// 2025-03-07 expires 2027-03-08; Flatcar adds a new subkey before then).
pub const FLATCAR_SIGNING_KEY: &str = include_str!("../Flatcar_Image_Signing_Key.asc");

/// Fingerprint of the Flatcar image signing key's primary key.
pub const FLATCAR_SIGNING_KEY_FINGERPRINT: &str = "F88CFEDEFF29A5B4D9523864E25D9AED0593B34A";

/// Errors of checking a signature.
#[derive(Debug, Error)]
pub enum SignatureError {
    /// The key file is neither an armored public key block nor binary OpenPGP.
    #[error("the key is not an OpenPGP public key (armored or binary): {0}")]
    Key(String),
    /// Preparing gpgv's scratch directory failed.
    #[error("prepare a scratch directory for gpgv")]
    Scratch(#[source] std::io::Error),
    /// gpgv could not be started.
    #[error("run {program}: install the Debian package gpgv (or pass --gpgv PATH)")]
    Spawn {
        /// The program tried.
        program: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The data does not match the signature.
    #[error("BAD signature on {data} by key {key}: the file was altered or is not the one signed")]
    Bad {
        /// The signed file.
        data: PathBuf,
        /// The signing key id.
        key: String,
    },
    /// The signing key is not the trusted key.
    #[error(
        "{data} is signed by key {key}, which is not in the trusted key file: wrong key file, or \
         a release signed with a newer subkey (update the key file)"
    )]
    UnknownKey {
        /// The signed file.
        data: PathBuf,
        /// The signing key id.
        key: String,
    },
    /// The signing key was revoked.
    #[error("{data} is signed by revoked key {key}")]
    Revoked {
        /// The signed file.
        data: PathBuf,
        /// The signing key id.
        key: String,
    },
    /// The signature is valid but made by another primary key than the expected one.
    #[error("{data} is signed by primary key {actual}, expected {expected}")]
    WrongSigner {
        /// The signed file.
        data: PathBuf,
        /// The expected primary key fingerprint.
        expected: String,
        /// The actual primary key fingerprint.
        actual: String,
    },
    /// gpgv did not report a valid signature.
    #[error("no valid signature on {data}: gpgv said: {detail}")]
    NotVerified {
        /// The signed file.
        data: PathBuf,
        /// gpgv's own messages.
        detail: String,
    },
}

/// A good signature, as gpgv reported it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoodSignature {
    /// Fingerprint of the (sub)key that made the signature.
    pub signing_key: String,
    /// Fingerprint of its primary key.
    pub primary_key: String,
    /// The signing key has expired since (older releases are signed by older subkeys).
    pub key_expired: bool,
}

/// Converts an armored public key block to the binary form gpgv reads; binary input is
/// returned as it is.
pub fn dearmor(key: &[u8]) -> Result<Vec<u8>, SignatureError> {
    const BEGIN: &str = "-----BEGIN PGP PUBLIC KEY BLOCK-----";
    const END: &str = "-----END PGP PUBLIC KEY BLOCK-----";
    let Ok(text) = std::str::from_utf8(key) else {
        return binary_key(key);
    };
    let Some(start) = text.find(BEGIN) else {
        return binary_key(key);
    };
    // Skip the rest of the BEGIN line.
    let body = text[start + BEGIN.len()..]
        .split_once('\n')
        .map_or("", |(_, rest)| rest);
    let end = body
        .find(END)
        .ok_or_else(|| SignatureError::Key(format!("no {END} line")))?;
    let mut lines = body[..end].lines().map(str::trim);
    // Armor headers ("Comment: …", "Version: …") end at the first blank line.
    for line in lines.by_ref() {
        if line.is_empty() {
            break;
        }
        if !line.contains(": ") {
            return Err(SignatureError::Key(format!(
                "armor header {line:?} is not 'Name: value' (a blank line must follow the BEGIN line)"
            )));
        }
    }
    // The base64 data ends with an optional "=XXXX" CRC-24 line, which gpgv does not need:
    // a corrupted key fails to parse or to verify anything.
    let data: String = lines
        .filter(|l| !l.is_empty() && !l.starts_with('='))
        .collect();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|e| SignatureError::Key(format!("bad base64: {e}")))?;
    binary_key(&bytes)
}

/// Accepts binary OpenPGP that starts with a public key packet (tag 6, old or new format).
fn binary_key(bytes: &[u8]) -> Result<Vec<u8>, SignatureError> {
    match bytes.first() {
        Some(&b) if b & 0x80 != 0 && (b == 0xc6 || (b & 0x40 == 0 && (b >> 2) & 0x0f == 6)) => {
            Ok(bytes.to_vec())
        }
        _ => Err(SignatureError::Key(
            "it does not start with a public key packet".into(),
        )),
    }
}

/// Checks detached signatures with gpgv against one trusted key.
#[derive(Clone, Debug)]
pub struct SignatureVerifier {
    gpgv: PathBuf,
    keyring: Vec<u8>,
    expected_primary: Option<String>,
}

impl SignatureVerifier {
    /// The shipped Flatcar image signing key; signatures must come from its primary key.
    pub fn flatcar() -> Self {
        SignatureVerifier {
            gpgv: "gpgv".into(),
            keyring: dearmor(FLATCAR_SIGNING_KEY.as_bytes())
                .expect("the shipped Flatcar key is armored OpenPGP"),
            expected_primary: Some(FLATCAR_SIGNING_KEY_FINGERPRINT.into()),
        }
    }

    /// A key from a file (armored or binary). With `expected_primary`, signatures must come
    /// from that primary key (40 hex digits, spaces allowed); otherwise any key in the file.
    pub fn from_key(key: &[u8], expected_primary: Option<&str>) -> Result<Self, SignatureError> {
        let expected_primary = expected_primary
            .map(|f| {
                let f: String = f.chars().filter(|c| !c.is_whitespace()).collect();
                if f.len() == 40 && f.bytes().all(|b| b.is_ascii_hexdigit()) {
                    Ok(f.to_ascii_uppercase())
                } else {
                    Err(SignatureError::Key(format!(
                        "fingerprint {f:?} is not 40 hex digits"
                    )))
                }
            })
            .transpose()?;
        Ok(SignatureVerifier {
            gpgv: "gpgv".into(),
            keyring: dearmor(key)?,
            expected_primary,
        })
    }

    /// Uses another gpgv binary.
    pub fn with_gpgv(mut self, gpgv: impl Into<PathBuf>) -> Self {
        self.gpgv = gpgv.into();
        self
    }

    /// Checks that `signature` is a valid detached signature of `data` by the trusted key.
    pub fn verify(&self, signature: &Path, data: &Path) -> Result<GoodSignature, SignatureError> {
        let scratch = tempfile::tempdir().map_err(SignatureError::Scratch)?;
        let home = scratch.path().join("home");
        let keyring = scratch.path().join("trusted.gpg");
        fs::create_dir(&home).map_err(SignatureError::Scratch)?;
        fs::write(&keyring, &self.keyring).map_err(SignatureError::Scratch)?;
        let output = Command::new(&self.gpgv)
            .arg("--homedir")
            .arg(&home)
            .arg("--keyring")
            .arg(&keyring)
            .args(["--status-fd", "1"])
            .arg("--")
            .arg(signature)
            .arg(data)
            .env("LC_ALL", "C")
            .output()
            .map_err(|source| SignatureError::Spawn {
                program: self.gpgv.clone(),
                source,
            })?;
        let status = String::from_utf8_lossy(&output.stdout);
        let messages = String::from_utf8_lossy(&output.stderr);
        judge(
            &status,
            output.status.success(),
            &messages,
            data,
            self.expected_primary.as_deref(),
        )
    }
}

/// Decides from gpgv's status lines (GnuPG's doc/DETAILS) whether the signature is good.
fn judge(
    status: &str,
    exit_ok: bool,
    messages: &str,
    data: &Path,
    expected_primary: Option<&str>,
) -> Result<GoodSignature, SignatureError> {
    let data = data.to_path_buf();
    let mut valid: Vec<GoodSignature> = Vec::new();
    let mut expired_key = false;
    let mut signatures = 0;
    for line in status.lines() {
        let Some(rest) = line.strip_prefix("[GNUPG:] ") else {
            continue;
        };
        let fields: Vec<&str> = rest.split(' ').collect();
        let key = || fields.get(1).copied().unwrap_or("?").to_owned();
        match fields[0] {
            "NEWSIG" => signatures += 1,
            "BADSIG" => return Err(SignatureError::Bad { data, key: key() }),
            "REVKEYSIG" => return Err(SignatureError::Revoked { data, key: key() }),
            "EXPKEYSIG" => expired_key = true,
            // The signature itself carries an expiry date that has passed (Flatcar's do not).
            "EXPSIG" => {
                return Err(SignatureError::NotVerified {
                    data,
                    detail: "the signature has expired".into(),
                });
            }
            // ERRSIG <keyid> <pkalgo> <hashalgo> <class> <time> <rc> [<fpr>]; rc 9: no public key.
            "ERRSIG" if fields.get(6) == Some(&"9") => {
                return Err(SignatureError::UnknownKey { data, key: key() });
            }
            // VALIDSIG <fpr> <date> <time> <expire> <version> <reserved> <pkalgo> <hashalgo>
            //          <class> <primary-fpr>
            "VALIDSIG" => {
                let signing_key = key();
                let primary_key = fields
                    .get(10)
                    .map(|s| (*s).to_owned())
                    .unwrap_or_else(|| signing_key.clone());
                valid.push(GoodSignature {
                    signing_key,
                    primary_key,
                    key_expired: false,
                });
            }
            _ => {}
        }
    }
    let detail = || {
        let text = messages
            .lines()
            .map(|l| l.trim_start_matches("gpgv: "))
            .collect::<Vec<_>>()
            .join("; ");
        if text.is_empty() {
            "nothing".to_owned()
        } else {
            text
        }
    };
    // One signature, valid, and gpgv agrees: anything else is refused.
    if !exit_ok || signatures != 1 || valid.len() != 1 {
        return Err(SignatureError::NotVerified {
            data,
            detail: detail(),
        });
    }
    let mut good = valid.remove(0);
    good.key_expired = expired_key;
    if let Some(expected) = expected_primary
        && !good.primary_key.eq_ignore_ascii_case(expected)
    {
        return Err(SignatureError::WrongSigner {
            data,
            expected: expected.into(),
            actual: good.primary_key,
        });
    }
    Ok(good)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkey::TestKey;

    const PRIMARY: &str = "D2DF7F80E2337CFA2B93147ED372C1D9D575C93B";
    const SUBKEY: &str = "52F145DFD00BBDCD928CBB5A32DA80F91EF52974";

    fn status(lines: &[&str]) -> String {
        lines.iter().map(|l| format!("[GNUPG:] {l}\n")).collect()
    }

    fn validsig(fpr: &str, primary: &str) -> String {
        format!("VALIDSIG {fpr} 2026-11-22 1795339545 0 4 0 1 10 00 {primary}")
    }

    #[test]
    fn status_lines_decide_the_outcome() {
        let file = Path::new("image.img");
        let good = status(&[
            "NEWSIG",
            "KEY_CONSIDERED X 0",
            "GOODSIG 32DA80F91EF52974 Flatcar Buildbot",
            &validsig(SUBKEY, PRIMARY),
        ]);
        assert_eq!(
            judge(&good, true, "", file, Some(PRIMARY)).unwrap(),
            GoodSignature {
                signing_key: SUBKEY.into(),
                primary_key: PRIMARY.into(),
                key_expired: false
            }
        );
        // Lower-case expectations still match; another primary key does not.
        assert!(judge(&good, true, "", file, Some(&PRIMARY.to_lowercase())).is_ok());
        assert!(matches!(
            judge(&good, true, "", file, Some(FLATCAR_SIGNING_KEY_FINGERPRINT)),
            Err(SignatureError::WrongSigner { .. })
        ));
        // gpgv failing overrides whatever it printed.
        assert!(matches!(
            judge(&good, false, "gpgv: oops", file, None),
            Err(SignatureError::NotVerified { detail, .. }) if detail == "oops"
        ));
        // A signature by a subkey that has expired since is still good, and flagged.
        let expired = status(&[
            "NEWSIG",
            "EXPKEYSIG 85F7C8868837E271 Flatcar Buildbot",
            &validsig(SUBKEY, PRIMARY),
        ]);
        assert!(
            judge(&expired, true, "", file, Some(PRIMARY))
                .unwrap()
                .key_expired
        );
        // Two signatures, or none, are refused.
        let twice = format!("{good}{good}");
        assert!(matches!(
            judge(&twice, true, "", file, None),
            Err(SignatureError::NotVerified { .. })
        ));
        assert!(matches!(
            judge(&status(&["NODATA 1"]), false, "gpgv: no signature found", file, None),
            Err(SignatureError::NotVerified { detail, .. }) if detail == "no signature found"
        ));
        assert!(matches!(
            judge(&status(&["NEWSIG", "EXPSIG D372C1D9D575C93B T", &validsig(SUBKEY, PRIMARY)]), true, "", file, None),
            Err(SignatureError::NotVerified { detail, .. }) if detail == "the signature has expired"
        ));
        assert!(matches!(
            judge(&status(&["NEWSIG", "BADSIG D372C1D9D575C93B T"]), false, "", file, None),
            Err(SignatureError::Bad { key, .. }) if key == "D372C1D9D575C93B"
        ));
        assert!(matches!(
            judge(
                &status(&[
                    "NEWSIG",
                    "REVKEYSIG D372C1D9D575C93B T",
                    &validsig(SUBKEY, PRIMARY)
                ]),
                true,
                "",
                file,
                None
            ),
            Err(SignatureError::Revoked { .. })
        ));
        assert!(matches!(
            judge(
                &status(&["NEWSIG", "ERRSIG D372C1D9D575C93B 22 10 00 1795339545 9 -", "NO_PUBKEY D372C1D9D575C93B"]),
                false, "", file, None
            ),
            Err(SignatureError::UnknownKey { key, .. }) if key == "D372C1D9D575C93B"
        ));
    }

    #[test]
    fn dearmor_accepts_armor_headers_and_refuses_non_keys() {
        let armored = "-----BEGIN PGP PUBLIC KEY BLOCK-----\nComment: test\n\nxgAA\n=abcd\n-----END PGP PUBLIC KEY BLOCK-----\n";
        assert_eq!(dearmor(armored.as_bytes()).unwrap(), vec![0xc6, 0, 0]);
        assert_eq!(dearmor(&[0x99, 0, 1]).unwrap(), vec![0x99, 0, 1]);
        for bad in [
            &b"hello"[..],
            b"-----BEGIN PGP PUBLIC KEY BLOCK-----\n\nxgAA\n",
            b"-----BEGIN PGP PUBLIC KEY BLOCK-----\nxgAA\n\n-----END PGP PUBLIC KEY BLOCK-----",
            b"-----BEGIN PGP PUBLIC KEY BLOCK-----\n\n!!!!\n-----END PGP PUBLIC KEY BLOCK-----",
            // A signature packet (tag 2) is not a key.
            b"\x89\x02",
        ] {
            assert!(
                matches!(dearmor(bad), Err(SignatureError::Key(_))),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn the_shipped_key_is_flatcars() {
        let Some(gpg) = TestKey::gpg_or_skip() else {
            return;
        };
        let binary = dearmor(FLATCAR_SIGNING_KEY.as_bytes()).unwrap();
        let fingerprints = gpg.show_key_fingerprints(&binary);
        assert_eq!(
            fingerprints.first().map(String::as_str),
            Some(FLATCAR_SIGNING_KEY_FINGERPRINT)
        );
        // The signing subkey of 2025-03-07 (valid until 2027-03-08) is in the file.
        assert!(fingerprints.iter().any(|f| f == SUBKEY), "{fingerprints:?}");
    }

    #[test]
    fn gpgv_accepts_a_good_signature_and_refuses_altered_data_or_another_key() {
        let Some(gpg) = TestKey::gpg_or_skip() else {
            return;
        };
        let signer = TestKey::generate(&gpg, "capk signer");
        let stranger = TestKey::generate(&gpg, "capk stranger");
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("image.img");
        fs::write(&data, b"QFI\xfbfake disk").unwrap();
        let sig = signer.sign(&data);

        let verifier =
            SignatureVerifier::from_key(signer.public_armored().as_bytes(), Some(&signer.fpr))
                .unwrap();
        let good = verifier.verify(&sig, &data).unwrap();
        assert_eq!(good.primary_key, signer.fpr);
        assert_ne!(good.signing_key, signer.fpr, "made by the signing subkey");
        assert!(!good.key_expired);

        fs::write(&data, b"QFI\xfbfake disk, altered").unwrap();
        assert!(matches!(
            verifier.verify(&sig, &data),
            Err(SignatureError::Bad { .. })
        ));

        fs::write(&data, b"QFI\xfbfake disk").unwrap();
        let other = SignatureVerifier::from_key(&stranger.public_binary(), None).unwrap();
        assert!(matches!(
            other.verify(&sig, &data),
            Err(SignatureError::UnknownKey { .. })
        ));
        // The Flatcar key does not vouch for the test key's signature.
        assert!(matches!(
            SignatureVerifier::flatcar().verify(&sig, &data),
            Err(SignatureError::UnknownKey { .. })
        ));
        // Not a signature at all.
        assert!(matches!(
            verifier.verify(&data, &data),
            Err(SignatureError::NotVerified { .. })
        ));
        // A keyring holding both keys, but only the stranger's primary key expected.
        let mut both = signer.public_binary();
        both.extend(stranger.public_binary());
        let pinned = SignatureVerifier::from_key(&both, Some(&stranger.fpr)).unwrap();
        assert!(matches!(
            pinned.verify(&sig, &data),
            Err(SignatureError::WrongSigner { .. })
        ));
    }

    #[test]
    fn a_signature_made_before_its_subkey_expired_still_verifies() {
        let Some(gpg) = TestKey::gpg_or_skip() else {
            return;
        };
        // Like a Flatcar release signed with last year's subkey.
        let key = TestKey::generate_at(&gpg, "capk old", Some("20200101T000000"), "2d");
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("image.img");
        fs::write(&data, b"QFI\xfbold disk").unwrap();
        let sig = key.sign_at(&data, Some("20200102T000000"));
        let good = SignatureVerifier::from_key(&key.public_binary(), Some(&key.fpr))
            .unwrap()
            .verify(&sig, &data)
            .unwrap();
        assert!(good.key_expired);
        assert_eq!(good.primary_key, key.fpr);
    }

    #[test]
    fn a_missing_gpgv_says_which_package_provides_it() {
        let err = SignatureVerifier::flatcar()
            .with_gpgv("/nonexistent/gpgv")
            .verify(Path::new("a.sig"), Path::new("a"))
            .unwrap_err();
        assert!(
            err.to_string().contains("install the Debian package gpgv"),
            "{err}"
        );
    }
}
