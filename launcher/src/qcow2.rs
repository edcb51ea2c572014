//! The qcow2 header, read by the launcher itself before QEMU or qemu-img opens an image: its
//! virtual size, and whether it names anything else to open. A node image comes from the tenant,
//! and a qcow2 header can name a backing file (a host path, a device such as `/dev/vda`, or a
//! `json:{...}` / protocol target such as nbd) or an external data file: QEMU would open those
//! with its own rights and serve them to the guest. A node image must be self-contained.
//!
//! The format (QEMU's `docs/interop/qcow2.txt`, all fields big-endian): magic `QFI\xfb`,
//! version (2 or 3), backing file offset (8..16) and size (16..20), cluster bits (20..24),
//! virtual size (24..32); version 3 adds incompatible features (72..80, bit 2: external data
//! file) and the header length (100..104), after which come header extensions (type, length,
//! data padded to 8 bytes; type 0 ends them), all within the first cluster. Extension
//! 0x44415441 names the external data file. No maintained crate reads just this: the crates
//! that read qcow2 are disk readers, unmaintained or forensic tools.

use std::path::{Path, PathBuf};

/// The first bytes of every qcow2 file (version 2 and 3).
pub const MAGIC: [u8; 4] = *b"QFI\xfb";
/// Incompatible feature bit: the guest data lives in an external data file.
const INCOMPAT_EXTERNAL_DATA_FILE: u64 = 1 << 2;
/// Header extension naming the external data file ("DATA").
const EXT_DATA_FILE_NAME: u32 = 0x4441_5441;
/// Largest cluster QEMU supports (cluster bits 21): header extensions end within it.
const MAX_CLUSTER_BYTES: u64 = 2 << 20;
/// Longest name shown in an error (a `json:` backing can be long).
const SHOWN_NAME_BYTES: usize = 200;

/// What a qcow2 header says that the launcher acts on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Header {
    /// Virtual size in bytes.
    pub size: u64,
    /// The backing file name, when the header names one.
    pub backing_file: Option<String>,
    /// The external data file name, or `Some("")` when the feature bit is set without a name.
    pub data_file: Option<String>,
}

/// Why a qcow2 header could not be read. The messages follow "node image <path>: ".
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    /// Opening or reading the file failed.
    #[error("{0}")]
    Read(#[source] std::io::Error),
    /// Not a qcow2 file.
    #[error("not a qcow2 image (no qcow2 magic); is --image-format right?")]
    NotQcow2,
    /// A field is out of range.
    #[error("malformed qcow2 header: {0}")]
    Malformed(&'static str),
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn shown(name: &[u8]) -> String {
    let mut s = String::from_utf8_lossy(name).into_owned();
    if s.len() > SHOWN_NAME_BYTES {
        let mut end = SHOWN_NAME_BYTES;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

/// Parses the first cluster of a qcow2 file (or as much of it as the file has).
pub fn parse(first_cluster: &[u8]) -> Result<Header, HeaderError> {
    let b = first_cluster;
    if b.len() < 4 || b[..4] != MAGIC {
        return Err(HeaderError::NotQcow2);
    }
    if b.len() < 72 {
        return Err(HeaderError::Malformed("shorter than a version 2 header"));
    }
    let version = be32(b, 4);
    if !(2..=3).contains(&version) {
        return Err(HeaderError::Malformed("version is neither 2 nor 3"));
    }
    let backing_offset = be64(b, 8);
    let backing_size = be32(b, 16) as u64;
    let size = be64(b, 24);
    let backing_file = if backing_offset == 0 && backing_size == 0 {
        None
    } else {
        // A name outside what was read is still a backing file; show what can be shown.
        let name = usize::try_from(backing_offset)
            .ok()
            .zip(
                backing_offset
                    .checked_add(backing_size)
                    .and_then(|end| usize::try_from(end).ok()),
            )
            .and_then(|(from, to)| b.get(from..to))
            .unwrap_or_default();
        Some(shown(name))
    };
    let (incompatible, header_len) = if version == 3 {
        if b.len() < 104 {
            return Err(HeaderError::Malformed("shorter than a version 3 header"));
        }
        (be64(b, 72), be32(b, 100) as usize)
    } else {
        (0, 72)
    };
    if header_len < 72 || header_len > b.len() {
        return Err(HeaderError::Malformed("header length out of range"));
    }
    let mut data_file = (incompatible & INCOMPAT_EXTERNAL_DATA_FILE != 0).then(String::new);
    let mut at = header_len;
    while at + 8 <= b.len() {
        let (kind, len) = (be32(b, at), be32(b, at + 4) as usize);
        if kind == 0 {
            break;
        }
        let data = b.get(at + 8..at + 8 + len).ok_or(HeaderError::Malformed(
            "header extension past the first cluster",
        ))?;
        if kind == EXT_DATA_FILE_NAME {
            data_file = Some(shown(data));
        }
        at += 8 + len.div_ceil(8) * 8;
    }
    Ok(Header {
        size,
        backing_file,
        data_file,
    })
}

/// Reads the header of the qcow2 file at `path`: the first cluster at most (QEMU's largest).
pub fn read(path: &Path) -> Result<Header, HeaderError> {
    read_from(&std::fs::File::open(path).map_err(HeaderError::Read)?)
}

/// Reads the header of an open qcow2 file (from its start, whatever its offset).
pub fn read_from(f: &std::fs::File) -> Result<Header, HeaderError> {
    use std::os::unix::fs::FileExt;
    let mut first = vec![0u8; MAX_CLUSTER_BYTES as usize];
    let mut len = 0;
    while len < first.len() {
        match f.read_at(&mut first[len..], len as u64) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(HeaderError::Read(e)),
        }
    }
    parse(&first[..len])
}

/// A node image that names another file to open.
#[derive(Debug, thiserror::Error)]
pub enum NotSelfContained {
    /// The header names a backing file.
    #[error(
        "node image {path}: the qcow2 header names a backing file ({name}); a node image must be \
         self-contained: flatten it with `qemu-img convert -O qcow2 <image> <new image>`"
    )]
    BackingFile {
        /// The image.
        path: PathBuf,
        /// The name in its header.
        name: String,
    },
    /// The header names an external data file.
    #[error(
        "node image {path}: the qcow2 header names an external data file ({name}); a node image \
         must be self-contained: flatten it with `qemu-img convert -O qcow2 <image> <new image>`"
    )]
    DataFile {
        /// The image.
        path: PathBuf,
        /// The name in its header (empty when the feature bit is set without a name).
        name: String,
    },
}

/// Refuses an image whose header names a backing file or an external data file.
pub fn self_contained(
    path: &Path,
    backing_file: Option<&str>,
    data_file: Option<&str>,
) -> Result<(), NotSelfContained> {
    if let Some(name) = backing_file {
        return Err(NotSelfContained::BackingFile {
            path: path.to_path_buf(),
            name: name.into(),
        });
    }
    if let Some(name) = data_file {
        return Err(NotSelfContained::DataFile {
            path: path.to_path_buf(),
            name: name.into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version 3 header of `len` bytes with the given header length and incompatible bits.
    fn v3(len: usize, header_len: u32, incompatible: u64) -> Vec<u8> {
        let mut b = vec![0u8; len];
        b[..4].copy_from_slice(&MAGIC);
        b[4..8].copy_from_slice(&3u32.to_be_bytes());
        b[24..32].copy_from_slice(&(1u64 << 30).to_be_bytes());
        b[72..80].copy_from_slice(&incompatible.to_be_bytes());
        b[100..104].copy_from_slice(&header_len.to_be_bytes());
        b
    }

    /// Hostile headers are refused or read without panicking: the feature bit alone is a data
    /// file, a backing name beyond the file is still a backing file, lengths past the cluster
    /// are malformed.
    #[test]
    fn hostile_headers_are_read_safely() {
        let h = parse(&v3(512, 112, INCOMPAT_EXTERNAL_DATA_FILE)).unwrap();
        assert_eq!(h.data_file.as_deref(), Some(""));
        assert_eq!(h.size, 1 << 30);

        let mut b = v3(512, 112, 0);
        b[8..16].copy_from_slice(&u64::MAX.to_be_bytes());
        b[16..20].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(parse(&b).unwrap().backing_file.as_deref(), Some(""));

        let mut b = v3(512, 112, 0);
        b[112..116].copy_from_slice(&EXT_DATA_FILE_NAME.to_be_bytes());
        b[116..120].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(
            parse(&b).unwrap_err().to_string(),
            "malformed qcow2 header: header extension past the first cluster"
        );
        assert_eq!(
            parse(&v3(512, 4096, 0)).unwrap_err().to_string(),
            "malformed qcow2 header: header length out of range"
        );
        assert_eq!(
            parse(&v3(512, 104, 0)[..90]).unwrap_err().to_string(),
            "malformed qcow2 header: shorter than a version 3 header"
        );
        assert!(matches!(parse(b"raw bytes"), Err(HeaderError::NotQcow2)));
    }
}
