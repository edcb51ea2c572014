//! Any byte stream on the guest's heartbeat port, cut into arbitrary reads: the line framer never
//! holds more than its cap, never panics, and yields exactly the stream's lines (over-long ones
//! as their length); every frame goes through the launcher's heartbeat bookkeeping.
//!
//! Input: byte 0 = the cap (1..=256, small so that over-long lines are common), byte 1 = the
//! read size (1..=256); the rest is the stream.
#![no_main]

use std::time::{Duration, Instant};

use capk_launcher::health::{LauncherState, record_frame};
use capk_launcher::line::{Frame, LineFramer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [cap, read, stream @ ..] = data else {
        return;
    };
    let cap = usize::from(*cap) + 1;
    let read = usize::from(*read) + 1;
    let mut framer = LineFramer::new(cap);
    let mut frames = Vec::new();
    for chunk in stream.chunks(read) {
        let mut rest = chunk;
        while !rest.is_empty() {
            let (taken, frame) = framer.feed(rest);
            assert!(taken > 0 && taken <= rest.len());
            assert!(
                framer.buffered() <= cap,
                "holds {} > {cap}",
                framer.buffered()
            );
            rest = &rest[taken..];
            frames.extend(frame);
        }
    }
    frames.extend(framer.finish());

    // The same stream split at its newlines, by the book.
    let mut want: Vec<&[u8]> = stream.split(|b| *b == b'\n').collect();
    if want.last().is_some_and(|l| l.is_empty()) {
        want.pop();
    }
    assert_eq!(frames.len(), want.len());
    let mut state = LauncherState::new("worker", Duration::from_secs(90));
    for (got, want) in frames.iter().zip(want) {
        match got {
            Frame::Line(l) => assert_eq!(l.as_slice(), want),
            Frame::TooLong(n) => {
                assert!(want.len() > cap);
                assert_eq!(*n, want.len() as u64);
            }
        }
        record_frame(&mut state, got, Instant::now());
    }
});
