//! `capk-launcher fetch-image`, the machine Pod's init container that puts `spec.image.url` and
//! `spec.image.flatcar` images into the MC node's cache, against a real HTTP server on loopback
//! (std TcpListener, requests parsed by httparse) and the real curl and gpgv: a good download, a
//! wrong digest, a 404, a server that stalls mid-file, a killed download continued, two Pods
//! fetching one file at once, a signed Flatcar release from a mirror, and eviction.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Result, bail};

/// How the server misbehaves.
#[derive(Clone, Copy, Default)]
struct Behaviour {
    /// Bytes per second (0: as fast as possible).
    rate: usize,
    /// Stop sending, keeping the connection open, at this offset of the file.
    stall_at: Option<usize>,
}

#[derive(Default)]
struct ServerState {
    files: HashMap<String, Vec<u8>>,
    behaviour: Behaviour,
    /// (path, range start) of every GET.
    gets: Vec<(String, u64)>,
}

/// An HTTP/1.1 file server on 127.0.0.1 that honours `Range: bytes=N-`.
struct Server {
    base: String,
    state: Arc<Mutex<ServerState>>,
}

impl Server {
    fn start() -> Result<Server> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let base = format!("http://{}", listener.local_addr()?);
        let state = Arc::new(Mutex::new(ServerState::default()));
        let shared = state.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let state = shared.clone();
                std::thread::spawn(move || {
                    let _ = serve(stream, &state);
                });
            }
        });
        Ok(Server { base, state })
    }

    fn put(&self, path: &str, content: &[u8]) {
        let mut s = self.state.lock().unwrap();
        s.files.insert(path.into(), content.to_vec());
    }

    fn behave(&self, b: Behaviour) {
        self.state.lock().unwrap().behaviour = b;
    }

    fn gets(&self, path: &str) -> Vec<u64> {
        let s = self.state.lock().unwrap();
        s.gets
            .iter()
            .filter(|(p, _)| p == path)
            .map(|(_, from)| *from)
            .collect()
    }
}

fn serve(mut stream: TcpStream, state: &Mutex<ServerState>) -> Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let (path, from) = loop {
        let n = stream.read(&mut chunk)?;
        if n == 0 || buf.len() > 64 * 1024 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        if req.parse(&buf)?.is_complete() {
            let path = req
                .path
                .unwrap_or("/")
                .split('?')
                .next()
                .unwrap()
                .to_owned();
            let from = req
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("range"))
                .and_then(|h| std::str::from_utf8(h.value).ok())
                .and_then(|v| v.strip_prefix("bytes="))
                .and_then(|v| v.strip_suffix('-'))
                .and_then(|v| v.parse::<u64>().ok());
            break (path, from);
        }
    };
    let (content, behaviour) = {
        let mut s = state.lock().unwrap();
        s.gets.push((path.clone(), from.unwrap_or(0)));
        (s.files.get(&path).cloned(), s.behaviour)
    };
    let Some(content) = content else {
        stream.write_all(
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )?;
        return Ok(());
    };
    let start = from.unwrap_or(0) as usize;
    if start >= content.len() && from.is_some() {
        stream.write_all(
            b"HTTP/1.1 416 Range Not Satisfiable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )?;
        return Ok(());
    }
    let head = match from {
        Some(_) => format!(
            "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {start}-{}/{}\r\n",
            content.len() - 1,
            content.len()
        ),
        None => "HTTP/1.1 200 OK\r\n".to_owned(),
    };
    stream.write_all(
        format!(
            "{head}Content-Length: {}\r\nConnection: close\r\n\r\n",
            content.len() - start
        )
        .as_bytes(),
    )?;
    let block = if behaviour.rate > 0 {
        (behaviour.rate / 10).max(1)
    } else {
        64 * 1024
    };
    let mut at = start;
    while at < content.len() {
        if behaviour.stall_at.is_some_and(|s| at >= s) {
            // Open and silent: only the client's stall timeout ends this.
            std::thread::sleep(Duration::from_secs(3600));
        }
        let mut end = (at + block).min(content.len());
        if let Some(s) = behaviour.stall_at.filter(|s| *s > at) {
            end = end.min(s);
        }
        stream.write_all(&content[at..end])?;
        at = end;
        if behaviour.rate > 0 {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(())
}

/// Varied bytes, so a misplaced range shows in the digest.
fn image(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_add(seed).wrapping_mul(2654435761) >> 13) as u8)
        .collect()
}

fn sha256(data: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("f");
    std::fs::write(&f, data).unwrap();
    capk_flatcar_image::digests::sha256_file(&f).unwrap()
}

/// A disk image served at `<base>/disk.img`.
struct Served {
    server: Server,
    disk: Vec<u8>,
    sum: String,
    url: String,
}

/// Serves `len` varied bytes at `/disk.img`, behaving as `behaviour` says.
fn serve_disk(len: usize, seed: u32, behaviour: Behaviour) -> Result<Served> {
    curl_or_fail()?;
    let server = Server::start()?;
    let disk = image(len, seed);
    let sum = sha256(&disk);
    server.put("/disk.img", &disk);
    server.behave(behaviour);
    let url = format!("{}/disk.img", server.base);
    Ok(Served {
        server,
        disk,
        sum,
        url,
    })
}

/// A machine Pod's view: the node's cache, the Pod's link and termination log.
struct Pod {
    _dir: tempfile::TempDir,
    cache: PathBuf,
    link: PathBuf,
    termination_log: PathBuf,
}

impl Pod {
    fn new() -> Result<Pod> {
        let dir = tempfile::tempdir()?;
        let cache = dir.path().join("cache");
        std::fs::create_dir(&cache)?;
        Ok(Pod {
            cache,
            link: dir.path().join("node-image"),
            termination_log: dir.path().join("termination-log"),
            _dir: dir,
        })
    }

    /// Another Pod on the same node: the same cache, its own link and log.
    fn sibling(&self) -> Result<Pod> {
        let mut p = Pod::new()?;
        p.cache = self.cache.clone();
        Ok(p)
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_capk-launcher"));
        c.arg("fetch-image")
            .arg("--cache-dir")
            .arg(&self.cache)
            .arg("--link")
            .arg(&self.link)
            .arg("--termination-log")
            .arg(&self.termination_log)
            .args(["--connect-timeout-seconds", "2", "--stall-seconds", "2"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    /// Started in its own process group, so that it and its curl can be killed together.
    fn spawn(&self, args: &[&str]) -> Result<Child> {
        use std::os::unix::process::CommandExt as _;
        Ok(self.command(args).process_group(0).spawn()?)
    }

    fn run(&self, args: &[&str]) -> Result<Output> {
        Ok(self.command(args).output()?)
    }

    fn message(&self) -> String {
        std::fs::read_to_string(&self.termination_log).unwrap_or_default()
    }

    /// The cache's files other than lock files.
    fn cached(&self) -> Vec<String> {
        let mut names = Vec::new();
        let mut walk = vec![self.cache.clone()];
        while let Some(d) = walk.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                if e.file_type().unwrap().is_dir() {
                    walk.push(e.path());
                } else {
                    let rel = e
                        .path()
                        .strip_prefix(&self.cache)
                        .unwrap()
                        .display()
                        .to_string();
                    if !rel.ends_with(".lock") {
                        names.push(rel);
                    }
                }
            }
        }
        names.sort();
        names
    }
}

fn log(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn curl_or_fail() -> Result<()> {
    let ok = Command::new("curl")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        bail!(
            "curl is missing: apt-get install curl (hack/debian-packages.txt; .ci/run installs it)"
        );
    }
    Ok(())
}

#[test]
fn a_url_image_is_downloaded_verified_and_linked_then_reused_without_a_download() -> Result<()> {
    let Served {
        server,
        disk,
        sum,
        url,
    } = serve_disk(3 << 20, 1, Behaviour::default())?;
    let pod = Pod::new()?;
    let out = pod.run(&["--url", &url, "--sha256", &sum])?;
    assert!(out.status.success(), "{}", log(&out));
    let name = format!("sha256-{sum}.img");
    assert_eq!(std::fs::read_link(&pod.link)?, pod.cache.join(&name));
    assert_eq!(
        std::fs::read(&pod.link)?,
        disk,
        "the Pod boots the served image"
    );
    assert_eq!(
        pod.cached(),
        vec![name.clone()],
        "no partial or work file stays"
    );

    // Another Pod on the node later: the cached file, no download.
    let later = pod.sibling()?;
    let out = later.run(&["--url", &url, "--sha256", &sum])?;
    assert!(out.status.success(), "{}", log(&out));
    assert_eq!(std::fs::read_link(&later.link)?, pod.cache.join(&name));
    assert_eq!(server.gets("/disk.img").len(), 1);
    Ok(())
}

#[test]
fn a_wrong_digest_names_both_digests_and_leaves_no_file() -> Result<()> {
    // The server thread serves on after the handle is gone.
    let Served {
        sum: actual, url, ..
    } = serve_disk(1 << 20, 2, Behaviour::default())?;
    let pod = Pod::new()?;
    let wanted = "0".repeat(64);
    let out = pod.run(&["--url", &url, "--sha256", &wanted])?;
    assert!(!out.status.success());
    let msg = pod.message();
    assert!(msg.starts_with("ImageVerificationFailed: "), "{msg}");
    assert!(msg.contains(&actual) && msg.contains(&wanted), "{msg}");
    assert!(msg.contains(&url), "{msg}");
    assert_eq!(msg.lines().count(), 1, "{msg}");
    assert!(pod.cached().is_empty(), "{:?}", pod.cached());
    assert!(!pod.link.exists());
    Ok(())
}

#[test]
fn a_404_names_the_status_and_the_url_without_its_credentials() -> Result<()> {
    curl_or_fail()?;
    let server = Server::start()?;
    let pod = Pod::new()?;
    let host = server.base.trim_start_matches("http://");
    let url = format!("http://tenant:s3cret@{host}/missing.img?token=s3cret");
    let out = pod.run(&["--url", &url, "--sha256", &"a".repeat(64)])?;
    assert!(!out.status.success());
    let msg = pod.message();
    assert!(msg.starts_with("ImageDownloadFailed: "), "{msg}");
    assert!(msg.contains(&format!("http://{host}/missing.img")), "{msg}");
    assert!(msg.contains("HTTP 404"), "{msg}");
    assert!(
        !msg.contains("s3cret") && !log(&out).contains("s3cret"),
        "{msg}"
    );
    // A 404 is not retried.
    assert_eq!(server.gets("/missing.img").len(), 1);
    assert!(pod.cached().is_empty());
    Ok(())
}

#[test]
fn a_file_url_is_refused_before_anything_is_fetched() -> Result<()> {
    let pod = Pod::new()?;
    let out = pod.run(&["--url", "file:///etc/shadow", "--sha256", &"a".repeat(64)])?;
    assert!(!out.status.success());
    let msg = pod.message();
    assert!(
        msg.starts_with("ImageDownloadFailed: ") && msg.contains("not an http:// or https:// URL"),
        "{msg}"
    );
    assert!(pod.cached().is_empty());
    Ok(())
}

#[test]
fn a_server_that_stalls_mid_file_fails_in_bounded_time_and_the_next_run_continues() -> Result<()> {
    let Served {
        server,
        disk,
        sum,
        url,
    } = serve_disk(
        2 << 20,
        3,
        Behaviour {
            rate: 0,
            stall_at: Some(1 << 20),
        },
    )?;
    let pod = Pod::new()?;
    let started = Instant::now();
    let out = pod.run(&["--url", &url, "--sha256", &sum, "--attempts", "2"])?;
    let took = started.elapsed();
    assert!(!out.status.success(), "{}", log(&out));
    // Two attempts of a 2 s stall limit and a 1 s back-off, with curl's own slack.
    assert!(took < Duration::from_secs(20), "took {took:?}");
    let msg = pod.message();
    assert!(msg.starts_with("ImageDownloadFailed: "), "{msg}");
    assert!(msg.contains("no progress for 2 s"), "{msg}");
    assert!(!pod.link.exists());
    assert!(
        !pod.cached().iter().any(|f| f.starts_with("sha256-")),
        "{:?}",
        pod.cached()
    );

    // The kubelet restarts the container; the server works again: the download continues
    // where it stopped, and what results verifies.
    server.behave(Behaviour::default());
    let out = pod.run(&["--url", &url, "--sha256", &sum])?;
    assert!(out.status.success(), "{}", log(&out));
    assert_eq!(std::fs::read(&pod.link)?, disk);
    let gets = server.gets("/disk.img");
    assert_eq!(gets.first(), Some(&0));
    assert_eq!(
        gets.last(),
        Some(&(1 << 20)),
        "continued at the stall: {gets:?}"
    );
    Ok(())
}

#[test]
fn a_killed_download_is_continued_by_the_next_run() -> Result<()> {
    let Served {
        server,
        disk,
        sum,
        url,
    } = serve_disk(
        4 << 20,
        4,
        Behaviour {
            rate: 1 << 20,
            stall_at: None,
        },
    )?;
    let pod = Pod::new()?;
    let mut child = pod.spawn(&["--url", &url, "--sha256", &sum])?;
    let part = pod.cache.join(format!(".work/sha256-{sum}.img.part"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::metadata(&part).map_or(0, |m| m.len()) < 1 << 20 {
        assert!(Instant::now() < deadline, "no partial download appeared");
        std::thread::sleep(Duration::from_millis(50));
    }
    // What the kubelet does to a container of a deleted Pod or an OOM kill: SIGKILL to all
    // its processes (here: its process group, the fetcher and its curl).
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    child.wait()?;
    std::thread::sleep(Duration::from_millis(200));
    let kept = std::fs::metadata(&part)?.len();
    assert!(!pod.cache.join(format!("sha256-{sum}.img")).exists());

    server.behave(Behaviour::default());
    let out = pod.run(&["--url", &url, "--sha256", &sum])?;
    assert!(out.status.success(), "{}", log(&out));
    assert_eq!(std::fs::read(&pod.link)?, disk);
    let gets = server.gets("/disk.img");
    assert!(
        gets.len() == 2 && gets[1] > 0 && gets[1] <= kept,
        "the second run continues the first's {kept} bytes: {gets:?}"
    );
    Ok(())
}

#[test]
fn two_pods_on_one_node_download_a_file_once() -> Result<()> {
    // Slow enough (2 s) that the second Pod starts while the first downloads.
    let Served {
        server,
        disk,
        sum,
        url,
    } = serve_disk(
        2 << 20,
        5,
        Behaviour {
            rate: 1 << 20,
            stall_at: None,
        },
    )?;
    let first = Pod::new()?;
    let second = first.sibling()?;
    let a = first.spawn(&["--url", &url, "--sha256", &sum])?;
    let b = second.spawn(&["--url", &url, "--sha256", &sum])?;
    for (pod, child) in [(&first, a), (&second, b)] {
        let out = child.wait_with_output()?;
        assert!(out.status.success(), "{}", log(&out));
        assert_eq!(std::fs::read(&pod.link)?, disk);
    }
    assert_eq!(
        server.gets("/disk.img").len(),
        1,
        "one download for both Pods"
    );
    Ok(())
}

#[test]
fn the_cache_evicts_the_least_recently_used_image_no_launcher_holds() -> Result<()> {
    let Served { sum, url, .. } = serve_disk(1 << 20, 6, Behaviour::default())?;
    let pod = Pod::new()?;
    let old = |name: &str, hours: u64| -> Result<std::fs::File> {
        let path = pod.cache.join(name);
        std::fs::write(&path, vec![0u8; 1 << 20])?;
        let f = std::fs::File::options().append(true).open(&path)?;
        f.set_modified(SystemTime::now() - Duration::from_secs(hours * 3600))?;
        Ok(f)
    };
    old("sha256-idle.img", 3)?;
    old("flatcar-stable-1.0.0.img", 1)?;
    // A running launcher holds its image with a shared flock (capk_launcher::disk::open_base).
    let held = old("sha256-running.img", 5)?;
    held.lock_shared()?;
    // A partial download of a Pod gone for hours, one of a Pod backing off right now.
    std::fs::create_dir(pod.cache.join(".work"))?;
    old(".work/sha256-abandoned.img.part", 2)?;
    std::fs::write(pod.cache.join(".work/sha256-retrying.img.part"), b"half")?;

    // Room for two images: the new one and one of the three old ones may stay.
    let out = pod.run(&["--url", &url, "--sha256", &sum, "--max-cache-size", "2Mi"])?;
    assert!(out.status.success(), "{}", log(&out));
    assert_eq!(
        pod.cached(),
        [
            ".work/sha256-retrying.img.part".to_owned(),
            format!("sha256-{sum}.img"),
            "sha256-running.img".to_owned()
        ],
        "the idle ones and the abandoned part went, least recently used first; the one in use \
         and the one being retried stayed: {}",
        log(&out)
    );
    Ok(())
}

/// A crash-looping launcher holds no lock while the kubelet backs off its restarts, and its Pod's
/// init container does not run again: each launcher start marks its image used, so an image
/// fetched when its Pod started hours ago is not evicted between two restarts.
#[test]
fn a_crash_looping_launchers_image_is_not_evicted_between_its_restarts() -> Result<()> {
    use capk_launcher::qemu::argv::{BaseImage, DiskFormat};
    let Served { sum, url, .. } = serve_disk(1 << 20, 7, Behaviour::default())?;
    let pod = Pod::new()?;
    // Fetched when their Pods started: the crash-looping machine's five hours ago, an image no
    // machine uses any more three hours ago.
    for (name, hours) in [("sha256-crashing.img", 5), ("sha256-idle.img", 3)] {
        let path = pod.cache.join(name);
        std::fs::write(&path, vec![0u8; 1 << 20])?;
        std::fs::File::options()
            .append(true)
            .open(&path)?
            .set_modified(SystemTime::now() - Duration::from_secs(hours * 3600))?;
    }
    // The crash-looping launcher's latest start: it opened its image for QEMU, then exited.
    let base = BaseImage {
        path: pod.cache.join("sha256-crashing.img"),
        format: DiskFormat::Raw,
    };
    drop(capk_launcher::disk::open_base(&base)?);

    // Another Pod's image arrives; room for two images.
    let out = pod.run(&["--url", &url, "--sha256", &sum, "--max-cache-size", "2Mi"])?;
    assert!(out.status.success(), "{}", log(&out));
    let mut kept = vec![
        format!("sha256-{sum}.img"),
        "sha256-crashing.img".to_owned(),
    ];
    kept.sort();
    assert_eq!(
        pod.cached(),
        kept,
        "the unused image went, the crash-looping machine's stayed: {}",
        log(&out)
    );
    Ok(())
}

/// A signed release tree (the throwaway key of images/flatcar), served by the test server.
fn serve_tree(server: &Server, root: &Path, prefix: &str) -> Result<()> {
    let mut walk = vec![root.to_path_buf()];
    while let Some(d) = walk.pop() {
        for e in std::fs::read_dir(&d)?.flatten() {
            if e.file_type()?.is_dir() {
                walk.push(e.path());
            } else {
                let rel = e.path().strip_prefix(root)?.display().to_string();
                server.put(&format!("{prefix}/{rel}"), &std::fs::read(e.path())?);
            }
        }
    }
    Ok(())
}

#[test]
fn a_flatcar_release_is_fetched_from_a_mirror_with_its_signature_checked() -> Result<()> {
    use capk_flatcar_image::testkey::TestKey;
    curl_or_fail()?;
    let Some(gpg) = TestKey::gpg_or_skip() else {
        return Ok(());
    };
    let key = TestKey::generate(&gpg, "capk mirror");
    let dir = tempfile::tempdir()?;
    let mut disk = b"QFI\xfb\x00\x00\x00\x03".to_vec();
    disk.extend(image(1 << 20, 7));
    key.release_tree(&dir.path().join("good"), "4230.2.3", &disk);
    key.release_tree(&dir.path().join("bad"), "4230.2.3", &disk);
    // Altered after signing.
    let bad_disk = dir
        .path()
        .join("bad/amd64-usr/4230.2.3/flatcar_production_qemu_image.img");
    std::fs::write(&bad_disk, [&disk[..], b"!"].concat())?;
    let server = Server::start()?;
    serve_tree(&server, &dir.path().join("good"), "/good/stable")?;
    serve_tree(&server, &dir.path().join("bad"), "/bad/stable")?;
    let key_file = dir.path().join("key.asc");
    std::fs::write(&key_file, key.public_armored())?;
    let key_arg = key_file.display().to_string();

    let pod = Pod::new()?;
    let mirror = format!("{}/good/stable", server.base);
    let args = ["--flatcar-version", "4230.2.3", "--flatcar-key", &key_arg];
    let out = pod.run(&[&args[..], &["--flatcar-base-url", &mirror]].concat())?;
    assert!(out.status.success(), "{}", log(&out));
    assert_eq!(
        std::fs::read_link(&pod.link)?,
        pod.cache.join("flatcar-stable-4230.2.3.img")
    );
    assert_eq!(std::fs::read(&pod.link)?, disk);
    assert_eq!(pod.cached(), ["flatcar-stable-4230.2.3.img"]);

    // The shipped Flatcar key does not vouch for the test release; a tampered disk is refused.
    let other = Pod::new()?;
    let out = other.run(&[
        "--flatcar-version",
        "4230.2.3",
        "--flatcar-base-url",
        &mirror,
    ])?;
    assert!(!out.status.success());
    let msg = other.message();
    assert!(msg.starts_with("ImageVerificationFailed: "), "{msg}");
    let tampered = Pod::new()?;
    let bad = format!("{}/bad/stable", server.base);
    let out = tampered.run(&[&args[..], &["--flatcar-base-url", &bad]].concat())?;
    assert!(!out.status.success());
    let msg = tampered.message();
    assert!(
        msg.starts_with("ImageVerificationFailed: ") && msg.contains("SHA-512"),
        "{msg}"
    );
    assert!(
        !tampered.cached().iter().any(|f| f.ends_with(".img")),
        "{:?}",
        tampered.cached()
    );
    // A release that is not there: the status and the URL.
    let missing = Pod::new()?;
    let out = missing.run(&[
        "--flatcar-version",
        "4230.2.4",
        "--flatcar-key",
        &key_arg,
        "--flatcar-base-url",
        &mirror,
    ])?;
    assert!(!out.status.success());
    let msg = missing.message();
    assert!(
        msg.starts_with("ImageDownloadFailed: ")
            && msg.contains("HTTP 404")
            && msg.contains(&format!("{mirror}/amd64-usr/4230.2.4/version.txt")),
        "{msg}"
    );
    Ok(())
}
