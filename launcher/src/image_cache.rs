//! The MC node's node-image cache (`/var/lib/capk/images` on the host), filled by the machine
//! Pod's `fetch-image` init container for `spec.image.url` and `spec.image.flatcar` (and for a
//! KVMMachine without an image: the controller's pinned Flatcar release).
//!
//! - **Names come from what was asked, never from the URL**: `sha256-<digest>.img` for a URL,
//!   `flatcar-<channel>-<version>.img` for a release. Nothing is written outside the cache
//!   directory, whatever a tenant's URL says.
//! - **One download per node and file**: an exclusive `flock` on `.<name>.lock` in the cache;
//!   Pods starting together on a node wait for the first one's download and reuse it.
//! - **Only verified files get their name**: the download goes to `.work/<name>…` and is renamed
//!   after its sha256 (URL) or its signature and SHA-512 (Flatcar, checked by
//!   [`capk_flatcar_image::fetch`]) matched; a mismatch deletes it. A killed download leaves a
//!   `.part` that the next run continues with an HTTP Range request (or starts over when the
//!   server does not do ranges, or the continued file does not verify).
//! - **Least recently used files go first, never one in use**: every Pod start and every
//!   launcher start touch the file's modification time (use = mtime); a running launcher holds a
//!   shared `flock` on the node image it booted ([`crate::disk::open_base`]). When the cache is
//!   over its limit, the files least recently used, not locked, and not touched within the grace
//!   period (a Pod between its init container and its launcher, or a launcher waiting out the
//!   kubelet's restart back-off of at most 5 minutes, holds no lock) are deleted.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use capk_api::file_error::FileError;
use capk_flatcar_image::digests::sha256_file;
use capk_flatcar_image::fetch::{
    Curl, Download, FetchError, FetchRequest, fetch, redact_url, validate_url,
};
use capk_flatcar_image::release::{Arch, Channel, FlatcarVersion, ReleaseServer};
use capk_flatcar_image::signature::SignatureVerifier;
use thiserror::Error;

/// Condition reason (the KVMMachine's `Ready`) of a node image that could not be downloaded.
pub const REASON_DOWNLOAD_FAILED: &str = "ImageDownloadFailed";
/// Condition reason of a node image that was downloaded but did not verify.
pub const REASON_VERIFICATION_FAILED: &str = "ImageVerificationFailed";

/// Where the work files (partial downloads, Flatcar's signatures) live, inside the cache.
const WORK_DIR: &str = ".work";

/// What to put in the cache.
#[derive(Clone, Debug)]
pub enum ImageSource {
    /// A disk image at a URL (http or https), checked against its sha256.
    Url {
        /// The URL (tenant input: shown only through [`redact_url`]).
        url: String,
        /// Expected sha256, 64 lower-case hex digits.
        sha256: String,
    },
    /// A Flatcar release's QEMU image, checked by its signature and DIGESTS.
    Flatcar {
        /// The channel.
        channel: Channel,
        /// The pinned release.
        version: FlatcarVersion,
        /// Flatcar's release server for the channel, or a mirror.
        server: ReleaseServer,
    },
}

impl ImageSource {
    /// A URL image, checked: http(s) only, a well-formed sha256.
    pub fn url(url: &str, sha256: &str) -> Result<Self, ImageCacheError> {
        validate_url(url).map_err(|e| ImageCacheError::Source(e.to_string()))?;
        if sha256.len() != 64
            || !sha256
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(ImageCacheError::Source(format!(
                "sha256 {sha256:?} is not 64 lower-case hex digits"
            )));
        }
        Ok(ImageSource::Url {
            url: url.into(),
            sha256: sha256.into(),
        })
    }

    /// A Flatcar release, from Flatcar's server or `mirror` (http allowed: the version is
    /// pinned and its signed version.txt must name it).
    pub fn flatcar(
        channel: Channel,
        version: FlatcarVersion,
        mirror: Option<&str>,
    ) -> Result<Self, ImageCacheError> {
        let server = match mirror {
            Some(base) => ReleaseServer::mirror_allowing_http(base)
                .map_err(|e| ImageCacheError::Source(e.to_string()))?,
            None => ReleaseServer::upstream(channel),
        };
        Ok(ImageSource::Flatcar {
            channel,
            version,
            server,
        })
    }

    /// The file's name in the cache (the controller never needs it: the Pod boots the link
    /// the init container writes).
    pub fn cache_name(&self) -> String {
        match self {
            ImageSource::Url { sha256, .. } => format!("sha256-{sha256}.img"),
            ImageSource::Flatcar {
                channel, version, ..
            } => format!("flatcar-{channel}-{version}.img"),
        }
    }

    /// What the source is, for messages (a URL without its credentials).
    pub fn describe(&self) -> String {
        match self {
            ImageSource::Url { url, .. } => redact_url(url),
            ImageSource::Flatcar {
                channel, version, ..
            } => format!("Flatcar {channel} {version}"),
        }
    }
}

/// How the cache is kept and downloads are made.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// The cache directory (the host's `/var/lib/capk/images`, mounted in the Pod).
    pub dir: PathBuf,
    /// Most bytes the cache's images may take; also the most one download may hold.
    pub max_bytes: u64,
    /// A file used (fetched or reused) more recently than this is never evicted.
    pub grace: Duration,
    /// curl, with its attempts and timeouts.
    pub curl: Curl,
    /// Checks Flatcar signatures (the shipped Flatcar key).
    pub verifier: SignatureVerifier,
}

/// Errors of filling the cache; [`ImageCacheError::reason`] is the KVMMachine's `Ready` reason.
#[derive(Debug, Error)]
pub enum ImageCacheError {
    /// The source is not one the cache takes.
    #[error("{0}")]
    Source(String),
    /// The download failed (HTTP status and URL in the message).
    #[error("cannot fetch node image {what}")]
    Download {
        /// The image.
        what: String,
        /// Why.
        #[source]
        source: Box<FetchError>,
    },
    /// The download is not the file asked for.
    #[error("{what}: sha256 is {actual}, expected {expected}; the download was deleted")]
    Digest {
        /// The image (URL without credentials).
        what: String,
        /// What the spec says.
        expected: String,
        /// What arrived.
        actual: String,
    },
    /// A Flatcar release did not verify (signature, DIGESTS, version, format).
    #[error("node image {what} does not verify")]
    Verify {
        /// The release.
        what: String,
        /// Why.
        #[source]
        source: Box<FetchError>,
    },
    /// The cache directory could not be used.
    #[error(transparent)]
    Io(#[from] FileError),
}

impl ImageCacheError {
    /// The KVMMachine's `Ready` reason for this failure.
    pub fn reason(&self) -> &'static str {
        match self {
            ImageCacheError::Digest { .. } | ImageCacheError::Verify { .. } => {
                REASON_VERIFICATION_FAILED
            }
            _ => REASON_DOWNLOAD_FAILED,
        }
    }
}

/// What [`fill`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filled {
    /// The verified image in the cache.
    pub path: PathBuf,
    /// Whether it was downloaded now (false: it was in the cache).
    pub downloaded: bool,
    /// Files deleted to keep the cache within its limit, and abandoned partial downloads
    /// (`.work/…`).
    pub evicted: Vec<String>,
}

/// Puts the image in the cache (once per node, verified), marks it used, and evicts what the
/// limit requires.
pub fn fill(source: &ImageSource, config: &CacheConfig) -> Result<Filled, ImageCacheError> {
    let name = source.cache_name();
    let dir = &config.dir;
    let work = dir.join(WORK_DIR);
    fs::create_dir_all(&work).map_err(FileError::at("create", &work))?;
    let final_path = dir.join(&name);

    let lock_path = dir.join(format!(".{name}.lock"));
    let lock = File::create(&lock_path).map_err(FileError::at("create the lock", &lock_path))?;
    if lock.try_lock().is_err() {
        tracing::info!(image = %source.describe(), "another machine Pod on this node fetches it; waiting");
        lock.lock().map_err(FileError::at("lock", &lock_path))?;
    }

    // A hit is marked used under the lock, so an eviction (which takes the same lock and looks
    // at the mark again) cannot delete it on its way to this Pod.
    let downloaded = match mark_used(&final_path) {
        Ok(()) => false,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let download = work.join(&name);
            match source {
                ImageSource::Url { url, sha256 } => {
                    fetch_url(url, sha256, &download, &final_path, config)?
                }
                ImageSource::Flatcar {
                    channel,
                    version,
                    server,
                } => fetch_flatcar(*channel, *version, server, &download, &final_path, config)?,
            }
            mark_used(&final_path).map_err(FileError::at("mark as used", &final_path))?;
            true
        }
        Err(e) => return Err(FileError::at("mark as used", &final_path)(e).into()),
    };
    drop(lock);

    let mut evicted = evict(dir, config.max_bytes, config.grace, &name)?;
    evicted.extend(remove_stale_work(dir, config.grace)?);
    Ok(Filled {
        path: final_path,
        downloaded,
        evicted,
    })
}

/// Use = modification time: the least recently used files are evicted first.
fn mark_used(path: &Path) -> std::io::Result<()> {
    File::options()
        .append(true)
        .open(path)?
        .set_modified(SystemTime::now())
}

/// Downloads a URL image (continuing a `.part` left by a killed run), checks its sha256 and
/// renames it. A continued download that does not match is started over once.
fn fetch_url(
    url: &str,
    sha256: &str,
    download: &Path,
    final_path: &Path,
    config: &CacheConfig,
) -> Result<(), ImageCacheError> {
    let what = redact_url(url);
    // The download's sha256 when it is not the one asked for (then it is deleted).
    let attempt = || -> Result<Option<String>, ImageCacheError> {
        config
            .curl
            .download(url, download)
            .map_err(|source| ImageCacheError::Download {
                what: what.clone(),
                source: Box::new(source),
            })?;
        let actual = sha256_file(download).map_err(FileError::at("read", download))?;
        if actual == sha256 {
            fs::rename(download, final_path).map_err(FileError::at("rename to", final_path))?;
            return Ok(None);
        }
        fs::remove_file(download).map_err(FileError::at("remove", download))?;
        Ok(Some(actual))
    };
    let continued = Path::new(&format!("{}.part", download.display())).exists();
    let mut mismatch = attempt()?;
    if mismatch.is_some() && continued {
        tracing::warn!(image = %what, "the continued download does not match its sha256; starting over");
        mismatch = attempt()?;
    }
    match mismatch {
        None => Ok(()),
        Some(actual) => Err(ImageCacheError::Digest {
            what,
            expected: sha256.into(),
            actual,
        }),
    }
}

/// Fetches a Flatcar release into its work directory with the `images/flatcar` recipe (version,
/// signatures, DIGESTS, qcow2 format all checked) and renames the disk.
fn fetch_flatcar(
    channel: Channel,
    version: FlatcarVersion,
    server: &ReleaseServer,
    work: &Path,
    final_path: &Path,
    config: &CacheConfig,
) -> Result<(), ImageCacheError> {
    let what = format!("Flatcar {channel} {version}");
    let request = FetchRequest {
        channel,
        version: capk_flatcar_image::release::VersionSpec::Exact(version),
        arch: Arch::Amd64,
        server: server.clone(),
        out: work.to_path_buf(),
    };
    // Downloads that failed are download failures; everything else the recipe refuses
    // (signature, DIGESTS, version.txt, format) is a verification failure.
    let fetched = fetch(&request, &config.curl, &config.verifier).map_err(|source| {
        let what = what.clone();
        match source {
            FetchError::Download { .. }
            | FetchError::BadUrl(_)
            | FetchError::SpawnCurl { .. }
            | FetchError::Io(_) => ImageCacheError::Download {
                what,
                source: Box::new(source),
            },
            _ => ImageCacheError::Verify {
                what,
                source: Box::new(source),
            },
        }
    })?;
    fs::rename(&fetched.image, final_path).map_err(FileError::at("rename to", final_path))?;
    fs::remove_dir_all(work).map_err(FileError::at("remove", work))?;
    Ok(())
}

/// Points `link` at `image`, replacing what was there in one step (a new link, renamed).
pub fn link(image: &Path, link: &Path) -> Result<(), ImageCacheError> {
    let tmp = PathBuf::from(format!("{}.new", link.display()));
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(image, &tmp).map_err(FileError::at("link", &tmp))?;
    Ok(fs::rename(&tmp, link).map_err(FileError::at("rename the link to", link))?)
}

/// A cached image, as eviction sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedImage {
    /// File name in the cache.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Last use (modification time).
    pub used: SystemTime,
    /// A running launcher holds it.
    pub in_use: bool,
}

/// Pure: which images to delete, least recently used first, until the cache fits `max_bytes`;
/// never one in use, used within `grace` of `now`, or `keep` (the one being handed out).
pub fn eviction_plan(
    images: &[CachedImage],
    max_bytes: u64,
    grace: Duration,
    now: SystemTime,
    keep: &str,
) -> Vec<String> {
    let mut total: u64 = images.iter().map(|i| i.bytes).sum();
    let mut candidates: Vec<&CachedImage> = images
        .iter()
        .filter(|i| !i.in_use && i.name != keep)
        .filter(|i| now.duration_since(i.used).is_ok_and(|age| age >= grace))
        .collect();
    candidates.sort_by_key(|i| i.used);
    let mut out = Vec::new();
    for i in candidates {
        if total <= max_bytes {
            break;
        }
        total -= i.bytes;
        out.push(i.name.clone());
    }
    out
}

/// Lists the cache's images and deletes what [`eviction_plan`] says. Each deletion holds the
/// image's download lock (no Pod is marking it used) and an exclusive `flock` on the image
/// itself (no launcher holds its shared one), both taken without waiting, and looks at the use
/// mark again: what is in use or was just used is skipped.
fn evict(
    dir: &Path,
    max_bytes: u64,
    grace: Duration,
    keep: &str,
) -> Result<Vec<String>, ImageCacheError> {
    let mut images = Vec::new();
    for entry in fs::read_dir(dir).map_err(FileError::at("list", dir))? {
        let entry = entry.map_err(FileError::at("list", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Ok(meta) = entry.metadata() else { continue };
        if name.starts_with('.') || !name.ends_with(".img") || !meta.is_file() {
            continue;
        }
        let in_use = File::open(entry.path()).is_ok_and(|f| f.try_lock().is_err());
        images.push(CachedImage {
            name,
            bytes: meta.len(),
            used: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            in_use,
        });
    }
    let plan = eviction_plan(&images, max_bytes, grace, SystemTime::now(), keep);
    let mut evicted = Vec::new();
    for name in plan {
        let path = dir.join(&name);
        let download_lock = File::create(dir.join(format!(".{name}.lock")))
            .ok()
            .filter(|f| f.try_lock().is_ok());
        let image = File::open(&path).ok().filter(|f| f.try_lock().is_ok());
        let idle = image
            .as_ref()
            .and_then(|f| f.metadata().ok())
            .and_then(|m| m.modified().ok())
            .is_some_and(|used| {
                SystemTime::now()
                    .duration_since(used)
                    .is_ok_and(|a| a >= grace)
            });
        if download_lock.is_none() || !idle {
            continue;
        }
        fs::remove_file(&path).map_err(FileError::at("evict", &path))?;
        tracing::info!(image = %name, "evicted from the node-image cache (least recently used, not in use)");
        evicted.push(name);
    }
    let left: u64 = images
        .iter()
        .filter(|i| !evicted.contains(&i.name))
        .map(|i| i.bytes)
        .sum();
    if left > max_bytes {
        tracing::warn!(
            bytes = left,
            max_bytes,
            "the node-image cache stays over its limit: every other image in it is in use or was used recently"
        );
    }
    Ok(evicted)
}

/// Deletes partial downloads nobody continues: a Pod retrying a download holds its lock while
/// it runs and comes back within the kubelet's back-off (at most 5 minutes), so a work entry
/// whose lock is free and that did not change within `grace` was left by a Pod that is gone.
fn remove_stale_work(dir: &Path, grace: Duration) -> Result<Vec<String>, ImageCacheError> {
    let work = dir.join(WORK_DIR);
    let mut removed = Vec::new();
    for entry in fs::read_dir(&work).map_err(FileError::at("list", &work))? {
        let entry = entry.map_err(FileError::at("list", &work))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        // `<cache name>`, `<cache name>.part` or the Flatcar recipe's directory `<cache name>`.
        let Some(end) = name.find(".img") else {
            continue;
        };
        let lock = File::create(dir.join(format!(".{}.lock", &name[..end + 4])))
            .ok()
            .filter(|f| f.try_lock().is_ok());
        let path = entry.path();
        let mut changed = vec![entry.metadata().and_then(|m| m.modified())];
        if path.is_dir() {
            changed.extend(
                fs::read_dir(&path)
                    .map_err(FileError::at("list", &path))?
                    .flatten()
                    .map(|e| e.metadata().and_then(|m| m.modified())),
            );
        }
        let idle = changed.into_iter().all(|m| {
            m.is_ok_and(|t| {
                SystemTime::now()
                    .duration_since(t)
                    .is_ok_and(|age| age >= grace)
            })
        });
        if lock.is_none() || !idle {
            continue;
        }
        if path.is_dir() {
            fs::remove_dir_all(&path).map_err(FileError::at("remove", &path))?;
        } else {
            fs::remove_file(&path).map_err(FileError::at("remove", &path))?;
        }
        tracing::info!(work = %name, "removed an abandoned partial download from the node-image cache");
        removed.push(format!("{WORK_DIR}/{name}"));
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eviction_takes_the_least_recently_used_idle_images_until_the_cache_fits() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let img = |name: &str, gib: u64, age_min: u64, in_use: bool| CachedImage {
            name: name.into(),
            bytes: gib << 30,
            used: t0 - Duration::from_secs(age_min * 60),
            in_use,
        };
        let images = [
            img("oldest-in-use.img", 4, 500, true),
            img("old.img", 4, 300, false),
            img("older.img", 2, 400, false),
            img("recent.img", 4, 5, false),
            img("new.img", 4, 0, false),
        ];
        let grace = Duration::from_secs(600);
        // 18 GiB in a 10 GiB cache: the idle ones by age (older, old), never the one in use,
        // the recently used one or the one being handed out; over the limit stays over.
        assert_eq!(
            eviction_plan(&images, 10 << 30, grace, t0, "new.img"),
            ["older.img", "old.img"]
        );
        assert_eq!(
            eviction_plan(&images, 16 << 30, grace, t0, "new.img"),
            ["older.img"]
        );
        assert!(eviction_plan(&images, 18 << 30, grace, t0, "new.img").is_empty());
    }

    #[test]
    fn cache_names_come_from_the_digest_or_the_release_never_from_the_url() {
        let sha = "ab".repeat(32);
        let url = ImageSource::url("https://x.example/../../etc/passwd?t=1", &sha).unwrap();
        assert_eq!(url.cache_name(), format!("sha256-{sha}.img"));
        assert_eq!(url.describe(), "https://x.example/../../etc/passwd");
        let flatcar =
            ImageSource::flatcar(Channel::Beta, "4230.1.0".parse().unwrap(), None).unwrap();
        assert_eq!(flatcar.cache_name(), "flatcar-beta-4230.1.0.img");
        for (u, s) in [
            ("file:///etc/shadow", sha.as_str()),
            ("https://x/y", "AB"),
            ("https://x/y", &"AB".repeat(32)),
        ] {
            assert!(ImageSource::url(u, s).is_err(), "{u} {s}");
        }
        assert!(
            ImageSource::flatcar(Channel::Stable, "1.2.3".parse().unwrap(), Some("ftp://m"))
                .is_err()
        );
    }
}
