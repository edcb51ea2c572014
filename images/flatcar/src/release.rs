//! Where a Flatcar release's QEMU image and its companion files live.
//!
//! Layout of the release servers (one host per channel):
//! `https://<channel>.release.flatcar-linux.net/<arch>/<version>/<file>`, where `<version>` is
//! `N.N.N` or `current` (a copy of the newest release of the channel). Every file has a detached
//! binary OpenPGP signature `<file>.sig`; most have a `<file>.DIGESTS` (MD5, SHA1, SHA512) and its
//! clearsigned `<file>.DIGESTS.asc`. `version.txt` describes the release of its directory.

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

/// Errors of parsing a channel, architecture, version or base URL.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ReleaseError {
    /// Not a channel name.
    #[error("unknown Flatcar channel {0:?}: use stable, beta, alpha or lts")]
    Channel(String),
    /// Not a board name.
    #[error("unknown architecture {0:?}: use amd64-usr or arm64-usr")]
    Arch(String),
    /// Neither `N.N.N` nor `current`.
    #[error(
        "Flatcar version {0:?} must look like 4230.2.3 (three numbers, no leading zeros) or be 'current'"
    )]
    Version(String),
    /// Not an https (or, where allowed, http) base URL.
    #[error(
        "base URL {0:?} must start with https:// (an in-cluster mirror: http:// too) and contain \
         no spaces, quotes or query"
    )]
    BaseUrl(String),
}

/// A Flatcar release channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    /// Stable: production clusters.
    Stable,
    /// Beta: validation of the next stable major.
    Beta,
    /// Alpha: developers.
    Alpha,
    /// LTS: one major a year, bug fixes only.
    Lts,
}

impl Channel {
    /// Every channel, for parsing by name.
    const ALL: [Channel; 4] = [Channel::Stable, Channel::Beta, Channel::Alpha, Channel::Lts];

    /// The channel's name, as in the release host name and in `KVMMachine.spec.image.flatcar`.
    pub fn as_str(self) -> &'static str {
        match self {
            Channel::Stable => "stable",
            Channel::Beta => "beta",
            Channel::Alpha => "alpha",
            Channel::Lts => "lts",
        }
    }
}

impl fmt::Display for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Channel {
    type Err = ReleaseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Channel::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| ReleaseError::Channel(s.into()))
    }
}

/// A Flatcar board (architecture), named as in the release paths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// x86-64.
    Amd64,
    /// AArch64.
    Arm64,
}

impl Arch {
    /// Every board, for parsing by name.
    const ALL: [Arch; 2] = [Arch::Amd64, Arch::Arm64];

    /// The board name used in release paths.
    pub fn as_str(self) -> &'static str {
        match self {
            Arch::Amd64 => "amd64-usr",
            Arch::Arm64 => "arm64-usr",
        }
    }

    /// The QEMU disk image of this board. Since Stable 3602.2.0 it is published uncompressed (a
    /// qcow2 with inline compression) next to the older `.img.bz2`. Recent builds make only the
    /// `qemu_uefi` image and publish `flatcar_production_qemu_image.img` for amd64 as a copy of
    /// it (same disk layout: both a BIOS boot and an EFI system partition, so SeaBIOS boots it);
    /// arm64 has only the UEFI image.
    pub fn qemu_image_file(self) -> &'static str {
        match self {
            Arch::Amd64 => "flatcar_production_qemu_image.img",
            Arch::Arm64 => "flatcar_production_qemu_uefi_image.img",
        }
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Arch {
    type Err = ReleaseError;
    /// The board name (`amd64-usr`) or the architecture alone (`amd64`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Arch::ALL
            .into_iter()
            .find(|a| a.as_str() == s || a.as_str().strip_suffix("-usr") == Some(s))
            .ok_or_else(|| ReleaseError::Arch(s.into()))
    }
}

/// A concrete Flatcar version `BUILD.BRANCH.PATCH`, e.g. `4230.2.3`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct FlatcarVersion {
    /// Major: days since the CoreOS epoch when the major was branched.
    pub build: u32,
    /// Branch: 0 alpha, 1 beta, 2 stable and LTS.
    pub branch: u32,
    /// Patch release of the branch.
    pub patch: u32,
}

impl fmt::Display for FlatcarVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.build, self.branch, self.patch)
    }
}

impl FromStr for FlatcarVersion {
    type Err = ReleaseError;
    /// Exactly three decimal numbers without sign or leading zeros, so that the text round-trips
    /// (the controller's host cache names files by the version text).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ReleaseError::Version(s.into());
        let mut parts = s.split('.');
        let mut number = || parts.next().and_then(canonical_number).ok_or_else(bad);
        let version = FlatcarVersion {
            build: number()?,
            branch: number()?,
            patch: number()?,
        };
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(version)
    }
}

/// A decimal number as Flatcar writes it: digits only, no sign, no leading zeros.
pub(crate) fn canonical_number(text: &str) -> Option<u32> {
    let canonical = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    canonical.then(|| text.parse().ok()).flatten()
}

/// The version asked for: a concrete release or the channel's newest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VersionSpec {
    /// The newest release of the channel, resolved through its `current/version.txt`.
    Current,
    /// A concrete release.
    Exact(FlatcarVersion),
}

impl fmt::Display for VersionSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VersionSpec::Current => f.write_str("current"),
            VersionSpec::Exact(v) => v.fmt(f),
        }
    }
}

impl FromStr for VersionSpec {
    type Err = ReleaseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "current" {
            Ok(VersionSpec::Current)
        } else {
            s.parse().map(VersionSpec::Exact)
        }
    }
}

/// The release server of a channel, or a mirror of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReleaseServer {
    base: String,
}

impl ReleaseServer {
    /// Flatcar's own server for `channel`.
    pub fn upstream(channel: Channel) -> Self {
        ReleaseServer {
            base: format!("https://{channel}.release.flatcar-linux.net"),
        }
    }

    /// A mirror holding the same `<arch>/<version>/<file>` tree under `base` (one channel per
    /// base). Only `https://` is accepted; the signature is what makes a download trusted, TLS
    /// keeps the version resolution private and unmodified.
    pub fn mirror(base: &str) -> Result<Self, ReleaseError> {
        Self::checked_mirror(base, &["https://"])
    }

    /// Like [`ReleaseServer::mirror`], `http://` too (an air-gapped mirror inside the
    /// cluster): only for exact versions, whose signed `version.txt` must name the version asked
    /// for, so a mirror (or anyone on its path) cannot substitute another release.
    pub fn mirror_allowing_http(base: &str) -> Result<Self, ReleaseError> {
        Self::checked_mirror(base, &["https://", "http://"])
    }

    fn checked_mirror(base: &str, schemes: &[&str]) -> Result<Self, ReleaseError> {
        let base = base.trim_end_matches('/');
        let ok = schemes
            .iter()
            .any(|s| base.len() > s.len() && base.starts_with(s))
            && !base
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || "\"'\\?#".contains(c));
        if !ok {
            return Err(ReleaseError::BaseUrl(base.into()));
        }
        Ok(ReleaseServer { base: base.into() })
    }

    /// The URL of `file` in the release directory of `arch` and `version`.
    pub fn url(&self, arch: Arch, version: VersionSpec, file: &str) -> String {
        format!("{}/{}/{}/{}", self.base, arch, version, file)
    }

    /// The files of one release that the recipe downloads.
    pub fn qemu_release(&self, arch: Arch, version: FlatcarVersion) -> QemuReleaseUrls {
        let v = VersionSpec::Exact(version);
        let image = arch.qemu_image_file();
        QemuReleaseUrls {
            image: self.url(arch, v, image),
            image_sig: self.url(arch, v, &format!("{image}.sig")),
            image_digests: self.url(arch, v, &format!("{image}.DIGESTS")),
            version_txt: self.url(arch, v, VERSION_TXT),
            version_txt_sig: self.url(arch, v, &format!("{VERSION_TXT}.sig")),
        }
    }

    /// `current/version.txt` and its signature: how `current` becomes a concrete version.
    pub fn current_version_txt(&self, arch: Arch) -> (String, String) {
        (
            self.url(arch, VersionSpec::Current, VERSION_TXT),
            self.url(arch, VersionSpec::Current, &format!("{VERSION_TXT}.sig")),
        )
    }
}

/// The file describing a release directory.
pub const VERSION_TXT: &str = "version.txt";

/// URLs of a release's QEMU image and the files that vouch for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QemuReleaseUrls {
    /// The qcow2 disk image.
    pub image: String,
    /// Its detached OpenPGP signature.
    pub image_sig: String,
    /// Its MD5/SHA1/SHA512 digests.
    pub image_digests: String,
    /// The release's `version.txt`.
    pub version_txt: String,
    /// The detached signature of `version.txt`.
    pub version_txt_sig: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_urls_of_a_concrete_stable_release() {
        let server = ReleaseServer::upstream(Channel::Stable);
        let urls = server.qemu_release(Arch::Amd64, "4230.2.3".parse().unwrap());
        let base = "https://stable.release.flatcar-linux.net/amd64-usr/4230.2.3";
        assert_eq!(
            urls,
            QemuReleaseUrls {
                image: format!("{base}/flatcar_production_qemu_image.img"),
                image_sig: format!("{base}/flatcar_production_qemu_image.img.sig"),
                image_digests: format!("{base}/flatcar_production_qemu_image.img.DIGESTS"),
                version_txt: format!("{base}/version.txt"),
                version_txt_sig: format!("{base}/version.txt.sig"),
            }
        );
    }

    #[test]
    fn current_resolves_through_the_channel_version_txt() {
        let server = ReleaseServer::upstream(Channel::Lts);
        assert_eq!(
            server.current_version_txt(Arch::Arm64),
            (
                "https://lts.release.flatcar-linux.net/arm64-usr/current/version.txt".into(),
                "https://lts.release.flatcar-linux.net/arm64-usr/current/version.txt.sig".into()
            )
        );
    }

    #[test]
    fn arm64_only_has_the_uefi_qemu_image() {
        let urls = ReleaseServer::upstream(Channel::Alpha)
            .qemu_release(Arch::Arm64, "4799.0.0".parse().unwrap());
        assert_eq!(
            urls.image,
            "https://alpha.release.flatcar-linux.net/arm64-usr/4799.0.0/flatcar_production_qemu_uefi_image.img"
        );
    }

    #[test]
    fn mirror_keeps_the_tree_and_drops_a_trailing_slash() {
        let server = ReleaseServer::mirror("https://mirror.example/flatcar/beta/").unwrap();
        assert_eq!(
            server.url(Arch::Amd64, VersionSpec::Current, "version.txt"),
            "https://mirror.example/flatcar/beta/amd64-usr/current/version.txt"
        );
        for bad in [
            "http://mirror.example",
            "https://",
            "ftp://x",
            "https://a b",
            "https://x/?q=1",
            "https://x/\"",
        ] {
            assert_eq!(
                ReleaseServer::mirror(bad),
                Err(ReleaseError::BaseUrl(bad.trim_end_matches('/').into())),
                "{bad}"
            );
        }
        let http = ReleaseServer::mirror_allowing_http("http://mirror.example/flatcar/").unwrap();
        assert_eq!(
            http.url(Arch::Amd64, VersionSpec::Current, "version.txt"),
            "http://mirror.example/flatcar/amd64-usr/current/version.txt"
        );
        assert!(ReleaseServer::mirror_allowing_http("ftp://mirror.example").is_err());
    }

    #[test]
    fn channels_and_arches_parse_and_print() {
        for c in [Channel::Stable, Channel::Beta, Channel::Alpha, Channel::Lts] {
            assert_eq!(c.to_string().parse::<Channel>(), Ok(c));
        }
        assert_eq!(
            "edge".parse::<Channel>(),
            Err(ReleaseError::Channel("edge".into()))
        );
        assert_eq!("amd64".parse::<Arch>(), Ok(Arch::Amd64));
        assert_eq!("arm64-usr".parse::<Arch>(), Ok(Arch::Arm64));
        assert!("x86_64".parse::<Arch>().is_err());
    }

    #[test]
    fn versions_are_three_canonical_numbers_or_current() {
        assert_eq!("current".parse::<VersionSpec>(), Ok(VersionSpec::Current));
        let v: FlatcarVersion = "4230.2.3".parse().unwrap();
        assert_eq!(
            v,
            FlatcarVersion {
                build: 4230,
                branch: 2,
                patch: 3
            }
        );
        assert_eq!(v.to_string(), "4230.2.3");
        assert_eq!(
            "3602.0.0".parse::<VersionSpec>().unwrap().to_string(),
            "3602.0.0"
        );
        for bad in [
            "",
            "4230.2",
            "4230.2.3.1",
            "4230.2.x",
            "04230.2.3",
            "+4230.2.3",
            "4230..3",
            "4230.2.3+nightly-20260821-2100",
            "Current",
            "99999999999.0.0",
        ] {
            assert_eq!(
                bad.parse::<VersionSpec>(),
                Err(ReleaseError::Version(bad.into())),
                "{bad}"
            );
        }
    }
}
