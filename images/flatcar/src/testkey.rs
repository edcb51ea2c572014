//! Throwaway OpenPGP keys for the tests, made by `gpg --batch` in scratch home directories, and
//! release trees signed with them (feature `testkey`: other crates' tests serve such a tree).
//!
//! Shaped like Flatcar's key: a certification-only primary key with an Ed25519 signing subkey,
//! so the tests see signatures by a subkey that must be traced back to a primary key.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use tempfile::TempDir;

/// The gpg program (package `gpg`; secret-key operations also need `gpg-agent`).
pub struct Gpg;

impl Gpg {
    fn run<I, S>(&self, home: &Path, args: I) -> Vec<u8>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let out = Command::new("gpg")
            .arg("--homedir")
            .arg(home)
            .args(["--batch", "--quiet", "--pinentry-mode", "loopback"])
            .args(["--passphrase", ""])
            .args(args)
            .env("LC_ALL", "C")
            .output()
            .expect("run gpg");
        assert!(
            out.status.success(),
            "gpg failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }

    /// Fingerprints of a key file, primary first (`gpg --show-keys`, which imports nothing).
    pub fn show_key_fingerprints(&self, key: &[u8]) -> Vec<String> {
        let home = scratch_home();
        let file = home.path().join("key.gpg");
        std::fs::write(&file, key).unwrap();
        let listing = self.run(
            home.path(),
            [
                OsStr::new("--with-colons"),
                OsStr::new("--show-keys"),
                file.as_os_str(),
            ],
        );
        fingerprints(&String::from_utf8(listing).unwrap())
    }
}

fn fingerprints(colons: &str) -> Vec<String> {
    colons
        .lines()
        .filter(|l| l.starts_with("fpr:"))
        .filter_map(|l| l.split(':').nth(9).map(str::to_owned))
        .collect()
}

fn scratch_home() -> TempDir {
    // Short paths: gpg-agent's socket lives in the home directory.
    let home = tempfile::Builder::new()
        .prefix("capk-gpg")
        .tempdir_in("/tmp")
        .unwrap();
    let mut perms = std::fs::metadata(home.path()).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o700);
    std::fs::set_permissions(home.path(), perms).unwrap();
    home
}

/// A key pair in its own gpg home; the agent it started is stopped on drop.
pub struct TestKey {
    home: TempDir,
    /// Primary key fingerprint.
    pub fpr: String,
}

impl TestKey {
    /// gpg and gpgv, or `None` with a printed reason outside CI; under `CI` a missing tool fails.
    pub fn gpg_or_skip() -> Option<Gpg> {
        let works = |program: &str| {
            Command::new(program)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        };
        if works("gpg") && works("gpgv") && works("gpg-agent") {
            return Some(Gpg);
        }
        let reason = "gpg, gpg-agent and gpgv are needed to make and check test signatures: \
                      apt-get install gpg gpg-agent gpgv (listed in hack/debian-packages.txt)";
        if std::env::var_os("CI").is_some() {
            panic!("{reason}");
        }
        eprintln!("skipped: {reason}");
        None
    }

    /// A new key pair: certification-only primary key, Ed25519 signing subkey.
    pub fn generate(gpg: &Gpg, name: &str) -> TestKey {
        Self::generate_at(gpg, name, None, "never")
    }

    /// A key pair made at `faked_time` (gpg's `--faked-system-time`, e.g. `20260101T000000`)
    /// whose signing subkey expires after `expire` (e.g. `2d`), as Flatcar's yearly subkeys do.
    pub fn generate_at(gpg: &Gpg, name: &str, faked_time: Option<&str>, expire: &str) -> TestKey {
        let home = scratch_home();
        let uid = format!("{name} <capk-test@example.invalid>");
        let time: Vec<String> = faked_time
            .map(|t| vec!["--faked-system-time".into(), format!("{t}!")])
            .unwrap_or_default();
        gpg.run(
            home.path(),
            time.iter().map(String::as_str).chain([
                "--quick-gen-key",
                &uid,
                "ed25519",
                "cert",
                "never",
            ]),
        );
        let listing = gpg.run(home.path(), ["--with-colons", "--list-keys"]);
        let fpr = fingerprints(&String::from_utf8(listing).unwrap())
            .into_iter()
            .next()
            .expect("a fingerprint");
        gpg.run(
            home.path(),
            time.iter().map(String::as_str).chain([
                "--quick-add-key",
                &fpr,
                "ed25519",
                "sign",
                expire,
            ]),
        );
        TestKey { home, fpr }
    }

    /// Signs `path` (detached, binary, as Flatcar's `.sig` files); returns `<path>.sig`.
    pub fn sign(&self, path: &Path) -> PathBuf {
        self.sign_at(path, None)
    }

    /// Signs `path` as if at `faked_time`.
    pub fn sign_at(&self, path: &Path, faked_time: Option<&str>) -> PathBuf {
        let sig = PathBuf::from(format!("{}.sig", path.display()));
        let time: Vec<String> = faked_time
            .map(|t| vec!["--faked-system-time".into(), format!("{t}!")])
            .unwrap_or_default();
        Gpg.run(
            self.home.path(),
            time.iter().map(OsStr::new).chain([
                OsStr::new("--yes"),
                OsStr::new("--output"),
                sig.as_os_str(),
                OsStr::new("--detach-sign"),
                path.as_os_str(),
            ]),
        );
        sig
    }

    /// The public key, armored.
    pub fn public_armored(&self) -> String {
        String::from_utf8(Gpg.run(self.home.path(), ["--armor", "--export", &self.fpr])).unwrap()
    }

    /// A release tree like Flatcar's under `root`: `amd64-usr/{current,<version>}/` with
    /// `version.txt`, the QEMU image holding `disk`, their signatures by this key and the
    /// image's DIGESTS.
    pub fn release_tree(&self, root: &Path, version: &str, disk: &[u8]) {
        let image_name = crate::release::Arch::Amd64.qemu_image_file();
        let (build, rest) = version.split_once('.').expect("a N.N.N version");
        let (branch, patch) = rest.split_once('.').expect("a N.N.N version");
        let version_txt = format!(
            "FLATCAR_BUILD={build}\nFLATCAR_BRANCH={branch}\nFLATCAR_PATCH={patch}\n\
             FLATCAR_VERSION={version}\nFLATCAR_VERSION_ID={version}\nFLATCAR_BUILD_ID=\"\"\n\
             FLATCAR_SDK_VERSION={build}.0.0\n"
        );
        for dir in ["current", version] {
            let d = root.join("amd64-usr").join(dir);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("version.txt"), &version_txt).unwrap();
            self.sign(&d.join("version.txt"));
            let image = d.join(image_name);
            std::fs::write(&image, disk).unwrap();
            self.sign(&image);
            let sha = crate::digests::sha512_file(&image).unwrap();
            std::fs::write(
                d.join(format!("{image_name}.DIGESTS")),
                format!(
                    "# MD5 HASH\n{}  {image_name}\n# SHA1 HASH\n{}  {image_name}\n\
                     # SHA512 HASH\n{sha}  {image_name}\n",
                    "0".repeat(32),
                    "0".repeat(40)
                ),
            )
            .unwrap();
        }
    }

    /// The public key, binary.
    pub fn public_binary(&self) -> Vec<u8> {
        Gpg.run(self.home.path(), ["--export", &self.fpr])
    }
}

impl Drop for TestKey {
    fn drop(&mut self) {
        let _ = Command::new("gpgconf")
            .arg("--homedir")
            .arg(self.home.path())
            .args(["--kill", "all"])
            .output();
    }
}
