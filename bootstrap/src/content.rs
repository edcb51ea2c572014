//! File contents: cloud-init `write_files` encodings in, Ignition `data:` URLs out.

use std::io::Read;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use ignition_config::v3_4::Resource;
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};

/// How big a gzip member may grow when it is checked. Bounded so that a small compressed bomb
/// in bootstrap data cannot exhaust the controller's memory.
pub const MAX_DECOMPRESSED_BYTES: u64 = 64 * 1024 * 1024;

/// The `encoding` values cloud-init accepts for `write_files`, as (name, base64?, gzip?).
const ENCODINGS: &[(&str, bool, bool)] = &[
    ("text/plain", false, false),
    ("b64", true, false),
    ("base64", true, false),
    ("gz", false, true),
    ("gzip", false, true),
    ("gz+b64", true, true),
    ("gz+base64", true, true),
    ("gzip+b64", true, true),
    ("gzip+base64", true, true),
];

/// Names of the supported encodings, for messages.
pub fn supported_encodings() -> String {
    ENCODINGS
        .iter()
        .map(|(n, _, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Decoded `write_files` content: the bytes Ignition should carry and whether they are gzip.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileContent {
    /// The bytes after base64 decoding (still gzip-compressed when `gzip` is set).
    pub bytes: Vec<u8>,
    /// The bytes are one gzip stream; Ignition decompresses it (`compression: gzip`).
    pub gzip: bool,
}

/// Why `write_files` content could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The `encoding` is not one cloud-init knows.
    #[error("unknown encoding `{0}`; supported: {list}", list = supported_encodings())]
    UnknownEncoding(String),
    /// The content does not decode with its encoding.
    #[error("{0}")]
    BadContent(String),
}

/// Decodes `write_files[].content` given its `encoding`. Gzip content stays compressed (Ignition
/// decompresses it in the guest, which keeps the config small) but is checked to decompress.
pub fn decode_write_file(
    encoding: Option<&str>,
    content: &[u8],
) -> Result<FileContent, DecodeError> {
    let name = encoding.unwrap_or("text/plain").trim().to_ascii_lowercase();
    let Some(&(_, b64, gzip)) = ENCODINGS.iter().find(|(n, _, _)| *n == name) else {
        return Err(DecodeError::UnknownEncoding(name));
    };
    let bytes = if b64 {
        decode_base64(content).map_err(DecodeError::BadContent)?
    } else {
        content.to_vec()
    };
    if gzip {
        gunzip(&bytes).map_err(DecodeError::BadContent)?;
    }
    Ok(FileContent { bytes, gzip })
}

/// Base64 as cloud-init (Python's `b64decode`) reads it: whitespace and line breaks are ignored.
pub fn decode_base64(content: &[u8]) -> Result<Vec<u8>, String> {
    let compact: Vec<u8> = content
        .iter()
        .copied()
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    STANDARD
        .decode(&compact)
        .map_err(|e| format!("content is not valid base64: {e}"))
}

/// Decompresses a gzip stream of at most [`MAX_DECOMPRESSED_BYTES`].
pub fn gunzip(bytes: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .take(MAX_DECOMPRESSED_BYTES + 1)
        .read_to_end(&mut out)
        .map_err(|e| format!("content is not a valid gzip stream: {e}"))?;
    if out.len() as u64 > MAX_DECOMPRESSED_BYTES {
        return Err(format!(
            "content decompresses to more than {MAX_DECOMPRESSED_BYTES} bytes"
        ));
    }
    Ok(out)
}

/// Characters escaped in a percent-encoded `data:` URL: controls, non-ASCII (always), and the
/// characters that are not allowed or have a meaning in a URL.
const DATA_URL_ESCAPE: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'#')
    .add(b'%')
    .add(b'<')
    .add(b'>')
    .add(b'?')
    .add(b'[')
    .add(b'\\')
    .add(b']')
    .add(b'^')
    .add(b'`')
    .add(b'{')
    .add(b'|')
    .add(b'}');

/// A `data:` URL for `bytes`: percent-encoded text when the bytes are mostly printable UTF-8 (so
/// `render-ignition` output stays readable), base64 otherwise (smaller for binary data).
pub fn data_url(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) if is_mostly_printable(text) => {
            format!("data:,{}", utf8_percent_encode(text, DATA_URL_ESCAPE))
        }
        _ => format!("data:;base64,{}", STANDARD.encode(bytes)),
    }
}

fn is_mostly_printable(text: &str) -> bool {
    let escaped = text
        .chars()
        .filter(|c| !(c.is_ascii_graphic() || *c == ' ' || *c == '\n'))
        .count();
    // Each escaped byte costs three characters; base64 costs 4/3 per byte overall.
    escaped * 8 <= text.len()
}

/// An Ignition resource holding `content` inline.
pub fn inline_resource(content: &FileContent) -> Resource {
    Resource {
        compression: content.gzip.then(|| "gzip".to_owned()),
        http_headers: None,
        source: Some(data_url(&content.bytes)),
        verification: None,
    }
}

/// An Ignition resource holding plain text inline.
pub fn text_resource(text: &str) -> Resource {
    inline_resource(&FileContent {
        bytes: text.as_bytes().to_vec(),
        gzip: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_encoding_names_the_supported_ones() {
        let err = decode_write_file(Some("zstd"), b"x")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "unknown encoding `zstd`; supported: text/plain, b64, base64, gz, gzip, gz+b64, \
             gz+base64, gzip+b64, gzip+base64"
        );
    }

    #[test]
    fn bad_base64_is_reported() {
        let err = decode_write_file(Some("b64"), b"!!!")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("content is not valid base64: "), "{err}");
    }

    #[test]
    fn bad_gzip_is_reported() {
        let err = decode_write_file(Some("gzip+base64"), b"aGVsbG8=")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("content is not a valid gzip stream: "),
            "{err}"
        );
    }

    #[test]
    fn gzip_bomb_is_refused() {
        use flate2::{Compression, write::GzEncoder};
        use std::io::Write;
        let mut enc = GzEncoder::new(Vec::new(), Compression::best());
        let zeros = vec![0u8; 1024 * 1024];
        for _ in 0..=MAX_DECOMPRESSED_BYTES / zeros.len() as u64 {
            enc.write_all(&zeros).unwrap();
        }
        let gz = enc.finish().unwrap();
        let err = decode_write_file(Some("gzip"), &gz)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!("content decompresses to more than {MAX_DECOMPRESSED_BYTES} bytes")
        );
    }

    #[test]
    fn text_is_percent_encoded_and_binary_is_base64() {
        assert_eq!(data_url(b"a b\n"), "data:,a%20b%0A");
        assert_eq!(data_url(&[0, 1, 2, 255]), "data:;base64,AAEC/w==");
    }
}
