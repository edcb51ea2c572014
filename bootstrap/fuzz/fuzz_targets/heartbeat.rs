//! Any line from the virtio-serial port: the launcher's heartbeat parser never panics, and what
//! it accepts prints back to a line it accepts again.
#![no_main]

use capk_bootstrap::heartbeat::HeartbeatLine;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(line) = text.parse::<HeartbeatLine>()
    {
        let again: HeartbeatLine = line.to_string().parse().expect("printed line parses");
        assert_eq!(again.bootstrap, line.bootstrap);
    }
});
