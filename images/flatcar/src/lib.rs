//! The Flatcar node image recipe of cluster-api-provider-kvm: fetch a Flatcar QEMU image by
//! channel and version, verify its OpenPGP signature and SHA-512, and write the Containerfile
//! that packages it as a container image holding `/disk/image.qcow2`.
//!
//! Pure parts ([`release`], [`version_txt`], [`digests`], [`containerfile`]) are plain functions
//! over text; the side effects are two subprocesses: `curl` downloads ([`fetch::Curl`]) and
//! `gpgv` checks signatures ([`signature::SignatureVerifier`]).
#![forbid(unsafe_code)]

pub mod containerfile;
pub mod digests;
pub mod fetch;
pub mod release;
pub mod signature;
pub mod version_txt;

#[cfg(any(test, feature = "testkey"))]
pub mod testkey;
