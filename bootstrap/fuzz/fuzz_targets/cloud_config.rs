//! Any bytes as `format: cloud-config`: conversion returns Ok or an error, never panics, and a
//! converted config always serialises (or hits the documented size limit).
#![no_main]

use capk_bootstrap::{BootstrapFormat, MachineFacts, convert, to_json};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let facts = MachineFacts::new("fuzz-node");
    if let Ok(config) = convert(BootstrapFormat::CloudConfig, data, &facts) {
        let _ = to_json(&config);
    }
});
