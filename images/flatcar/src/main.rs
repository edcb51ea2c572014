//! `capk-flatcar-image`: fetch, verify and package a Flatcar QEMU image as a container image.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use capk_flatcar_image::digests::Digests;
use capk_flatcar_image::fetch::{Curl, FetchRequest, fetch};
use capk_flatcar_image::release::{Arch, Channel, ReleaseServer, VersionSpec};
use capk_flatcar_image::signature::{FLATCAR_SIGNING_KEY_FINGERPRINT, SignatureVerifier};
use clap::{Args, Parser, Subcommand};

/// Fetch a Flatcar Container Linux QEMU image, verify it, and package it as a container image
/// holding the disk at /disk/image.qcow2 (for KVMMachineTemplate spec.image.containerImage).
///
/// Needs network access to the Flatcar release server (or a mirror), curl and gpgv.
#[derive(Parser, Debug)]
#[command(name = "capk-flatcar-image", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Download a release's QEMU image, verify its signature and SHA-512, write a Containerfile.
    ///
    /// The output directory is the container build context: the verified disk, its .sig and
    /// .DIGESTS, version.txt and its .sig, and the Containerfile (written last, only when every
    /// check passed). Run again to refresh: a disk already there is verified and reused.
    Fetch {
        /// Release channel: stable, beta, alpha or lts.
        #[arg(long, default_value = "stable", value_parser = clap::value_parser!(Channel))]
        channel: Channel,
        /// Release version such as 4230.2.3, or `current` (the channel's newest, resolved
        /// through its signed version.txt).
        #[arg(long, default_value = "current", value_parser = clap::value_parser!(VersionSpec))]
        version: VersionSpec,
        /// Board: amd64-usr or arm64-usr.
        #[arg(long, default_value = "amd64-usr", value_parser = clap::value_parser!(Arch))]
        arch: Arch,
        /// Output directory (created if missing).
        #[arg(long)]
        out: PathBuf,
        /// A mirror holding the channel's `<arch>/<version>/<file>` tree, instead of Flatcar's
        /// release server (https only).
        #[arg(long)]
        base_url: Option<String>,
        #[command(flatten)]
        key: KeyArgs,
        /// The curl program.
        #[arg(long, default_value = "curl")]
        curl: PathBuf,
    },
    /// Verify a downloaded file against its DIGESTS and, with --sig, its detached signature.
    Verify {
        /// The `<file>.DIGESTS` file.
        #[arg(long)]
        digests: PathBuf,
        /// The file to check.
        #[arg(long)]
        file: PathBuf,
        /// The file's name in DIGESTS. Default: the file's own name.
        #[arg(long)]
        name: Option<String>,
        /// The file's detached OpenPGP signature (`<file>.sig`).
        #[arg(long)]
        sig: Option<PathBuf>,
        #[command(flatten)]
        key: KeyArgs,
    },
}

#[derive(Args, Debug)]
struct KeyArgs {
    /// Trusted OpenPGP public key file (armored or binary). Default: the Flatcar image signing
    /// key shipped in this program (images/flatcar/Flatcar_Image_Signing_Key.asc).
    #[arg(long)]
    key: Option<PathBuf>,
    /// Primary key fingerprint signatures must come from. Default with the shipped key:
    /// F88CFEDEFF29A5B4D9523864E25D9AED0593B34A; with --key: any key in the file.
    #[arg(long)]
    fingerprint: Option<String>,
    /// The gpgv program.
    #[arg(long, default_value = "gpgv")]
    gpgv: PathBuf,
}

impl KeyArgs {
    fn verifier(&self) -> Result<SignatureVerifier> {
        let verifier = match &self.key {
            None => {
                if let Some(f) = &self.fingerprint {
                    let f: String = f.chars().filter(|c| !c.is_whitespace()).collect();
                    anyhow::ensure!(
                        f.eq_ignore_ascii_case(FLATCAR_SIGNING_KEY_FINGERPRINT),
                        "--fingerprint {f} is not the shipped Flatcar key's \
                         ({FLATCAR_SIGNING_KEY_FINGERPRINT}); pass --key with that key's file"
                    );
                }
                SignatureVerifier::flatcar()
            }
            Some(path) => {
                let key = std::fs::read(path)
                    .with_context(|| format!("read the key file {}", path.display()))?;
                SignatureVerifier::from_key(&key, self.fingerprint.as_deref())
                    .with_context(|| format!("load the key file {}", path.display()))?
            }
        };
        Ok(verifier.with_gpgv(&self.gpgv))
    }
}

fn main() {
    if let Err(err) = run(Cli::parse()) {
        eprintln!("capk-flatcar-image: {err:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Fetch {
            channel,
            version,
            arch,
            out,
            base_url,
            key,
            curl,
        } => {
            let server = match base_url {
                Some(url) => ReleaseServer::mirror(&url)?,
                None => ReleaseServer::upstream(channel),
            };
            let request = FetchRequest {
                channel,
                version,
                arch,
                server,
                out,
            };
            let fetched = fetch(&request, &Curl::new(curl), &key.verifier()?)
                .with_context(|| format!("fetch Flatcar {channel} {version} ({arch})"))?;
            println!(
                "Flatcar {channel} {} ({arch}): {} {}",
                fetched.version,
                fetched.image.display(),
                if fetched.reused {
                    "(already present, verified again)"
                } else {
                    "(downloaded)"
                }
            );
            print_signature(&fetched.signature);
            println!("sha512: {}", fetched.sha512);
            println!(
                "sha256: {} (for spec.image.url, if you serve the disk over http)",
                fetched.sha256
            );
            println!("Containerfile: {}", fetched.containerfile.display());
            println!(
                "next: buildah build -t <registry>/flatcar:{v} {dir} && buildah push <registry>/flatcar:{v}",
                v = fetched.version,
                dir = request.out.display()
            );
            println!(
                "(spec.image.flatcar needs no container image: machine Pods fetch the release into /var/lib/capk/images/{} themselves)",
                fetched.host_cache_name(channel)
            );
        }
        Command::Verify {
            digests,
            file,
            name,
            sig,
            key,
        } => {
            let name = match name {
                Some(n) => n,
                None => file
                    .file_name()
                    .and_then(|n| n.to_str())
                    .context("--file has no file name; pass --name")?
                    .to_owned(),
            };
            let text = std::fs::read_to_string(&digests)
                .with_context(|| format!("read {}", digests.display()))?;
            let sha512 = Digests::parse(&text)
                .and_then(|d| d.verify_sha512(&file, &name))
                .with_context(|| {
                    format!("check {} against {}", file.display(), digests.display())
                })?;
            println!("sha512 OK: {} ({sha512})", file.display());
            match sig {
                Some(sig) => {
                    let good = key.verifier()?.verify(&sig, &file)?;
                    print_signature(&good);
                }
                None => println!("signature: not checked (no --sig)"),
            }
        }
    }
    Ok(())
}

fn print_signature(good: &capk_flatcar_image::signature::GoodSignature) {
    println!(
        "signature OK: signing key {} of primary key {}{}",
        good.signing_key,
        good.primary_key,
        if good.key_expired {
            " (the signing subkey has expired since; the signature was made while it was valid)"
        } else {
            ""
        }
    );
}
