//! The heartbeat line the guest writes to the launcher (see [`crate::overlay::Heartbeat`]):
//!
//! ```text
//! capk-heartbeat/1 bootstrap=done uptime=123.45
//! ```
//!
//! Defined here, next to the script that writes it, so the launcher parses exactly what the
//! guest sends.

use std::fmt;
use std::str::FromStr;

/// The first word of every heartbeat line (name and protocol version).
pub const HEARTBEAT_PREFIX: &str = "capk-heartbeat/1";

/// Whether the Cluster API bootstrap commands have succeeded in the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootstrapState {
    /// The success file exists.
    Done,
    /// Not (yet) succeeded.
    Pending,
}

/// One heartbeat from the guest.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeartbeatLine {
    pub bootstrap: BootstrapState,
    /// The guest's `/proc/uptime` first field, in seconds.
    pub uptime_seconds: f64,
}

/// Why a line is not a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a {HEARTBEAT_PREFIX} line ({reason}): {line:?}")]
pub struct ParseHeartbeatError {
    pub line: String,
    pub reason: &'static str,
}

impl FromStr for HeartbeatLine {
    type Err = ParseHeartbeatError;

    fn from_str(line: &str) -> Result<Self, Self::Err> {
        let err = |reason| ParseHeartbeatError {
            line: line.chars().take(200).collect(),
            reason,
        };
        let mut words = line.trim_end_matches(['\r', '\n']).split(' ');
        if words.next() != Some(HEARTBEAT_PREFIX) {
            return Err(err("wrong prefix"));
        }
        let (mut bootstrap, mut uptime) = (None, None);
        for w in words {
            match w.split_once('=') {
                Some(("bootstrap", "done")) => bootstrap = Some(BootstrapState::Done),
                Some(("bootstrap", "pending")) => bootstrap = Some(BootstrapState::Pending),
                Some(("bootstrap", _)) => return Err(err("bad bootstrap state")),
                Some(("uptime", v)) => {
                    let secs: f64 = v.parse().map_err(|_| err("bad uptime"))?;
                    if !secs.is_finite() || secs < 0.0 {
                        return Err(err("bad uptime"));
                    }
                    uptime = Some(secs);
                }
                // Later versions may add fields; they are ignored.
                Some(_) => {}
                None => return Err(err("a field is not key=value")),
            }
        }
        Ok(HeartbeatLine {
            bootstrap: bootstrap.ok_or_else(|| err("no bootstrap field"))?,
            uptime_seconds: uptime.ok_or_else(|| err("no uptime field"))?,
        })
    }
}

impl fmt::Display for HeartbeatLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.bootstrap {
            BootstrapState::Done => "done",
            BootstrapState::Pending => "pending",
        };
        write!(
            f,
            "{HEARTBEAT_PREFIX} bootstrap={state} uptime={}",
            self.uptime_seconds
        )
    }
}
