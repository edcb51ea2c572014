//! Any bytes as `format: ignition` (spec 2.3 translation and 3.x passthrough).
#![no_main]

use capk_bootstrap::{BootstrapFormat, MachineFacts, MachineOverlay, convert, to_json};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let facts = MachineFacts::new("fuzz-node");
    if let Ok(mut config) = convert(BootstrapFormat::Ignition, data, &facts) {
        let overlay = MachineOverlay {
            hostname: "fuzz-node".into(),
            ..Default::default()
        };
        overlay
            .apply(&mut config)
            .expect("a valid overlay always applies");
        let _ = to_json(&config);
    }
});
