//! The recipe: resolve the version, download, verify, write the Containerfile.
//!
//! Every file that decides something is checked before it is used: `version.txt` by its
//! signature (a forged one could point `current` at an old, vulnerable release), the disk by its
//! signature and by its DIGESTS entry. A disk that fails either check is deleted, and the
//! Containerfile is written last, so an output directory with a Containerfile holds a verified
//! disk.

use std::fs;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use capk_api::file_error::FileError;
use thiserror::Error;

use crate::containerfile::DiskImage;
use crate::digests::{Digests, DigestsError, sha256_file};
use crate::release::{
    Arch, Channel, FlatcarVersion, QemuReleaseUrls, ReleaseServer, VERSION_TXT, VersionSpec,
};
use crate::signature::{GoodSignature, SignatureError, SignatureVerifier};
use crate::version_txt::{VersionTxt, VersionTxtError};

/// Errors of the recipe; each names the step that failed.
#[derive(Debug, Error)]
pub enum FetchError {
    /// A download failed.
    #[error("download {url}: {}{detail}", status.map(|s| format!("HTTP {s}: ")).unwrap_or_default())]
    Download {
        /// The URL, without credentials ([`redact_url`]).
        url: String,
        /// The HTTP status of the last attempt, when the server answered.
        status: Option<u16>,
        /// curl's message.
        detail: String,
    },
    /// A URL curl must not be given.
    #[error("{0} is not an http:// or https:// URL without spaces, quotes or backslashes")]
    BadUrl(String),
    /// curl could not be started.
    #[error("run {program}: install the Debian package curl (or pass --curl PATH)")]
    SpawnCurl {
        /// The program tried.
        program: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Reading or writing the output directory failed.
    #[error(transparent)]
    Io(#[from] FileError),
    /// A signature did not verify.
    #[error("verify the signature of {file}")]
    Signature {
        /// The file whose signature failed.
        file: String,
        /// Why.
        #[source]
        source: SignatureError,
    },
    /// `version.txt` is malformed.
    #[error("read the release's version.txt")]
    VersionTxt(#[source] VersionTxtError),
    /// The release directory describes another version than asked for.
    #[error("{url} describes release {found}, not {wanted}: the release tree is mislabelled")]
    VersionMismatch {
        /// The version.txt URL.
        url: String,
        /// Asked for.
        wanted: FlatcarVersion,
        /// Found.
        found: FlatcarVersion,
    },
    /// The DIGESTS file is malformed or the disk does not match it.
    #[error("check {file} against its DIGESTS")]
    Digests {
        /// The checked file.
        file: String,
        /// Why.
        #[source]
        source: DigestsError,
    },
    /// The verified file is not a qcow2 image.
    #[error(
        "{0} is not a qcow2 image (no QFI\\xfb magic): the node image must be qcow2, as Flatcar's \
         uncompressed QEMU image is since Stable 3602.2.0"
    )]
    NotQcow2(PathBuf),
}

/// Fetches a URL into a file.
pub trait Download {
    /// Downloads `url` to `dest`, replacing it.
    fn download(&self, url: &str, dest: &Path) -> Result<(), FetchError>;
}

/// Downloads with the `curl` program.
///
/// Why curl and not a Rust HTTP client: no new crates, and curl brings what a platform
/// engineer's hosts are already configured for (proxies through `https_proxy`, the system's CA
/// store), resumption (HTTP Range), connect and stall timeouts, with a clear message on failure.
///
/// The URL reaches curl on its standard input (`--config -`), never in its arguments, where
/// every process on the host could read a token in it. Messages name it without userinfo,
/// query or fragment ([`redact_url`]).
#[derive(Clone, Debug)]
pub struct Curl {
    program: PathBuf,
    protocols: &'static str,
    resume: bool,
    attempts: u32,
    connect_timeout: Duration,
    stall: Duration,
    max_bytes: Option<u64>,
}

impl Curl {
    /// curl at `program` (e.g. `curl` from `PATH`): https only (also after redirects), four
    /// attempts, no resumption, a transfer slower than 1 KiB/s for 60 s fails.
    pub fn new(program: impl Into<PathBuf>) -> Self {
        Curl {
            program: program.into(),
            // The signature is the trust anchor; TLS keeps the version resolution private.
            protocols: "=https",
            resume: false,
            attempts: 4,
            connect_timeout: Duration::from_secs(30),
            stall: Duration::from_secs(60),
            max_bytes: None,
        }
    }

    /// Accepts http:// too (an air-gapped mirror, a tenant's `spec.image.url`): what is
    /// downloaded must then be checked by digest or signature.
    pub fn allow_http(mut self) -> Self {
        self.protocols = "=http,https";
        self
    }

    /// Keeps `<dest>.part` when a download fails and continues it (HTTP Range) next time, in
    /// this process or the next one. A server that ignores the range starts it over.
    pub fn resumable(mut self) -> Self {
        self.resume = true;
        self
    }

    /// Attempts per download (at least 1); transient failures (timeouts, refused connections,
    /// HTTP 408, 429 and 5xx) are retried after 1, 2, 4, ... s (at most 30 s).
    pub fn attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts.max(1);
        self
    }

    /// How long a connection may take, and how long a transfer may make no progress (less than
    /// 1 KiB/s), before the attempt fails.
    pub fn timeouts(mut self, connect: Duration, stall: Duration) -> Self {
        self.connect_timeout = connect;
        self.stall = stall;
        self
    }

    /// The most a download may hold: it is stopped, and its part deleted, once larger.
    pub fn max_bytes(mut self, max: u64) -> Self {
        self.max_bytes = Some(max);
        self
    }

    fn part(dest: &Path) -> PathBuf {
        PathBuf::from(format!("{}.part", dest.display()))
    }

    /// One curl run: appends to (`resume`) or replaces `part`.
    fn attempt(&self, url: &str, part: &Path, resume: bool) -> Result<(), Failure> {
        let mut command = Command::new(&self.program);
        command
            .args(["--fail", "--location", "--silent", "--show-error"])
            .args(["--max-redirs", "5"])
            .args(["--proto", self.protocols, "--proto-redir", self.protocols])
            .arg("--connect-timeout")
            .arg(self.connect_timeout.as_secs().max(1).to_string())
            .args(["--speed-limit", "1024", "--speed-time"])
            .arg(self.stall.as_secs().max(1).to_string())
            .args(["--write-out", "%{http_code}"]);
        if let Some(max) = self.max_bytes {
            command.arg("--max-filesize").arg(max.to_string());
        }
        if resume {
            command.args(["--continue-at", "-"]);
        }
        let mut child = command
            .arg("--output")
            .arg(part)
            .args(["--config", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(Failure::Spawn)?;
        // The config line: `validate_url` refused quotes, backslashes and control characters.
        let config = format!("url = \"{url}\"\n");
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(config.as_bytes());
        }
        // curl checks --max-filesize only against a announced length: a body without one is
        // measured here, and the transfer stopped once it is too large.
        let mut too_large = false;
        while child.try_wait().map_err(Failure::Spawn)?.is_none() {
            if let Some(max) = self.max_bytes
                && fs::metadata(part).is_ok_and(|m| m.len() > max)
            {
                too_large = true;
                let _ = child.kill();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let output = child.wait_with_output().map_err(Failure::Spawn)?;
        let status = String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|s| *s != 0);
        if too_large || output.status.code() == Some(63) {
            return Err(Failure::Fatal {
                status,
                detail: format!(
                    "larger than {} bytes, the most a download may hold",
                    self.max_bytes.unwrap_or_default()
                ),
            });
        }
        if output.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
        let mut detail = match last {
            Some(line) => line.trim().trim_start_matches("curl: ").to_owned(),
            None => format!("curl exited with {}", output.status),
        };
        let code = output.status.code();
        if code == Some(28) {
            detail = format!(
                "no progress for {} s or no connection within {} s ({detail})",
                self.stall.as_secs(),
                self.connect_timeout.as_secs()
            );
        }
        // 33: the server ignores the range; 36: bad resume offset; 416: the range is past its
        // end (the part is as long as the file, or longer: another file now).
        if resume && (matches!(code, Some(33 | 36)) || status == Some(416)) {
            return Err(Failure::RestartFromZero);
        }
        let transient = match status {
            Some(s) if s >= 400 => s == 408 || s == 429 || s >= 500,
            // Connect, timeout, partial file, empty reply, send/receive errors, TLS handshake.
            _ => matches!(code, Some(7 | 18 | 28 | 35 | 52 | 55 | 56)),
        };
        Err(if transient {
            Failure::Transient { status, detail }
        } else {
            Failure::Fatal { status, detail }
        })
    }
}

/// How one curl run failed.
enum Failure {
    Spawn(std::io::Error),
    RestartFromZero,
    Transient { status: Option<u16>, detail: String },
    Fatal { status: Option<u16>, detail: String },
}

impl Download for Curl {
    fn download(&self, url: &str, dest: &Path) -> Result<(), FetchError> {
        let shown = redact_url(url);
        validate_url(url)?;
        let part = Self::part(dest);
        if !self.resume {
            let _ = fs::remove_file(&part);
        }
        let mut attempt = 0;
        let mut backoff = Duration::from_secs(1);
        loop {
            attempt += 1;
            let resume = self.resume && fs::metadata(&part).is_ok_and(|m| m.len() > 0);
            let (status, mut detail, again) = match self.attempt(url, &part, resume) {
                Ok(()) => break,
                Err(Failure::Spawn(source)) => {
                    return Err(FetchError::SpawnCurl {
                        program: self.program.clone(),
                        source,
                    });
                }
                Err(Failure::RestartFromZero) => {
                    let _ = fs::remove_file(&part);
                    attempt -= 1;
                    continue;
                }
                Err(Failure::Transient { status, detail }) => (status, detail, true),
                Err(Failure::Fatal { status, detail }) => (status, detail, false),
            };
            if again && attempt < self.attempts {
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(30));
                continue;
            }
            if !self.resume || !again {
                let _ = fs::remove_file(&part);
            }
            if status == Some(404) {
                detail.push_str(
                    " (no such file: check the URL; for Flatcar the channel, version and arch; \
                     releases before Stable 3602.2.0 have no uncompressed QEMU image)",
                );
            }
            if attempt > 1 {
                detail.push_str(&format!(" (after {attempt} attempts)"));
            }
            return Err(FetchError::Download {
                url: shown,
                status,
                detail,
            });
        }
        Ok(fs::rename(&part, dest).map_err(FileError::at("rename the download to", dest))?)
    }
}

/// Refuses what curl must not be given: another scheme than http(s), and characters that have
/// no place in a URL (whitespace, quotes, backslashes, control characters).
pub fn validate_url(url: &str) -> Result<(), FetchError> {
    let scheme_ok = ["https://", "http://"]
        .iter()
        .any(|s| url.len() > s.len() && url[..s.len()].eq_ignore_ascii_case(s));
    let chars_ok = !url
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || "\"\\".contains(c));
    if scheme_ok && chars_ok {
        Ok(())
    } else {
        Err(FetchError::BadUrl(redact_url(url)))
    }
}

/// A URL as messages may show it: without userinfo (`user:token@`), query and fragment, where
/// credentials hide.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((s, r)) => (Some(s), r),
        None => (None, url),
    };
    // The authority ends at the first `/`; userinfo, even one holding `?` or `#`, ends at its
    // last `@`.
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let cut = |s: &str| s.split(['?', '#']).next().unwrap_or_default().to_owned();
    let (host, path) = (cut(host), cut(path));
    match scheme {
        Some(s) => format!("{s}://{host}{path}"),
        None => format!("{host}{path}"),
    }
}

/// What to fetch and where to put it.
#[derive(Clone, Debug)]
pub struct FetchRequest {
    /// Channel.
    pub channel: Channel,
    /// Version or `current`.
    pub version: VersionSpec,
    /// Board.
    pub arch: Arch,
    /// Flatcar's server for the channel, or a mirror.
    pub server: ReleaseServer,
    /// Output directory: the build context of the container image.
    pub out: PathBuf,
}

/// The outcome of a successful fetch.
#[derive(Clone, Debug)]
pub struct Fetched {
    /// The release.
    pub version: FlatcarVersion,
    /// The verified disk.
    pub image: PathBuf,
    /// Its SHA-512.
    pub sha512: String,
    /// Its SHA-256, for serving the verified disk to `spec.image.url`.
    pub sha256: String,
    /// Its signature.
    pub signature: GoodSignature,
    /// The Containerfile written next to it.
    pub containerfile: PathBuf,
    /// The disk was already there and verified, so not downloaded again.
    pub reused: bool,
}

impl Fetched {
    /// The file name machine Pods fetch `spec.image.flatcar` of this channel and version to in
    /// an MC node's host cache (`/var/lib/capk/images`).
    pub fn host_cache_name(&self, channel: Channel) -> String {
        format!("flatcar-{channel}-{}.img", self.version)
    }
}

/// The name of the Containerfile in the output directory.
pub const CONTAINERFILE: &str = "Containerfile";

/// Runs the recipe.
pub fn fetch(
    request: &FetchRequest,
    download: &dyn Download,
    verifier: &SignatureVerifier,
) -> Result<Fetched, FetchError> {
    let containerfile = prepare_output_dir(&request.out)?;
    let version = fetch_release_version(request, download, verifier)?;
    let urls = request.server.qemu_release(request.arch, version);
    let disk = DiskFiles::new(&request.out, request.arch.qemu_image_file());
    let digests = disk.fetch_digests(&urls, download)?;
    let reused = disk.reuse_verified(&digests, verifier)?;
    if !reused {
        download.download(&urls.image, &disk.image)?;
    }
    let (sha512, signature) = disk.verify_or_delete(&digests, verifier)?;

    // The Containerfile, last: its presence means the disk next to it is verified.
    let image = DiskImage {
        channel: request.channel,
        version,
        arch: request.arch,
        file: disk.name.into(),
        sha512: sha512.clone(),
        source_url: urls.image,
        signed_by: signature.primary_key.clone(),
    };
    let sha256 = sha256_file(&disk.image).map_err(FileError::at("read", &disk.image))?;
    fs::write(&containerfile, image.containerfile())
        .map_err(FileError::at("write", &containerfile))?;
    Ok(Fetched {
        version,
        image: disk.image,
        sha512,
        sha256,
        signature,
        containerfile,
        reused,
    })
}

/// Creates the output directory and removes a Containerfile from an earlier run, which must
/// not outlive a failed one; returns the Containerfile's path.
fn prepare_output_dir(out: &Path) -> Result<PathBuf, FetchError> {
    fs::create_dir_all(out).map_err(FileError::at("create the output directory", out))?;
    let containerfile = out.join(CONTAINERFILE);
    if containerfile.exists() {
        fs::remove_file(&containerfile).map_err(FileError::at("remove", &containerfile))?;
    }
    Ok(containerfile)
}

/// The release: `version.txt` of the requested directory, its signature verified, and for an
/// exact version the check that it describes that release.
fn fetch_release_version(
    request: &FetchRequest,
    download: &dyn Download,
    verifier: &SignatureVerifier,
) -> Result<FlatcarVersion, FetchError> {
    let (txt_url, txt_sig_url) = match request.version {
        VersionSpec::Current => request.server.current_version_txt(request.arch),
        VersionSpec::Exact(v) => {
            let urls = request.server.qemu_release(request.arch, v);
            (urls.version_txt, urls.version_txt_sig)
        }
    };
    let txt = request.out.join(VERSION_TXT);
    let txt_sig = request.out.join(format!("{VERSION_TXT}.sig"));
    download.download(&txt_url, &txt)?;
    download.download(&txt_sig_url, &txt_sig)?;
    verifier
        .verify(&txt_sig, &txt)
        .map_err(|source| FetchError::Signature {
            file: VERSION_TXT.into(),
            source,
        })?;
    let text = fs::read_to_string(&txt).map_err(FileError::at("read", &txt))?;
    let version = VersionTxt::parse(&text)
        .map_err(FetchError::VersionTxt)?
        .version;
    if let VersionSpec::Exact(wanted) = request.version
        && wanted != version
    {
        return Err(FetchError::VersionMismatch {
            url: txt_url,
            wanted,
            found: version,
        });
    }
    Ok(version)
}

/// The disk's files in the output directory: the disk, its signature and its DIGESTS.
struct DiskFiles {
    /// The disk's file name on the release server and in the output directory.
    name: &'static str,
    image: PathBuf,
    sig: PathBuf,
    digests: PathBuf,
}

impl DiskFiles {
    fn new(out: &Path, name: &'static str) -> Self {
        DiskFiles {
            name,
            image: out.join(name),
            sig: out.join(format!("{name}.sig")),
            digests: out.join(format!("{name}.DIGESTS")),
        }
    }

    /// Downloads the disk's signature and DIGESTS (small: always fetched again) and parses
    /// the DIGESTS.
    fn fetch_digests(
        &self,
        urls: &QemuReleaseUrls,
        download: &dyn Download,
    ) -> Result<Digests, FetchError> {
        download.download(&urls.image_sig, &self.sig)?;
        download.download(&urls.image_digests, &self.digests)?;
        let text =
            fs::read_to_string(&self.digests).map_err(FileError::at("read", &self.digests))?;
        Digests::parse(&text).map_err(|source| FetchError::Digests {
            file: self.name.into(),
            source,
        })
    }

    /// Whether a previous run left a verified disk; a disk that fails verification is deleted.
    fn reuse_verified(
        &self,
        digests: &Digests,
        verifier: &SignatureVerifier,
    ) -> Result<bool, FetchError> {
        if !self.image.exists() {
            return Ok(false);
        }
        match self.verify(digests, verifier) {
            Ok(_) => Ok(true),
            Err(_) => fs::remove_file(&self.image)
                .map(|()| false)
                .map_err(|e| FileError::at("remove the stale", &self.image)(e).into()),
        }
    }

    /// Verifies the disk ([`DiskFiles::verify`]) and deletes it when it fails.
    fn verify_or_delete(
        &self,
        digests: &Digests,
        verifier: &SignatureVerifier,
    ) -> Result<(String, GoodSignature), FetchError> {
        self.verify(digests, verifier).inspect_err(|_| {
            let _ = fs::remove_file(&self.image);
        })
    }

    /// The disk's SHA-512 against DIGESTS (cheap to explain), its signature, then its format.
    fn verify(
        &self,
        digests: &Digests,
        verifier: &SignatureVerifier,
    ) -> Result<(String, GoodSignature), FetchError> {
        let sha512 = digests
            .verify_sha512(&self.image, self.name)
            .map_err(|source| FetchError::Digests {
                file: self.name.into(),
                source,
            })?;
        let signature =
            verifier
                .verify(&self.sig, &self.image)
                .map_err(|source| FetchError::Signature {
                    file: self.name.into(),
                    source,
                })?;
        let mut magic = [0u8; 4];
        let qcow2 = fs::File::open(&self.image)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
            && magic == *b"QFI\xfb";
        if !qcow2 {
            return Err(FetchError::NotQcow2(self.image.clone()));
        }
        Ok((sha512, signature))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digests::sha512_file;
    use crate::testkey::TestKey;
    use std::cell::RefCell;

    /// Serves a local directory tree as if it were the release server, and counts downloads.
    struct Mirror {
        base: String,
        root: PathBuf,
        fetched: RefCell<Vec<String>>,
    }

    impl Download for Mirror {
        fn download(&self, url: &str, dest: &Path) -> Result<(), FetchError> {
            let rel = url
                .strip_prefix(&self.base)
                .unwrap_or_else(|| panic!("{url} is not on {}", self.base));
            let src = self.root.join(rel.trim_start_matches('/'));
            self.fetched.borrow_mut().push(rel.to_owned());
            fs::copy(&src, dest)
                .map(|_| ())
                .map_err(|e| FetchError::Download {
                    url: url.into(),
                    status: None,
                    detail: e.to_string(),
                })
        }
    }

    const IMAGE: &str = "flatcar_production_qemu_image.img";

    /// A signed release 4230.2.3 on a mirror, a request for the current stable release and a
    /// verifier that trusts `key`.
    fn setup(key: &TestKey) -> (tempfile::TempDir, Mirror, FetchRequest, SignatureVerifier) {
        setup_serving(key, b"QFI\xfb\x00\x00\x00\x03 a tiny stand-in for the disk")
    }

    /// [`setup`] with the mirror serving `disk` as the release's disk.
    fn setup_serving(
        key: &TestKey,
        disk: &[u8],
    ) -> (tempfile::TempDir, Mirror, FetchRequest, SignatureVerifier) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("mirror");
        key.release_tree(&root, "4230.2.3", disk);
        let base = "https://mirror.example/flatcar/stable".to_owned();
        let request = FetchRequest {
            channel: Channel::Stable,
            version: VersionSpec::Current,
            arch: Arch::Amd64,
            server: ReleaseServer::mirror(&base).unwrap(),
            out: dir.path().join("out"),
        };
        let mirror = Mirror {
            base,
            root,
            fetched: RefCell::new(vec![]),
        };
        let verifier =
            SignatureVerifier::from_key(key.public_armored().as_bytes(), Some(&key.fpr)).unwrap();
        (dir, mirror, request, verifier)
    }

    /// Runs a fetch that must fail, and checks that it left neither the disk nor a
    /// Containerfile behind.
    fn fetch_refused(
        request: &FetchRequest,
        mirror: &Mirror,
        verifier: &SignatureVerifier,
    ) -> FetchError {
        let err = fetch(request, mirror, verifier).unwrap_err();
        assert!(!request.out.join(IMAGE).exists(), "{err:?}");
        assert!(!request.out.join(CONTAINERFILE).exists(), "{err:?}");
        err
    }

    #[test]
    fn current_is_resolved_verified_and_packaged_then_reused() {
        let Some(gpg) = TestKey::gpg_or_skip() else {
            return;
        };
        let key = TestKey::generate(&gpg, "capk release");
        let (_dir, mirror, request, verifier) = setup(&key);

        let fetched = fetch(&request, &mirror, &verifier).unwrap();
        assert_eq!(fetched.version.to_string(), "4230.2.3");
        assert!(!fetched.reused);
        assert_eq!(fetched.signature.primary_key, key.fpr);
        assert_eq!(fetched.sha256, sha256_file(&fetched.image).unwrap());
        assert_eq!(
            fetched.host_cache_name(Channel::Stable),
            "flatcar-stable-4230.2.3.img"
        );
        // current is only used for version.txt; the disk comes from the concrete release.
        assert_eq!(
            *mirror.fetched.borrow(),
            [
                "/amd64-usr/current/version.txt",
                "/amd64-usr/current/version.txt.sig",
                "/amd64-usr/4230.2.3/flatcar_production_qemu_image.img.sig",
                "/amd64-usr/4230.2.3/flatcar_production_qemu_image.img.DIGESTS",
                "/amd64-usr/4230.2.3/flatcar_production_qemu_image.img",
            ]
        );
        let containerfile = fs::read_to_string(&fetched.containerfile).unwrap();
        assert!(
            containerfile.contains("\nFROM scratch\n"),
            "{containerfile}"
        );
        assert!(
            containerfile.contains(&format!(
                "io.x-k8s.cluster.infrastructure.kvm.disk.sha512=\"{}\"",
                fetched.sha512
            )),
            "{containerfile}"
        );
        assert!(
            containerfile.ends_with("COPY flatcar_production_qemu_image.img /disk/image.qcow2\n")
        );

        // A second run verifies the disk it has instead of downloading it again.
        mirror.fetched.borrow_mut().clear();
        let again = fetch(&request, &mirror, &verifier).unwrap();
        assert!(again.reused);
        assert_eq!(mirror.fetched.borrow().len(), 4);
    }

    #[test]
    fn a_tampered_disk_is_deleted_and_no_containerfile_is_written() {
        let Some(gpg) = TestKey::gpg_or_skip() else {
            return;
        };
        let key = TestKey::generate(&gpg, "capk release");
        let (_dir, mirror, mut request, verifier) = setup(&key);
        request.version = VersionSpec::Exact("4230.2.3".parse().unwrap());
        let served = mirror.root.join("amd64-usr/4230.2.3").join(IMAGE);

        // Altered after signing: the DIGESTS entry no longer matches.
        fs::write(&served, b"QFI\xfb\x00\x00\x00\x03 something else").unwrap();
        let err = fetch_refused(&request, &mirror, &verifier);
        assert!(
            matches!(
                &err,
                FetchError::Digests {
                    source: DigestsError::Mismatch { .. },
                    ..
                }
            ),
            "{err:?}"
        );

        // DIGESTS rewritten to match, but the signature still refuses it.
        let sha = sha512_file(&served).unwrap();
        fs::write(
            served.with_file_name(format!("{IMAGE}.DIGESTS")),
            format!("# SHA512 HASH\n{sha}  {IMAGE}\n"),
        )
        .unwrap();
        let err = fetch_refused(&request, &mirror, &verifier);
        assert!(
            matches!(
                &err,
                FetchError::Signature {
                    source: SignatureError::Bad { .. },
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn a_release_signed_by_another_key_or_mislabelled_is_refused() {
        let Some(gpg) = TestKey::gpg_or_skip() else {
            return;
        };
        let key = TestKey::generate(&gpg, "capk release");
        let (_dir, mirror, mut request, _) = setup(&key);

        // The real Flatcar key does not vouch for the test release.
        let err = fetch(&request, &mirror, &SignatureVerifier::flatcar()).unwrap_err();
        assert!(
            matches!(&err, FetchError::Signature { file, source: SignatureError::UnknownKey { .. } } if file == "version.txt"),
            "{err:?}"
        );

        // A directory whose version.txt describes another release.
        let verifier =
            SignatureVerifier::from_key(key.public_armored().as_bytes(), Some(&key.fpr)).unwrap();
        let other = mirror.root.join("amd64-usr/4230.2.4");
        fs::create_dir_all(&other).unwrap();
        fs::copy(
            mirror.root.join("amd64-usr/4230.2.3/version.txt"),
            other.join("version.txt"),
        )
        .unwrap();
        key.sign(&other.join("version.txt"));
        request.version = VersionSpec::Exact("4230.2.4".parse().unwrap());
        let err = fetch(&request, &mirror, &verifier).unwrap_err();
        assert_eq!(
            err.to_string(),
            "https://mirror.example/flatcar/stable/amd64-usr/4230.2.4/version.txt describes \
             release 4230.2.3, not 4230.2.4: the release tree is mislabelled"
        );
    }

    #[test]
    fn a_signed_disk_that_is_not_qcow2_is_refused() {
        let Some(gpg) = TestKey::gpg_or_skip() else {
            return;
        };
        let key = TestKey::generate(&gpg, "capk release");
        // A bzip2 stream, as the old .img.bz2 downloads are.
        let (_dir, mirror, request, _) = setup_serving(&key, b"BZh91AY&SY not a qcow2");
        // A binary key without a pinned fingerprint verifies too.
        let verifier = SignatureVerifier::from_key(&key.public_binary(), None).unwrap();
        let err = fetch_refused(&request, &mirror, &verifier);
        assert!(matches!(err, FetchError::NotQcow2(_)), "{err:?}");
    }

    #[test]
    fn messages_show_urls_without_credentials_and_curl_gets_only_http_urls() {
        for (url, shown) in [
            (
                "https://user:s3cret@images.example/disk.img?X-Amz-Signature=abc#frag",
                "https://images.example/disk.img",
            ),
            (
                "http://10.0.0.1:8080/a/b.qcow2",
                "http://10.0.0.1:8080/a/b.qcow2",
            ),
            ("https://to?k#en@host/x?q", "https://host/x"),
            ("https://host", "https://host"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
        assert!(validate_url("https://images.example/disk.img?sig=1").is_ok());
        for bad in [
            "file:///etc/shadow",
            "ftp://x/y",
            "https://",
            "https://x/\"quoted",
            "https://x/a b",
            "https://x/\\",
            "http://x/\n",
        ] {
            let err = validate_url(bad).unwrap_err();
            assert!(matches!(err, FetchError::BadUrl(_)), "{bad}: {err:?}");
        }
    }

    #[test]
    fn curl_failures_name_the_url() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("f");
        let err = Curl::new("/nonexistent/curl")
            .download("https://mirror.example/x", &dest)
            .unwrap_err();
        assert!(
            err.to_string().contains("install the Debian package curl"),
            "{err}"
        );
        // An http:// URL never leaves the machine: curl refuses the protocol.
        let err = Curl::new("curl")
            .download("http://127.0.0.1:9/x", &dest)
            .unwrap_err();
        assert!(
            matches!(&err, FetchError::Download { url, detail, .. } if url == "http://127.0.0.1:9/x" && detail.contains("not supported")),
            "{err:?} (curl comes from the Debian package curl)"
        );
        assert!(!dest.exists());
    }
}
