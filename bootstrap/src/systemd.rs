//! systemd unit names and unit files, and POSIX shell quoting for generated scripts.

/// `[Service]` lines that send a unit's output to the journal only, never to the console.
///
/// The serial console is the machine Pod's log (`kubectl logs`) and `capk-launcher console`,
/// readable by anyone with `pods/log`; `kubeadm init` prints `kubeadm join … --token …` (and
/// with `--upload-certs` the certificate key). systemd still writes boot progress and unit
/// start/stop/failure to the console itself; journald forwards nothing there unless
/// `ForwardToConsole=yes` (or `systemd.journald.forward_to_console=1`) is set, which neither
/// Flatcar nor systemd does by default.
pub const JOURNAL_ONLY_OUTPUT: &str = "StandardOutput=journal\nStandardError=journal\n";

/// Name of the drop-in capk-bootstrap adds to CABPK's Ignition `kubeadm.service` (see
/// [`journal_only_dropin`]). systemd applies the drop-ins of a unit in file-name order across all
/// its drop-in directories, and `zz-` sorts after the numbered names CABPK and the Flatcar
/// templates use (`10-flatcar.conf`), so its settings win.
pub const JOURNAL_ONLY_DROPIN: &str = "zz-capk-output-journal-only.conf";

/// The text of the [`JOURNAL_ONLY_DROPIN`] drop-in.
pub fn journal_only_dropin() -> String {
    format!(
        "# Added by capk-bootstrap: kubeadm's output (the join token) stays off the serial\n\
         # console, which is the machine Pod's log.\n\
         [Service]\n{JOURNAL_ONLY_OUTPUT}"
    )
}

/// Escapes an absolute path the way `systemd-escape --path` does (`/var/lib/etcd` →
/// `var-lib-etcd`), for mount unit names. The path is normalised first: repeated and trailing
/// slashes are dropped. Returns `None` for a relative path or one with `.`/`..` components,
/// which systemd refuses as mount points.
pub fn escape_path(path: &str) -> Option<String> {
    if !path.starts_with('/') {
        return None;
    }
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    if parts.iter().any(|p| *p == "." || *p == "..") {
        return None;
    }
    if parts.is_empty() {
        return Some("-".to_owned());
    }
    let joined = parts.join("/");
    let mut out = String::with_capacity(joined.len());
    for (i, b) in joined.bytes().enumerate() {
        match b {
            b'/' => out.push('-'),
            b'.' if i == 0 => out.push_str("\\x2e"),
            b if b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b':' => {
                out.push(b as char)
            }
            b => out.push_str(&format!("\\x{b:02x}")),
        }
    }
    Some(out)
}

/// The inverse of [`escape_path`]: the absolute path a unit name prefix stands for.
pub fn unescape_path(escaped: &str) -> Option<String> {
    if escaped == "-" {
        return Some("/".to_owned());
    }
    let mut bytes = Vec::with_capacity(escaped.len() + 1);
    bytes.push(b'/');
    let raw = escaped.as_bytes();
    let mut i = 0;
    while i < raw.len() {
        match raw[i] {
            b'-' => bytes.push(b'/'),
            b'\\' => {
                let hex = escaped.get(i + 2..i + 4)?;
                if raw.get(i + 1) != Some(&b'x') {
                    return None;
                }
                bytes.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b => bytes.push(b),
        }
        i += 1;
    }
    String::from_utf8(bytes).ok()
}

/// The `.mount` unit name systemd requires for a mount point.
pub fn mount_unit_name(path: &str) -> Option<String> {
    escape_path(path).map(|e| format!("{e}.mount"))
}

/// Quotes one argument for a POSIX shell: single quotes, with `'` written as `'"'"'`.
/// Arguments made only of safe characters are left bare to keep scripts readable.
pub fn shell_quote(arg: &str) -> String {
    let safe = !arg.is_empty()
        && arg
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./:=,+@%".contains(&b));
    if safe {
        arg.to_owned()
    } else {
        format!("'{}'", arg.replace('\'', r#"'"'"'"#))
    }
}

/// A systemd `.mount` unit that mounts `what` on `where_` at every boot.
pub struct MountUnit<'a> {
    pub description: &'a str,
    pub what: &'a str,
    pub where_: &'a str,
    pub fs_type: Option<&'a str>,
    pub options: Option<&'a str>,
    pub wanted_by: &'a str,
}

impl MountUnit<'_> {
    /// The unit file's text.
    pub fn contents(&self) -> String {
        let mut s = format!(
            "[Unit]\nDescription={}\n\n[Mount]\nWhat={}\nWhere={}\n",
            self.description, self.what, self.where_
        );
        if let Some(t) = self.fs_type {
            s.push_str(&format!("Type={t}\n"));
        }
        if let Some(o) = self.options {
            s.push_str(&format!("Options={o}\n"));
        }
        s.push_str(&format!("\n[Install]\nWantedBy={}\n", self.wanted_by));
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_like_systemd() {
        assert_eq!(escape_path("/var/lib/etcd").unwrap(), "var-lib-etcd");
        assert_eq!(escape_path("//data//my-vol/").unwrap(), "data-my\\x2dvol");
        assert_eq!(escape_path("/").unwrap(), "-");
        assert_eq!(escape_path("/.hidden").unwrap(), "\\x2ehidden");
        assert_eq!(escape_path("relative"), None);
        assert_eq!(escape_path("/a/../b"), None);
    }

    #[test]
    fn quotes_for_the_shell() {
        assert_eq!(shell_quote("kubeadm"), "kubeadm");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r#"'it'"'"'s'"#);
        assert_eq!(shell_quote(""), "''");
    }
}
