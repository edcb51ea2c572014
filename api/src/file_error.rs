//! A failed operation on a named file: what was done and to which file. The one shape of that
//! error for every crate that works on the node's files (the launcher's disks, image cache, etcd
//! directory and QEMU hand-over, the node image fetcher), each of which wraps it in a variant of
//! its own error.

use std::path::{Path, PathBuf};

/// `action` on `path` failed; displayed as `<action> <path>`, the cause as its source.
#[derive(Debug, thiserror::Error)]
#[error("{action} {}", path.display())]
pub struct FileError {
    /// What was being done (`create`, `rename to`, ...).
    pub action: &'static str,
    /// The file or directory.
    pub path: PathBuf,
    /// The cause.
    #[source]
    pub source: std::io::Error,
}

impl FileError {
    /// For `map_err`: the failure of `action` on `path`.
    pub fn at(
        action: &'static str,
        path: &Path,
    ) -> impl FnOnce(std::io::Error) -> FileError + use<> {
        let path = path.to_path_buf();
        move |source| FileError {
            action,
            path,
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error;

    use super::*;

    #[test]
    fn says_what_was_done_to_which_file_and_keeps_the_cause() {
        let not_found = std::io::Error::from(std::io::ErrorKind::NotFound);
        let e = FileError::at("rename to", Path::new("/var/lib/capk/root.qcow2"))(not_found);
        assert_eq!(e.to_string(), "rename to /var/lib/capk/root.qcow2");
        let cause = e.source().expect("the cause");
        assert_eq!(cause.to_string(), "entity not found");
    }
}
