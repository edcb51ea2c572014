//! What the guest and local clients send the launcher is untrusted: a 64 MiB line on the
//! heartbeat port or the control socket must not grow the launcher's heap by more than its line
//! cap, and the next line is still read. The heap is measured with a counting allocator (this
//! test binary's global allocator), so the numbers are the launcher code's own allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex, MutexGuard};
use std::time::{Duration, Instant};

use capk_launcher::control::{self, Request, SharedQmp};
use capk_launcher::health::{self, LauncherState, SharedState};
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the counters are atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
            PEAK.fetch_max(now, Ordering::SeqCst);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
            let now = LIVE.fetch_add(new_size, Ordering::SeqCst) + new_size;
            PEAK.fetch_max(now, Ordering::SeqCst);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// One measurement at a time: the counters are process-wide.
static MEASURE: StdMutex<()> = StdMutex::new(());

/// Heap growth allowed while 64 MiB are pushed through: the line cap, the socket buffers and
/// tokio's own bookkeeping fit many times over; the old unbounded read needed 64 MiB or more.
const ALLOWED_GROWTH: usize = 2 << 20;
const FLOOD: usize = 64 << 20;

struct Measure {
    _serial: MutexGuard<'static, ()>,
    base: usize,
}

impl Measure {
    fn start() -> Self {
        let serial = MEASURE.lock().unwrap_or_else(|e| e.into_inner());
        let base = LIVE.load(Ordering::SeqCst);
        PEAK.store(base, Ordering::SeqCst);
        Measure {
            _serial: serial,
            base,
        }
    }

    fn growth(&self) -> usize {
        PEAK.load(Ordering::SeqCst).saturating_sub(self.base)
    }
}

fn state() -> SharedState {
    Arc::new(Mutex::new(LauncherState::new(
        "worker",
        Duration::from_secs(90),
    )))
}

/// Writes `FLOOD` bytes of `fill` without a newline, 64 KiB at a time; stops early when the
/// reader hangs up. Returns how much was written.
async fn flood(w: &mut (impl AsyncWriteExt + Unpin), fill: u8) -> usize {
    let chunk = vec![fill; 64 * 1024];
    let mut sent = 0;
    while sent < FLOOD && w.write_all(&chunk).await.is_ok() {
        sent += chunk.len();
    }
    sent
}

#[tokio::test]
async fn a_guest_flooding_the_heartbeat_port_costs_at_most_the_line_cap() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("heartbeat.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let state = state();
    let m = Measure::start();
    let follower = tokio::spawn(health::follow_heartbeat(path, state.clone()));
    let (mut guest, _) = listener.accept().await.unwrap();
    assert_eq!(flood(&mut guest, b'#').await, FLOOD);
    guest
        .write_all(b"\ncapk-heartbeat/1 bootstrap=done uptime=3.0\n")
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !state.lock().await.bootstrap_succeeded {
        assert!(
            Instant::now() < deadline,
            "the heartbeat after the flood was lost"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let growth = m.growth();
    follower.abort();
    eprintln!("heartbeat port: {FLOOD} bytes in one line, heap grew by at most {growth} bytes");
    assert!(
        growth < ALLOWED_GROWTH,
        "a {FLOOD}-byte line grew the heap by {growth} bytes"
    );
    assert_eq!(state.lock().await.heartbeat_lines_too_long, 1);
}

#[tokio::test]
async fn a_client_that_never_ends_its_request_costs_at_most_the_line_cap() {
    let dir = tempfile::tempdir().unwrap();
    let qmp: SharedQmp = Arc::new(Mutex::new(None));
    let server = tokio::spawn(control::serve(
        control::bind(dir.path()).unwrap(),
        state(),
        qmp,
    ));
    let m = Measure::start();
    let mut client = tokio::net::UnixStream::connect(dir.path().join(control::CONTROL_SOCKET))
        .await
        .unwrap();
    let sent = flood(&mut client, b'{').await;
    let growth = m.growth();
    drop(client);
    eprintln!(
        "control socket: the server hung up after {sent} of {FLOOD} bytes, heap grew by at most {growth} bytes"
    );
    assert!(
        growth < ALLOWED_GROWTH,
        "an endless request grew the heap by {growth} bytes"
    );
    assert!(
        sent < FLOOD,
        "the server read all {FLOOD} bytes of one request"
    );
    // The launcher still answers.
    let s = control::call(dir.path(), &Request::Status).await.unwrap();
    assert_eq!(s["role"], "worker");
    server.abort();
}
