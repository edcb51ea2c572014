//! The recipe: resolve the version, download, verify, write the Containerfile.
//!
//! Every file that decides something is checked before it is used: `version.txt` by its
//! signature (a forged one could point `current` at an old, vulnerable release), the disk by its
//! signature and by its DIGESTS entry. A disk that fails either check is deleted, and the
//! Containerfile is written last, so an output directory with a Containerfile holds a verified
//! disk.

use std::fs;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use thiserror::Error;

use crate::containerfile::DiskImage;
use crate::digests::{Digests, DigestsError, sha256_file};
use crate::release::{Arch, Channel, FlatcarVersion, ReleaseServer, VERSION_TXT, VersionSpec};
use crate::signature::{GoodSignature, SignatureError, SignatureVerifier};
use crate::version_txt::{VersionTxt, VersionTxtError};

/// Errors of the recipe; each names the step that failed.
#[derive(Debug, Error)]
pub enum FetchError {
    /// A download failed.
    #[error("download {url}: {detail}")]
    Download {
        /// The URL.
        url: String,
        /// curl's message.
        detail: String,
    },
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
    #[error("{action} {path}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
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
/// Why curl and not a Rust HTTP client: no new crates for a tool that runs once per release,
/// and curl brings what a platform engineer's build host is already configured for (proxies
/// through `https_proxy`, the system's CA store, retries), with a clear message on failure.
#[derive(Clone, Debug)]
pub struct Curl {
    program: PathBuf,
}

impl Curl {
    /// curl at `program` (e.g. `curl` from `PATH`).
    pub fn new(program: impl Into<PathBuf>) -> Self {
        Curl {
            program: program.into(),
        }
    }
}

impl Download for Curl {
    fn download(&self, url: &str, dest: &Path) -> Result<(), FetchError> {
        let part = PathBuf::from(format!("{}.part", dest.display()));
        let output = Command::new(&self.program)
            .args(["--fail", "--location", "--silent", "--show-error"])
            // https only, also after redirects; the signature is the trust anchor, TLS keeps
            // the version resolution private.
            .args(["--proto", "=https", "--proto-redir", "=https"])
            .args(["--retry", "3", "--connect-timeout", "30"])
            .arg("--output")
            .arg(&part)
            .arg(url)
            .output()
            .map_err(|source| FetchError::SpawnCurl {
                program: self.program.clone(),
                source,
            })?;
        if !output.status.success() {
            let _ = fs::remove_file(&part);
            // With --retry curl repeats its message; the last one is enough.
            let stderr = String::from_utf8_lossy(&output.stderr);
            let detail = stderr.lines().rev().find(|l| !l.trim().is_empty());
            let mut detail = match detail {
                Some(line) => line.trim().to_owned(),
                None => format!("curl exited with {}", output.status),
            };
            if detail.contains("404") {
                detail.push_str(
                    " (no such release or file: check channel, version and arch; releases \
                     before Stable 3602.2.0 have no uncompressed QEMU image)",
                );
            }
            return Err(FetchError::Download {
                url: url.into(),
                detail,
            });
        }
        fs::rename(&part, dest).map_err(|source| FetchError::Io {
            action: "rename the download to",
            path: dest.into(),
            source,
        })
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
    /// The file name the controller looks for in an MC node's host cache
    /// (`/var/lib/capk/images`) for `spec.image.flatcar` with this channel and version.
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
    let out = &request.out;
    fs::create_dir_all(out).map_err(|source| FetchError::Io {
        action: "create the output directory",
        path: out.clone(),
        source,
    })?;
    let io = |action: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| FetchError::Io {
            action,
            path,
            source,
        }
    };
    // A Containerfile from an earlier run must not outlive a failed one.
    let containerfile = out.join(CONTAINERFILE);
    if containerfile.exists() {
        fs::remove_file(&containerfile).map_err(io("remove", &containerfile))?;
    }

    // 1. The release: version.txt of the requested directory, signed.
    let (txt_url, txt_sig_url) = match request.version {
        VersionSpec::Current => request.server.current_version_txt(request.arch),
        VersionSpec::Exact(v) => {
            let urls = request.server.qemu_release(request.arch, v);
            (urls.version_txt, urls.version_txt_sig)
        }
    };
    let txt = out.join(VERSION_TXT);
    let txt_sig = out.join(format!("{VERSION_TXT}.sig"));
    download.download(&txt_url, &txt)?;
    download.download(&txt_sig_url, &txt_sig)?;
    verifier
        .verify(&txt_sig, &txt)
        .map_err(|source| FetchError::Signature {
            file: VERSION_TXT.into(),
            source,
        })?;
    let text = fs::read_to_string(&txt).map_err(io("read", &txt))?;
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

    // 2. The disk's DIGESTS and signature (small: always fetched again).
    let urls = request.server.qemu_release(request.arch, version);
    let name = request.arch.qemu_image_file();
    let image = out.join(name);
    let sig = out.join(format!("{name}.sig"));
    let digests_file = out.join(format!("{name}.DIGESTS"));
    download.download(&urls.image_sig, &sig)?;
    download.download(&urls.image_digests, &digests_file)?;
    let digests_text = fs::read_to_string(&digests_file).map_err(io("read", &digests_file))?;
    let digests = Digests::parse(&digests_text).map_err(|source| FetchError::Digests {
        file: name.into(),
        source,
    })?;

    // 3. The disk: reused when a previous run left a verified copy, else downloaded.
    let mut reused = false;
    if image.exists() {
        match verify_disk(&image, name, &digests, &sig, verifier) {
            Ok(_) => reused = true,
            Err(_) => fs::remove_file(&image).map_err(io("remove the stale", &image))?,
        }
    }
    if !reused {
        download.download(&urls.image, &image)?;
    }
    let (sha512, signature) = match verify_disk(&image, name, &digests, &sig, verifier) {
        Ok(checked) => checked,
        Err(err) => {
            let _ = fs::remove_file(&image);
            return Err(err);
        }
    };

    // 4. The Containerfile, last.
    let disk = DiskImage {
        channel: request.channel,
        version,
        arch: request.arch,
        file: name.into(),
        sha512: sha512.clone(),
        source_url: urls.image,
        signed_by: signature.primary_key.clone(),
    };
    let sha256 = sha256_file(&image).map_err(io("read", &image))?;
    fs::write(&containerfile, disk.containerfile()).map_err(io("write", &containerfile))?;
    Ok(Fetched {
        version,
        image,
        sha512,
        sha256,
        signature,
        containerfile,
        reused,
    })
}

/// The disk's SHA-512 against DIGESTS (cheap to explain), its signature, then its format.
fn verify_disk(
    image: &Path,
    name: &str,
    digests: &Digests,
    sig: &Path,
    verifier: &SignatureVerifier,
) -> Result<(String, GoodSignature), FetchError> {
    let sha512 = digests
        .verify_sha512(image, name)
        .map_err(|source| FetchError::Digests {
            file: name.into(),
            source,
        })?;
    let signature = verifier
        .verify(sig, image)
        .map_err(|source| FetchError::Signature {
            file: name.into(),
            source,
        })?;
    let mut magic = [0u8; 4];
    let qcow2 = fs::File::open(image)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && magic == *b"QFI\xfb";
    if !qcow2 {
        return Err(FetchError::NotQcow2(image.into()));
    }
    Ok((sha512, signature))
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
                    detail: e.to_string(),
                })
        }
    }

    const VERSION_TXT_4230: &str = "FLATCAR_BUILD=4230\nFLATCAR_BRANCH=2\nFLATCAR_PATCH=3\n\
        FLATCAR_VERSION=4230.2.3\nFLATCAR_VERSION_ID=4230.2.3\nFLATCAR_BUILD_ID=\"\"\n\
        FLATCAR_SDK_VERSION=4230.0.0\n";
    const IMAGE: &str = "flatcar_production_qemu_image.img";

    /// A release tree like Flatcar's: `amd64-usr/{current,4230.2.3}/…`, signed by `key`.
    fn release_tree(key: &TestKey, root: &Path, disk: &[u8]) {
        for dir in ["current", "4230.2.3"] {
            let d = root.join("amd64-usr").join(dir);
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join("version.txt"), VERSION_TXT_4230).unwrap();
            key.sign(&d.join("version.txt"));
            let image = d.join(IMAGE);
            fs::write(&image, disk).unwrap();
            key.sign(&image);
            let sha = sha512_file(&image).unwrap();
            fs::write(
                d.join(format!("{IMAGE}.DIGESTS")),
                format!(
                    "# MD5 HASH\n{}  {IMAGE}\n# SHA1 HASH\n{}  {IMAGE}\n# SHA512 HASH\n{sha}  {IMAGE}\n",
                    "0".repeat(32),
                    "0".repeat(40)
                ),
            )
            .unwrap();
        }
    }

    fn setup(key: &TestKey) -> (tempfile::TempDir, Mirror, FetchRequest, SignatureVerifier) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("mirror");
        release_tree(
            key,
            &root,
            b"QFI\xfb\x00\x00\x00\x03 a tiny stand-in for the disk",
        );
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
        let err = fetch(&request, &mirror, &verifier).unwrap_err();
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
        assert!(!request.out.join(IMAGE).exists());
        assert!(!request.out.join(CONTAINERFILE).exists());

        // DIGESTS rewritten to match, but the signature still refuses it.
        let sha = sha512_file(&served).unwrap();
        fs::write(
            served.with_file_name(format!("{IMAGE}.DIGESTS")),
            format!("# SHA512 HASH\n{sha}  {IMAGE}\n"),
        )
        .unwrap();
        let err = fetch(&request, &mirror, &verifier).unwrap_err();
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
        assert!(!request.out.join(IMAGE).exists());
        assert!(!request.out.join(CONTAINERFILE).exists());
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
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("mirror");
        // A bzip2 stream, as the old .img.bz2 downloads are.
        release_tree(&key, &root, b"BZh91AY&SY not a qcow2");
        let base = "https://mirror.example/f".to_owned();
        let mirror = Mirror {
            base: base.clone(),
            root,
            fetched: RefCell::new(vec![]),
        };
        let request = FetchRequest {
            channel: Channel::Stable,
            version: VersionSpec::Current,
            arch: Arch::Amd64,
            server: ReleaseServer::mirror(&base).unwrap(),
            out: dir.path().join("out"),
        };
        let verifier = SignatureVerifier::from_key(&key.public_binary(), None).unwrap();
        let err = fetch(&request, &mirror, &verifier).unwrap_err();
        assert!(matches!(err, FetchError::NotQcow2(_)), "{err:?}");
        assert!(!request.out.join(CONTAINERFILE).exists());
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
            matches!(&err, FetchError::Download { url, detail } if url == "http://127.0.0.1:9/x" && detail.contains("not supported")),
            "{err:?} (curl comes from the Debian package curl)"
        );
        assert!(!dest.exists());
    }
}
