//! Any request line on the control socket: parsing never panics, and a request it accepts
//! serialises back to one it accepts again as the same request.
#![no_main]

use capk_launcher::control::{Request, parse_request};
use capk_launcher::line::Frame;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = parse_request(&Frame::Line(data.to_vec())) {
        let again = serde_json::to_vec(&req).expect("a request serialises");
        let back: Request = serde_json::from_slice(&again).expect("printed request parses");
        assert_eq!(back, req);
    }
});
