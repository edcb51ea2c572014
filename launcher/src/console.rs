//! The guest's serial console: QEMU writes it to a pipe; the launcher copies every byte to its
//! stdout (the container's log, `kubectl logs`, complete) and to a size-capped copy in the
//! runtime directory (`console.log`, with one predecessor `console.log.1`) that `capk-launcher
//! console` shows, and hands each line to the boot-failure detector.
//!
//! The copy is on the container's writable layer (the node's disk), so it is bounded: QEMU's own
//! `logfile=` only appends, and a guest (systemd's spinner, a crash loop) can write without end.
//! [`CONSOLE_LOG_MAX_BYTES`] per file keeps a whole boot of a node (a few hundred KiB) and the
//! latest lines, at most 8 MiB on disk; the full history is the container's log.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::line::{Frame, LineFramer};

/// Size cap of each console file: `console.log` is renamed to `console.log.1` (replacing it)
/// when it would grow past this.
pub const CONSOLE_LOG_MAX_BYTES: u64 = 4 << 20;

/// Longest console line handed on; longer ones are skipped (the copy keeps them).
pub const CONSOLE_LINE_MAX: usize = 4096;

/// The rotated predecessor of `path` (`console.log.1`).
pub fn rotated(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".1");
    PathBuf::from(p)
}

/// Opens the console log for reading without following a symbolic link (the runtime directory
/// is shared with QEMU's unprivileged user; the reader may be root).
pub fn open_for_reading(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
}

fn open_for_append(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o640)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
}

/// The capped copy: appends to `path` and rotates it to [`rotated`] at `max` bytes, so the two
/// files never hold more than `2 * max` and always the newest bytes.
#[derive(Debug)]
pub struct ConsoleLog {
    path: PathBuf,
    max: u64,
    file: File,
    len: u64,
}

impl ConsoleLog {
    /// Opens (or creates) `path` for appending; an earlier run's content stays, counted in the cap.
    pub fn open(path: &Path, max: u64) -> io::Result<Self> {
        let file = open_for_append(path)?;
        let len = file.metadata()?.len();
        Ok(Self {
            path: path.to_path_buf(),
            max: max.max(1),
            file,
            len,
        })
    }

    /// Appends `data`, rotating first whenever the file is full.
    pub fn write(&mut self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            if self.len >= self.max {
                self.rotate()?;
            }
            let n = data.len().min((self.max - self.len) as usize);
            self.file.write_all(&data[..n])?;
            self.len += n as u64;
            data = &data[n..];
        }
        Ok(())
    }

    fn rotate(&mut self) -> io::Result<()> {
        // rename replaces console.log.1 (whatever it is: a symlink is replaced, not followed);
        // a follower still reading the old file finishes it, then finds the new one.
        std::fs::rename(&self.path, rotated(&self.path))?;
        self.file = open_for_append(&self.path)?;
        self.len = self.file.metadata()?.len();
        Ok(())
    }
}

/// Reads the console log as it grows, across rotations: at the end of the file it holds, when
/// the path names another file (the log was rotated), it goes on at the new file's start. A
/// follower that polls less often than the log rotates would miss the file in between; with
/// [`CONSOLE_LOG_MAX_BYTES`] per file that is megabytes between two reads.
#[derive(Debug)]
pub struct ConsoleFollower {
    path: PathBuf,
    file: File,
    ino: u64,
}

impl ConsoleFollower {
    /// Opens `path` at its start.
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = open_for_reading(path)?;
        let ino = file.metadata()?.ino();
        Ok(Self {
            path: path.to_path_buf(),
            file,
            ino,
        })
    }

    /// Reads what is there; 0 when nothing new has been written yet.
    pub fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let n = self.file.read(buf)?;
            if n > 0 {
                return Ok(n);
            }
            match open_for_reading(&self.path) {
                Ok(f) if f.metadata()?.ino() != self.ino => {
                    self.ino = f.metadata()?.ino();
                    self.file = f;
                }
                _ => return Ok(0),
            }
        }
    }
}

/// Copies QEMU's serial output from `input` until it ends: every byte to `out` (a failed write
/// there loses nothing else), the same to `log` (dropped with a warning when it fails: the
/// container's log still has everything), and each line of at most [`CONSOLE_LINE_MAX`] bytes to
/// `on_line`. QEMU blocks when the pipe is full, so this never waits for anything but `out`.
pub fn tee(
    mut input: impl Read,
    mut out: impl Write,
    mut log: Option<ConsoleLog>,
    mut on_line: impl FnMut(&[u8]),
) {
    let mut framer = LineFramer::new(CONSOLE_LINE_MAX);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!(error = %e, "read the serial console from QEMU");
                return;
            }
        };
        let data = &buf[..n];
        let _ = out.write_all(data).and_then(|()| out.flush());
        if let Some(l) = &mut log
            && let Err(e) = l.write(data)
        {
            tracing::warn!(
                path = %l.path.display(),
                error = %e,
                "console copy stopped (kubectl logs still has the console)"
            );
            log = None;
        }
        let mut rest = data;
        while !rest.is_empty() {
            let (taken, frame) = framer.feed(rest);
            rest = &rest[taken..];
            if let Some(Frame::Line(line)) = frame {
                on_line(&line);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(from: u32, to: u32) -> Vec<u8> {
        (from..to)
            .flat_map(|i| format!("line {i:05}\n").into_bytes())
            .collect()
    }

    /// A flood through the tee: stdout gets every byte, the two files never exceed the cap each,
    /// together they end with the newest lines, and the detector saw every line.
    #[test]
    fn the_copy_is_capped_keeps_the_newest_lines_and_stdout_gets_everything() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("console.log");
        std::fs::write(&path, b"earlier run\n").unwrap();
        let max = 1000;
        let input = lines(0, 1000); // 11 000 bytes: about ten rotations
        let mut out = Vec::new();
        let mut seen = 0;
        tee(
            &input[..],
            &mut out,
            Some(ConsoleLog::open(&path, max).unwrap()),
            |_| seen += 1,
        );
        assert_eq!(out, input, "stdout is the complete console");
        assert_eq!(seen, 1000);
        let (cur, old) = (
            std::fs::read(&path).unwrap(),
            std::fs::read(rotated(&path)).unwrap(),
        );
        assert!(cur.len() as u64 <= max && old.len() as u64 == max);
        let kept = [old, cur].concat();
        assert!(input.ends_with(&kept), "the files hold the newest bytes");
        assert!(kept.len() > 1000);
    }

    /// `capk-launcher console` following the file while the log rotates twice under it reads
    /// every byte once, in order.
    #[test]
    fn the_follower_goes_on_in_the_new_file_after_a_rotation() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("console.log");
        let mut log = ConsoleLog::open(&path, 1000).unwrap();
        let mut follower = ConsoleFollower::open(&path).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 300];
        let input = lines(0, 250); // 2750 bytes
        for chunk in input.chunks(700) {
            log.write(chunk).unwrap();
            loop {
                let n = follower.read(&mut buf).unwrap();
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
        }
        assert_eq!(got, input);
    }

    /// The boot-failure detector gets lines from the tee, also one split across two reads and
    /// one after a line far over the cap.
    #[test]
    fn lines_split_across_reads_reach_the_detector() {
        let input: Vec<u8> = [
            &vec![b'*'; 100 * 1024][..],
            b"\nYou are in emergen",
            b"cy mode. After logging in\n",
        ]
        .concat();
        let mut found = Vec::new();
        // A reader that returns 7 bytes at a time, like a pipe under load.
        struct Trickle<'a>(&'a [u8]);
        impl Read for Trickle<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                let n = self.0.len().min(buf.len()).min(7);
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        tee(Trickle(&input), io::sink(), None, |l| {
            found.push(l.to_vec())
        });
        assert_eq!(
            found,
            [b"You are in emergency mode. After logging in".to_vec()]
        );
    }
}
