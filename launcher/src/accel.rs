//! Accelerator choice. `/dev/kvm` can exist and still hang guests, so KVM counts as usable only
//! when a probe vCPU really executes a guest instruction (a HLT) within a timeout.
#![allow(unsafe_code)]

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::{Kvm, VcpuExit};
use nix::sys::mman::{MapFlags, ProtFlags, mmap_anonymous, munmap};

use capk_api::launch::Accel as AccelChoice;

use crate::qemu::argv::Accel;

/// Why KVM cannot be used.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum KvmUnusable {
    /// `/dev/kvm` missing or not openable.
    #[error("open /dev/kvm: {0} (mount /dev/kvm into the Pod, or use --accel tcg)")]
    Open(String),
    /// VM/vCPU setup failed.
    #[error("set up a probe VM: {0}")]
    Setup(String),
    /// The vCPU ran but did not halt.
    #[error("probe vCPU exited with {0} instead of HLT")]
    UnexpectedExit(String),
    /// The vCPU did not come back.
    #[error(
        "probe vCPU did not execute a HLT within {0:?}: KVM is present but guests hang here (use --accel tcg)"
    )]
    Timeout(Duration),
}

/// Result of choosing the accelerator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccelDecision {
    /// What QEMU will use.
    pub accel: Accel,
    /// Why KVM was not used, when `auto` fell back.
    pub fallback_reason: Option<KvmUnusable>,
}

/// Picks the accelerator. `probe` is the KVM check (injected for tests).
pub fn decide(
    choice: AccelChoice,
    probe: impl FnOnce() -> Result<(), KvmUnusable>,
) -> Result<AccelDecision, KvmUnusable> {
    match choice {
        AccelChoice::Tcg => Ok(AccelDecision {
            accel: Accel::Tcg,
            fallback_reason: None,
        }),
        AccelChoice::Kvm => probe().map(|()| AccelDecision {
            accel: Accel::Kvm,
            fallback_reason: None,
        }),
        AccelChoice::Auto => Ok(match probe() {
            Ok(()) => AccelDecision {
                accel: Accel::Kvm,
                fallback_reason: None,
            },
            Err(e) => AccelDecision {
                accel: Accel::Tcg,
                fallback_reason: Some(e),
            },
        }),
    }
}

/// Default time the probe vCPU gets: real KVM runs the probe loop in about a millisecond; a KVM
/// that needs more than a second for a million iterations is slower than TCG and hangs guests.
pub const DEFAULT_PROBE_TIMEOUT: Duration = Duration::from_millis(1000);

thread_local! {
    /// The `immediate_exit` byte of the probe vCPU's `kvm_run`, while the vCPU exists on this
    /// thread; null otherwise. Const-initialised without a destructor, so the signal handler can
    /// read it (no lazy initialisation, no allocation).
    static IMMEDIATE_EXIT: AtomicPtr<u8> = const { AtomicPtr::new(std::ptr::null_mut()) };
}

/// SIGUSR1 on the probe thread: makes a running `KVM_RUN` return (any signal does), and one the
/// thread is about to enter return at once (`immediate_exit`), so no stop request is lost.
extern "C" fn interrupt_kvm_run(_: nix::libc::c_int) {
    let flag = IMMEDIATE_EXIT.with(|f| f.load(Ordering::SeqCst));
    if !flag.is_null() {
        // SAFETY: a non-null pointer is the `immediate_exit` byte of the kvm_run mapping of the
        // vCPU on this very thread, published after the vCPU was created and withdrawn before it
        // is dropped (`ImmediateExitSlot`); the handler runs on this thread, so the mapping is
        // alive. A single byte write is async-signal-safe, and KVM reads the byte on entry to
        // KVM_RUN, as the KVM API documents for exactly this use.
        unsafe { flag.write_volatile(1) };
    }
}

/// Publishes a vCPU's `immediate_exit` byte to this thread's signal handler until dropped.
struct ImmediateExitSlot;

impl ImmediateExitSlot {
    fn publish(flag: *mut u8) -> Self {
        IMMEDIATE_EXIT.with(|f| f.store(flag, Ordering::SeqCst));
        ImmediateExitSlot
    }
}

impl Drop for ImmediateExitSlot {
    fn drop(&mut self) {
        IMMEDIATE_EXIT.with(|f| f.store(std::ptr::null_mut(), Ordering::SeqCst));
    }
}

/// How the probe thread ended.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// The vCPU ran (or setup failed): the probe's verdict.
    Ran(Result<(), KvmUnusable>),
    /// Stopped by the caller's timeout before or while in `KVM_RUN`.
    Cancelled,
}

/// Points on the probe thread where tests hold it to open a race window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// The thread started; nothing is set up.
    Started,
    /// The vCPU is set up, the stop flag was checked; `KVM_RUN` comes next.
    BeforeRun,
}

/// How long the caller waits for the interrupted probe thread to end.
const STOP_GRACE: Duration = Duration::from_millis(500);

/// Runs the real KVM probe on a helper thread and waits at most `timeout`; on timeout the
/// thread is stopped (stop flag, then SIGUSR1 with `immediate_exit`) so it never burns a CPU.
pub fn probe_kvm(timeout: Duration) -> Result<(), KvmUnusable> {
    probe_with(timeout, |_| {}).0
}

/// [`probe_kvm`] with a hook the probe thread calls at each [`Stage`]; also returns the channel
/// the thread reports its [`Outcome`] on, for a result that arrives after the timeout.
fn probe_with(
    timeout: Duration,
    hook: impl Fn(Stage) + Send + 'static,
) -> (Result<(), KvmUnusable>, mpsc::Receiver<Outcome>) {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    let (tx, rx) = mpsc::channel();
    let action = SigAction::new(
        SigHandler::Handler(interrupt_kvm_run),
        SaFlags::empty(),
        SigSet::empty(),
    );
    // SAFETY: the handler only reads a const-initialised thread-local and writes one byte,
    // both async-signal-safe; no other part of the launcher uses SIGUSR1.
    if let Err(e) = unsafe { sigaction(Signal::SIGUSR1, &action) } {
        return (Err(KvmUnusable::Setup(format!("sigaction: {e}"))), rx);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let thread_stop = stop.clone();
    let spawned = std::thread::Builder::new()
        .name("kvm-probe".into())
        .spawn(move || {
            hook(Stage::Started);
            let _ = tx.send(run_probe_guest(&thread_stop, &hook));
        });
    let handle = match spawned {
        Ok(h) => h,
        Err(e) => return (Err(KvmUnusable::Setup(e.to_string())), rx),
    };
    let start = Instant::now();
    let result = match rx.recv_timeout(timeout) {
        Ok(Outcome::Ran(r)) => r,
        // Only a stop request cancels the probe, and none was sent yet.
        Ok(Outcome::Cancelled) => Err(KvmUnusable::Timeout(start.elapsed())),
        Err(_) => {
            // The flag is seen by a thread that has not reached its check before KVM_RUN yet;
            // the signal (with immediate_exit) by one past it, in KVM_RUN or about to enter it.
            stop.store(true, Ordering::SeqCst);
            let thread = std::os::unix::thread::JoinHandleExt::as_pthread_t(&handle);
            let _ = nix::sys::pthread::pthread_kill(thread, Signal::SIGUSR1);
            Err(KvmUnusable::Timeout(start.elapsed().max(timeout)))
        }
    };
    if result.is_err() && !handle.is_finished() {
        let waited = Instant::now();
        while !handle.is_finished() && waited.elapsed() < STOP_GRACE {
            std::thread::sleep(Duration::from_millis(1));
        }
        if !handle.is_finished() {
            tracing::warn!(
                "KVM probe thread still busy {STOP_GRACE:?} after it was stopped (stuck in VM setup)"
            );
        }
    }
    (result, rx)
}

/// Guest-physical layout of the probe: code, 4-level page tables, a counter; all in 6 pages.
const MEM_SIZE: usize = 0x6000;
const CODE: u64 = 0x1000;
const PML4: u64 = 0x2000;
const PDPT: u64 = 0x3000;
const PD: u64 = 0x4000;
const COUNTER: u64 = 0x5000;
/// Loop iterations the probe runs in 64-bit mode before HLT.
const ITERATIONS: u32 = 1_000_000;

/// 64-bit code: `mov rcx, N; 1: inc qword [COUNTER]; dec rcx; jnz 1b; hlt`.
fn probe_code() -> Vec<u8> {
    let mut c = vec![0x48, 0xc7, 0xc1];
    c.extend_from_slice(&ITERATIONS.to_le_bytes());
    c.extend_from_slice(&[0x48, 0xff, 0x04, 0x25]);
    c.extend_from_slice(&(COUNTER as u32).to_le_bytes());
    c.extend_from_slice(&[0x48, 0xff, 0xc9, 0x75, 0xf3, 0xf4]);
    c
}

/// Runs a vCPU in 64-bit long mode with paging (what a real kernel needs, and what hangs on
/// machines where a bare real-mode HLT still works) through a counting loop, then HLT; unless
/// `stop` is set first.
fn run_probe_guest(stop: &AtomicBool, hook: &dyn Fn(Stage)) -> Outcome {
    match run_probe_vcpu(stop, hook) {
        Ok(true) => Outcome::Ran(Ok(())),
        Ok(false) => Outcome::Cancelled,
        Err(e) => Outcome::Ran(Err(e)),
    }
}

/// The probe itself: Ok(true) when the vCPU counted and halted, Ok(false) when stopped.
fn run_probe_vcpu(stop: &AtomicBool, hook: &dyn Fn(Stage)) -> Result<bool, KvmUnusable> {
    let setup = |e: kvm_ioctls::Error| KvmUnusable::Setup(e.to_string());
    let kvm = Kvm::new().map_err(|e| KvmUnusable::Open(e.to_string()))?;
    // Declared before `vm`, so dropped (unmapped) after it.
    let mem = ProbeMemory::map()?;
    mem.load_probe_guest();
    let vm = kvm.create_vm().map_err(setup)?;
    // SAFETY: the region describes `mem`'s mapping, which outlives the VM fd (and with it the
    // vCPU): `mem` is dropped after `vm`.
    unsafe { vm.set_user_memory_region(mem.region()) }.map_err(setup)?;
    let mut vcpu = vm.create_vcpu(0).map_err(setup)?;
    enter_long_mode(&vcpu).map_err(setup)?;
    if !run_until_halt(&mut vcpu, stop, hook)? {
        return Ok(false);
    }
    // The vCPU has stopped: the counter is what it wrote.
    let counted = mem.read_u64(COUNTER);
    if counted != u64::from(ITERATIONS) {
        return Err(KvmUnusable::UnexpectedExit(format!(
            "HLT after counting to {counted} instead of {ITERATIONS}"
        )));
    }
    Ok(true)
}

/// The probe guest's memory: [`MEM_SIZE`] bytes of private anonymous memory, unmapped on drop.
struct ProbeMemory {
    base: std::ptr::NonNull<std::ffi::c_void>,
}

impl ProbeMemory {
    fn map() -> Result<Self, KvmUnusable> {
        let len = NonZeroUsize::new(MEM_SIZE).expect("probe memory size is not zero");
        // SAFETY: a fresh private anonymous mapping; no existing memory is aliased.
        let base = unsafe {
            mmap_anonymous(
                None,
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE,
            )
        }
        .map_err(|e| KvmUnusable::Setup(format!("mmap: {e}")))?;
        Ok(Self { base })
    }

    /// Code and page tables: one present, writable 2 MiB page at 0, identity-mapped.
    fn load_probe_guest(&self) {
        self.write(CODE, &probe_code());
        self.write(PML4, &(PDPT | 0x3).to_le_bytes());
        self.write(PDPT, &(PD | 0x3).to_le_bytes());
        self.write(PD, &0x83u64.to_le_bytes());
    }

    fn write(&self, at: u64, bytes: &[u8]) {
        assert!(at as usize + bytes.len() <= MEM_SIZE);
        // SAFETY: the assertion keeps the copy inside the MEM_SIZE bytes mapped, and nothing
        // else references that memory while the vCPU is not running.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.base.cast::<u8>().as_ptr().add(at as usize),
                bytes.len(),
            )
        };
    }

    /// The little-endian u64 at `at`; call only while the vCPU is not running.
    fn read_u64(&self, at: u64) -> u64 {
        assert!(at as usize + 8 <= MEM_SIZE);
        let mut b = [0u8; 8];
        // SAFETY: the assertion keeps the copy inside the mapping; the vCPU is not running.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.cast::<u8>().as_ptr().add(at as usize),
                b.as_mut_ptr(),
                8,
            )
        };
        u64::from_le_bytes(b)
    }

    /// The whole mapping as guest memory from guest-physical address 0.
    fn region(&self) -> kvm_userspace_memory_region {
        kvm_userspace_memory_region {
            slot: 0,
            guest_phys_addr: 0,
            memory_size: MEM_SIZE as u64,
            userspace_addr: self.base.as_ptr() as u64,
            flags: 0,
        }
    }
}

impl Drop for ProbeMemory {
    fn drop(&mut self) {
        // SAFETY: `base` came from mmap with length MEM_SIZE; the VM using it was dropped
        // before (see `run_probe_vcpu`).
        let _ = unsafe { munmap(self.base, MEM_SIZE) };
    }
}

/// Puts the vCPU in 64-bit long mode with paging (flat code and data segments, CR3 at the
/// probe's PML4), at the probe code.
fn enter_long_mode(vcpu: &kvm_ioctls::VcpuFd) -> Result<(), kvm_ioctls::Error> {
    let mut sregs = vcpu.get_sregs()?;
    let code = kvm_bindings::kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector: 1 << 3,
        type_: 11,
        present: 1,
        s: 1,
        l: 1,
        g: 1,
        ..Default::default()
    };
    let data = kvm_bindings::kvm_segment {
        selector: 2 << 3,
        type_: 3,
        l: 0,
        db: 1,
        ..code
    };
    sregs.cs = code;
    (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
    sregs.cr3 = PML4;
    sregs.cr4 |= 1 << 5; // PAE
    sregs.cr0 |= 1 | (1 << 31); // PE | PG
    sregs.efer |= (1 << 8) | (1 << 10); // LME | LMA
    vcpu.set_sregs(&sregs)?;
    let mut regs = vcpu.get_regs()?;
    regs.rip = CODE;
    regs.rflags = 2;
    vcpu.set_regs(&regs)
}

/// Runs the vCPU unless `stop` is set: Ok(true) on HLT, Ok(false) when stopped.
fn run_until_halt(
    vcpu: &mut kvm_ioctls::VcpuFd,
    stop: &AtomicBool,
    hook: &dyn Fn(Stage),
) -> Result<bool, KvmUnusable> {
    // Publish the flag, then check the stop request: a stop before this check is seen
    // here, one after it finds the flag published (SeqCst on both sides).
    let _slot = ImmediateExitSlot::publish(&raw mut vcpu.get_kvm_run().immediate_exit);
    if stop.load(Ordering::SeqCst) {
        return Ok(false);
    }
    hook(Stage::BeforeRun);
    match vcpu.run() {
        Ok(VcpuExit::Hlt) => Ok(true),
        Ok(other) => Err(KvmUnusable::UnexpectedExit(format!("{other:?}"))),
        Err(e) if e.errno() == nix::libc::EINTR && stop.load(Ordering::SeqCst) => Ok(false),
        Err(e) => Err(KvmUnusable::UnexpectedExit(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_falls_back_to_tcg_with_the_reason() {
        let d = decide(AccelChoice::Auto, || {
            Err(KvmUnusable::Timeout(Duration::from_secs(2)))
        })
        .unwrap();
        assert_eq!(d.accel, Accel::Tcg);
        assert!(
            d.fallback_reason
                .unwrap()
                .to_string()
                .contains("guests hang here")
        );
        let d = decide(AccelChoice::Auto, || Ok(())).unwrap();
        assert_eq!(
            d,
            AccelDecision {
                accel: Accel::Kvm,
                fallback_reason: None
            }
        );
    }

    #[test]
    fn kvm_fails_clearly_and_tcg_never_probes() {
        let e = decide(AccelChoice::Kvm, || {
            Err(KvmUnusable::Open("No such file or directory".into()))
        })
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "open /dev/kvm: No such file or directory (mount /dev/kvm into the Pod, or use --accel tcg)"
        );
        let d = decide(AccelChoice::Tcg, || panic!("tcg must not probe")).unwrap();
        assert_eq!(d.accel, Accel::Tcg);
    }

    /// /dev/kvm openable here: under `CI` its absence fails the test.
    fn kvm_device() -> bool {
        match std::fs::File::open("/dev/kvm") {
            Ok(_) => true,
            Err(e) if std::env::var_os("CI").is_some() => {
                panic!("open /dev/kvm: {e} (run on a host with KVM: modprobe kvm_intel or kvm_amd)")
            }
            Err(e) => {
                eprintln!("skipping: open /dev/kvm: {e}");
                false
            }
        }
    }

    /// Holds the probe thread at `at` until the probe timed out and sent its stop request,
    /// then lets it go on and returns how it ended. The timeout leaves a loaded host's thread
    /// half a second to reach `at`; one that did not is stopped before it, which must end the
    /// same way.
    fn stop_while_held_at(at: Stage) -> Option<Outcome> {
        let (release, held) = mpsc::channel::<()>();
        let held = std::sync::Mutex::new(held);
        let (result, outcome) = probe_with(Duration::from_millis(500), move |stage| {
            if stage == at {
                let _ = held.lock().unwrap().recv();
            }
        });
        assert!(matches!(result, Err(KvmUnusable::Timeout(_))), "{result:?}");
        // Fails only when the thread ended without reaching `at` (it dropped the receiver).
        let _ = release.send(());
        outcome.recv_timeout(Duration::from_secs(2)).ok()
    }

    /// The stop request arrives before the probe thread set anything up (the signal meets no
    /// KVM_RUN): the thread still stops instead of running the guest, or hanging in it.
    #[test]
    fn a_stop_before_the_vcpu_exists_is_not_lost() {
        if !kvm_device() {
            return;
        }
        assert_eq!(stop_while_held_at(Stage::Started), Some(Outcome::Cancelled));
    }

    /// The narrowest window: the thread checked the stop flag, then the stop request (and
    /// signal) arrive before it enters KVM_RUN. immediate_exit makes KVM_RUN return at once.
    #[test]
    fn a_stop_just_before_kvm_run_is_not_lost() {
        if !kvm_device() {
            return;
        }
        assert_eq!(
            stop_while_held_at(Stage::BeforeRun),
            Some(Outcome::Cancelled)
        );
    }

    /// The real probe on this machine: it must come back within its timeout either way.
    #[test]
    fn real_probe_returns_within_timeout() {
        let start = Instant::now();
        let r = probe_kvm(DEFAULT_PROBE_TIMEOUT);
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "probe took {:?}",
            start.elapsed()
        );
        eprintln!("kvm probe on this machine: {r:?} in {:?}", start.elapsed());
        // The probe thread was interrupted: a second probe is not blocked by the first.
        let again = Instant::now();
        let _ = probe_kvm(Duration::from_millis(200));
        assert!(again.elapsed() < Duration::from_secs(1));
    }
}
