//! cloud-config `write_files` content decoding on its own: the first byte picks an encoding (or an unknown one), the rest is the content. Never panics;
//! accepted gzip content always decompresses; base64 of anything decodes back to it.
#![no_main]

use base64::Engine as _;
use capk_bootstrap::content::{decode_base64, decode_write_file, gunzip};
use libfuzzer_sys::fuzz_target;

const ENCODINGS: [Option<&str>; 9] = [
    None,
    Some("b64"),
    Some("base64"),
    Some("gz+b64"),
    Some("gzip+base64"),
    Some("gz+base64"),
    Some("gzip"),
    Some("gz"),
    Some("rot13"),
];

fuzz_target!(|data: &[u8]| {
    let Some((&pick, content)) = data.split_first() else {
        return;
    };
    let encoding = ENCODINGS[usize::from(pick) % ENCODINGS.len()];
    if let Ok(decoded) = decode_write_file(encoding, content)
        && decoded.gzip
    {
        gunzip(&decoded.bytes).expect("accepted gzip content decompresses");
    }
    let encoded = base64::engine::general_purpose::STANDARD.encode(content);
    assert_eq!(decode_base64(encoded.as_bytes()).as_deref(), Ok(content));
});
