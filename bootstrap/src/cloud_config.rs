//! CABPK `#cloud-config` → Ignition v3.
//!
//! Supported keys (everything CABPK's templates emit): `write_files`, `bootcmd`, `runcmd`,
//! `users`, `ntp`, `disk_setup`, `fs_setup`, `mounts`. Every other key, at any depth, is an error
//! that names it. How each key maps is documented on its `convert_*` function.

use std::collections::BTreeMap;

use ignition_config::v3_4::{Config, Disk, File, Filesystem, Partition, User};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_yaml_ng::Value;

use crate::content;
use crate::error::{ConvertError, KeyPath, ignored_path};
use crate::systemd::{JOURNAL_ONLY_OUTPUT, MountUnit, mount_unit_name, shell_quote};
use crate::{MachineFacts, jinja, v3};

/// The cloud-config keys this converter understands.
pub const SUPPORTED_KEYS: &[&str] = &[
    "write_files",
    "bootcmd",
    "runcmd",
    "users",
    "ntp",
    "disk_setup",
    "fs_setup",
    "mounts",
];

/// Where files that cloud-init would write to a tmpfs (`/run`, `/tmp`) are staged by Ignition.
/// Ignition writes the root filesystem from the initramfs; a file it puts under `/run` would be
/// hidden by the tmpfs mounted there at boot, so a unit copies them into place before the
/// commands run (once, as cloud-init writes files once per instance).
pub const RUN_STAGING_DIR: &str = "/var/lib/capk/run-staging";
/// Directory of the generated scripts.
pub const SCRIPT_DIR: &str = "/etc/capk/bootstrap";
/// Unit that copies staged `/run` and `/tmp` files into place.
pub const STAGE_UNIT: &str = "capk-run-files.service";
/// Unit that runs `bootcmd` on every boot.
pub const BOOTCMD_UNIT: &str = "capk-bootcmd.service";
/// Unit that runs `runcmd` (CABPK's pre-kubeadm commands, kubeadm, post-kubeadm commands) once.
pub const RUNCMD_UNIT: &str = "capk-runcmd.service";
/// Marker: `runcmd` has been started on this instance (cloud-init runs it once per instance).
pub const RUNCMD_DONE: &str = "/var/lib/capk/runcmd.started";
/// The file CABPK's commands write on success (the CAPI bootstrap contract).
pub const SUCCESS_FILE: &str = "/run/cluster-api/bootstrap-success.complete";
/// A copy of [`SUCCESS_FILE`] that survives reboots (`/run` does not).
pub const SUCCESS_FILE_PERSISTENT: &str = "/var/lib/capk/bootstrap-success.complete";
/// timesyncd drop-in written from the `ntp` key.
pub const NTP_DROPIN: &str = "/etc/systemd/timesyncd.conf.d/50-cloud-config-ntp.conf";
/// sudoers file for the users' `sudo` rules (the name cloud-init uses).
pub const SUDOERS_FILE: &str = "/etc/sudoers.d/90-cloud-init-users";

const TMPFS_PREFIXES: &[&str] = &["/run/", "/var/run/", "/tmp/"];
const FORBIDDEN_PREFIXES: &[&str] = &["/dev/", "/proc/", "/sys/"];

/// Converts cloud-config text into an Ignition v3 config.
pub fn convert(text: &str, facts: &MachineFacts) -> Result<Config, ConvertError> {
    let body = strip_header(text)?;
    let rendered;
    let yaml = if body.jinja {
        rendered = jinja::render(body.rest, &facts.hostname, &facts.instance_id)?;
        rendered.as_str()
    } else {
        body.rest
    };
    refuse_binary_tags(yaml)?;
    let doc: Value =
        serde_yaml_ng::from_str(yaml).map_err(|e| ConvertError::ParseCloudConfig(e.to_string()))?;
    let map = match doc {
        Value::Mapping(m) => m,
        Value::Null => serde_yaml_ng::Mapping::new(),
        _ => {
            return Err(ConvertError::ParseCloudConfig(
                "the document is not a mapping of cloud-config keys".to_owned(),
            ));
        }
    };

    let mut sections: BTreeMap<&'static str, Value> = BTreeMap::new();
    for (k, v) in map {
        let Value::String(key) = k else {
            return Err(ConvertError::ParseCloudConfig(format!(
                "top-level key {k:?} is not a string"
            )));
        };
        let Some(known) = SUPPORTED_KEYS.iter().find(|s| **s == key) else {
            return Err(ConvertError::unsupported(
                key.as_str(),
                top_level_hint(&key),
            ));
        };
        sections.insert(known, v);
    }
    let mut take = |k: &str| sections.remove(k).filter(|v| !v.is_null());

    let mut out = v3::empty_config();
    let staged = match take("write_files") {
        Some(v) => convert_write_files(v, &mut out)?,
        None => Vec::new(),
    };
    if !staged.is_empty() {
        add_stage_unit(&staged, &mut out);
    }
    if let Some(v) = take("bootcmd") {
        let lines = commands(v, &"bootcmd".into())?;
        add_bootcmd_unit(&lines, facts, &mut out);
    }
    if let Some(v) = take("runcmd") {
        let lines = commands(v, &"runcmd".into())?;
        add_runcmd_unit(&lines, !staged.is_empty(), &mut out);
    }
    if let Some(v) = take("users") {
        convert_users(v, &mut out)?;
    }
    if let Some(v) = take("ntp") {
        convert_ntp(v, &mut out)?;
    }
    let disk_setup: BTreeMap<String, DiskSetup> = match take("disk_setup") {
        Some(v) => typed(v, &"disk_setup".into())?,
        None => BTreeMap::new(),
    };
    convert_disk_setup(&disk_setup, &mut out)?;
    let fs_labels = match take("fs_setup") {
        Some(v) => convert_fs_setup(v, &disk_setup, &mut out)?,
        None => BTreeMap::new(),
    };
    if let Some(v) = take("mounts") {
        convert_mounts(v, &fs_labels, &mut out)?;
    }
    Ok(out)
}

/// The YAML parser resolves core-schema tags itself and would hand a `!!binary` value over as
/// its base64 text, silently writing the encoded form. Refuse the tag instead (a conservative
/// text scan: a block scalar containing `: !!binary` is refused too).
fn refuse_binary_tags(yaml: &str) -> Result<(), ConvertError> {
    for (i, line) in yaml.lines().enumerate() {
        let t = line.trim_start().trim_start_matches("- ");
        let tagged = t.contains(": !!binary")
            || t.starts_with("!!binary")
            || t.contains("!<tag:yaml.org,2002:binary>");
        if tagged && !t.starts_with('#') {
            return Err(ConvertError::ParseCloudConfig(format!(
                "the YAML tag `!!binary` on line {} is not supported; give the content as \
                 base64 text with `encoding: b64`",
                i + 1
            )));
        }
    }
    Ok(())
}

struct Body<'a> {
    jinja: bool,
    rest: &'a str,
}

/// Accepts `#cloud-config` as the first line, or `## template: jinja` then `#cloud-config`.
fn strip_header(text: &str) -> Result<Body<'_>, ConvertError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let (first, rest) = text.split_once('\n').unwrap_or((text, ""));
    if first.trim_end() == jinja::JINJA_HEADER {
        let (second, _) = rest.split_once('\n').unwrap_or((rest, ""));
        if second.trim_end() != "#cloud-config" {
            return Err(ConvertError::NotCloudConfig);
        }
        // Keep the header lines (YAML comments) so Jinja errors report the input's line numbers.
        return Ok(Body {
            jinja: true,
            rest: text,
        });
    }
    if first.trim_end() != "#cloud-config" {
        return Err(ConvertError::NotCloudConfig);
    }
    Ok(Body {
        jinja: false,
        rest: text,
    })
}

fn top_level_hint(key: &str) -> String {
    let specific = match key {
        "hostname" | "fqdn" | "preserve_hostname" | "prefer_fqdn_over_hostname" => {
            Some("the hostname comes from the Machine (the KVMMachine's per-machine Ignition)")
        }
        "packages" | "package_update" | "package_upgrade" | "apt" | "yum_repos" | "snap" => {
            Some("Flatcar has no package manager; put software in the node image or a sysext")
        }
        "ssh_pwauth" | "chpasswd" | "ssh_keys" | "ssh_deletekeys" | "disable_root" => {
            Some("configure SSH through `users` or write sshd_config with `files`")
        }
        "power_state" | "final_message" | "phone_home" => {
            Some("there is no cloud-init in the guest to act on it")
        }
        _ => None,
    };
    let supported = SUPPORTED_KEYS.join(", ");
    match specific {
        Some(why) => format!("{why} (supported keys: {supported})"),
        None => format!("not convertible to Ignition (supported keys: {supported})"),
    }
}

/// Deserialises `value` into `T`, turning unknown keys into an error that names them.
fn typed<T: DeserializeOwned>(value: Value, at: &KeyPath) -> Result<T, ConvertError> {
    let mut unknown: Option<KeyPath> = None;
    let parsed: Result<T, _> = serde_path_to_error::deserialize(serde_ignored::Deserializer::new(
        value,
        &mut |path: serde_ignored::Path<'_>| {
            if unknown.is_none() {
                unknown = Some(ignored_path(&path));
            }
        },
    ));
    if let Some(key) = unknown {
        let full = if key.as_str().starts_with('[') {
            KeyPath::from(format!("{at}{key}"))
        } else {
            at.field(key.as_str())
        };
        return Err(ConvertError::unsupported(
            full,
            "not convertible to Ignition; remove it from the KubeadmConfig",
        ));
    }
    parsed.map_err(|e| {
        let inner = e.path().to_string();
        let key = if inner == "." {
            at.clone()
        } else if inner.starts_with('[') {
            KeyPath::from(format!("{at}{inner}"))
        } else {
            at.field(&inner)
        };
        ConvertError::invalid(key, e.into_inner().to_string())
    })
}

fn sequence(value: Value, at: &KeyPath) -> Result<Vec<Value>, ConvertError> {
    match value {
        Value::Sequence(s) => Ok(s),
        Value::Null => Ok(Vec::new()),
        other => Err(ConvertError::invalid(
            at.clone(),
            format!("expected a list, got {}", kind(&other)),
        )),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a mapping",
        Value::Tagged(_) => "a tagged value",
    }
}

/// A scalar as cloud-init's Python would turn it into a string (numbers and strings only).
fn scalar(v: &Value, at: &KeyPath) -> Result<String, ConvertError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        other => Err(ConvertError::invalid(
            at.clone(),
            format!("expected a string or number, got {}", kind(other)),
        )),
    }
}

/// A list of strings given as a YAML list of scalars or as one string that `split` cuts into
/// items; `None` when absent. `expected` names the accepted forms in the error.
fn scalar_list(
    v: &Value,
    at: &KeyPath,
    split: fn(&str) -> Vec<String>,
    expected: &str,
) -> Result<Option<Vec<String>>, ConvertError> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(split(s))),
        Value::Sequence(list) => list
            .iter()
            .enumerate()
            .map(|(j, item)| scalar(item, &at.index(j)))
            .collect::<Result<_, _>>()
            .map(Some),
        other => Err(ConvertError::invalid(
            at.clone(),
            format!("expected {expected}, got {}", kind(other)),
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// write_files

#[derive(Deserialize)]
struct WriteFile {
    path: String,
    #[serde(default)]
    content: Value,
    #[serde(default)]
    encoding: Option<String>,
    #[serde(default)]
    owner: Option<String>,
    #[serde(default)]
    permissions: Value,
    #[serde(default)]
    append: Option<bool>,
}

/// A write_files entry Ignition wrote to [`RUN_STAGING_DIR`] and a unit copies into place.
struct Staged {
    path: String,
    mode: i64,
    owner: String,
    group: String,
}

/// `write_files` → `storage.files`, in order. A later entry for the same path replaces the
/// earlier one (cloud-init writes them in order), or with `append: true` is appended to it.
/// Encodings: see [`content::supported_encodings`]; gzip stays compressed (`compression: gzip`).
/// `permissions` must be an octal string (CABPK quotes it); `owner` is `user[:group]`.
/// Paths under `/run`, `/var/run` and `/tmp` are staged (see [`RUN_STAGING_DIR`]).
fn convert_write_files(value: Value, out: &mut Config) -> Result<Vec<Staged>, ConvertError> {
    let at = KeyPath::from("write_files");
    let mut by_path: BTreeMap<String, usize> = BTreeMap::new();
    let mut files: Vec<File> = Vec::new();
    let mut staged: BTreeMap<String, Staged> = BTreeMap::new();
    for (i, item) in sequence(value, &at)?.into_iter().enumerate() {
        let at = at.index(i);
        let wf: WriteFile = typed(item, &at)?;
        let path = normalize_path(&wf.path).ok_or_else(|| {
            ConvertError::invalid(
                at.field("path"),
                format!("`{}` is not an absolute path", wf.path),
            )
        })?;
        if path.starts_with(&format!("{SCRIPT_DIR}/")) || path.starts_with("/var/lib/capk/") {
            return Err(ConvertError::invalid(
                at.field("path"),
                format!(
                    "`{path}` is reserved for what capk-bootstrap generates ({SCRIPT_DIR}, /var/lib/capk)"
                ),
            ));
        }
        if FORBIDDEN_PREFIXES.iter().any(|p| path.starts_with(p)) {
            return Err(ConvertError::invalid(
                at.field("path"),
                format!(
                    "`{path}` is on a kernel filesystem (/dev, /proc, /sys) that Ignition cannot write"
                ),
            ));
        }
        let raw = content_bytes(&wf.content, &at.field("content"))?;
        let decoded =
            content::decode_write_file(wf.encoding.as_deref(), &raw).map_err(|e| match e {
                content::DecodeError::UnknownEncoding(_) => {
                    ConvertError::invalid(at.field("encoding"), e.to_string())
                }
                content::DecodeError::BadContent(_) => {
                    ConvertError::invalid(at.field("content"), e.to_string())
                }
            })?;
        let mode = permissions(&wf.permissions, &at.field("permissions"))?;
        let owner = wf.owner.clone().unwrap_or_else(|| "root:root".to_owned());
        let (user, group) = v3::owner(&owner);

        let target = match TMPFS_PREFIXES.iter().find(|p| path.starts_with(**p)) {
            Some(_) => {
                let (u, g) = owner.split_once(':').unwrap_or((owner.as_str(), "root"));
                staged.insert(
                    path.clone(),
                    Staged {
                        path: path.clone(),
                        mode,
                        owner: non_empty_or_root(u),
                        group: non_empty_or_root(g),
                    },
                );
                format!("{RUN_STAGING_DIR}{path}")
            }
            None => path.clone(),
        };
        let resource = content::inline_resource(&decoded);
        let append = wf.append.unwrap_or(false);
        match by_path.get(&target) {
            Some(&idx) => {
                let f = &mut files[idx];
                if append {
                    f.append.get_or_insert_with(Vec::new).push(resource);
                } else {
                    f.contents = Some(resource);
                    f.append = None;
                    f.overwrite = Some(true);
                }
                f.mode = Some(mode);
                f.user = user;
                f.group = group;
            }
            None => {
                let mut f = v3::file(&target, resource.clone(), mode);
                f.user = user;
                f.group = group;
                if append {
                    f.contents = None;
                    f.overwrite = None;
                    f.append = Some(vec![resource]);
                }
                by_path.insert(target, files.len());
                files.push(f);
            }
        }
    }
    if !staged.is_empty() {
        v3::directories(out).push(v3::directory(RUN_STAGING_DIR, 0o700));
    }
    v3::files(out).extend(files);
    Ok(staged.into_values().collect())
}

fn non_empty_or_root(s: &str) -> String {
    let s = s.trim();
    if s.is_empty() {
        "root".into()
    } else {
        s.into()
    }
}

/// Normalises an absolute path (no `.`/`..`, no repeated or trailing slashes).
fn normalize_path(p: &str) -> Option<String> {
    if !p.starts_with('/') {
        return None;
    }
    let parts: Vec<&str> = p.split('/').filter(|s| !s.is_empty()).collect();
    if parts.is_empty() || parts.iter().any(|s| *s == "." || *s == "..") {
        return None;
    }
    Some(format!("/{}", parts.join("/")))
}

/// The raw bytes of `content`: a string or absent (empty file). (`!!binary` is refused before
/// parsing, see [`refuse_binary_tags`].)
fn content_bytes(v: &Value, at: &KeyPath) -> Result<Vec<u8>, ConvertError> {
    match v {
        Value::Null => Ok(Vec::new()),
        Value::String(s) => Ok(s.as_bytes().to_vec()),
        Value::Number(n) => Ok(n.to_string().into_bytes()),
        other => Err(ConvertError::invalid(
            at.clone(),
            format!("expected text, got {}", kind(other)),
        )),
    }
}

/// Octal permissions given as a string (`'0640'`, `0o640`); default 0644 like cloud-init.
fn permissions(v: &Value, at: &KeyPath) -> Result<i64, ConvertError> {
    let s = match v {
        Value::Null => return Ok(0o644),
        Value::String(s) => s.trim(),
        Value::Number(_) => {
            return Err(ConvertError::invalid(
                at.clone(),
                "give permissions as a quoted octal string like '0644' \
                 (an unquoted number is read as decimal here but as octal by cloud-init)",
            ));
        }
        other => {
            return Err(ConvertError::invalid(
                at.clone(),
                format!("expected an octal string, got {}", kind(other)),
            ));
        }
    };
    let digits = s.strip_prefix("0o").unwrap_or(s);
    match i64::from_str_radix(digits, 8) {
        Ok(m) if (0..=0o7777).contains(&m) && !digits.is_empty() => Ok(m),
        _ => Err(ConvertError::invalid(
            at.clone(),
            format!("`{s}` is not an octal mode between 0 and 07777"),
        )),
    }
}

fn add_stage_unit(staged: &[Staged], out: &mut Config) {
    let mut script = String::from(
        "#!/bin/bash\n\
         # Generated by capk-bootstrap. Ignition cannot write to /run or /tmp (tmpfs at boot), so it\n\
         # staged these write_files entries; copy them into place once, as cloud-init would.\n\
         set -e\n",
    );
    for s in staged {
        script.push_str(&format!(
            "install -D -m {:04o} -o {} -g {} {} {}\n",
            s.mode,
            shell_quote(&s.owner),
            shell_quote(&s.group),
            shell_quote(&format!("{RUN_STAGING_DIR}{}", s.path)),
            shell_quote(&s.path),
        ));
    }
    script.push_str(&format!("rm -rf {RUN_STAGING_DIR}\n"));
    let script_path = add_script(out, "run-files.sh", &script);
    let unit = format!(
        "[Unit]\n\
         Description=Copy bootstrap files staged by Ignition into /run and /tmp\n\
         DefaultDependencies=no\n\
         After=local-fs.target\n\
         Before=sysinit.target {BOOTCMD_UNIT} {RUNCMD_UNIT}\n\
         ConditionPathExists={RUN_STAGING_DIR}\n\n\
         [Service]\n\
         Type=oneshot\n\
         RemainAfterExit=yes\n\
         ExecStart=/bin/bash {script_path}\n\n\
         [Install]\n\
         WantedBy=sysinit.target\n"
    );
    v3::units(out).push(v3::unit(STAGE_UNIT, Some(unit), true));
}

// ---------------------------------------------------------------------------------------------
// bootcmd / runcmd

/// Turns `runcmd`/`bootcmd` entries into script lines: a string is a shell line as written, a
/// list is an argv whose elements are quoted (as cloud-init does).
fn commands(value: Value, at: &KeyPath) -> Result<Vec<String>, ConvertError> {
    let mut lines = Vec::new();
    for (i, item) in sequence(value, at)?.into_iter().enumerate() {
        let at = at.index(i);
        match item {
            Value::String(s) => lines.push(s),
            Value::Sequence(argv) => {
                if argv.is_empty() {
                    return Err(ConvertError::invalid(at, "an argv list must not be empty"));
                }
                let words: Result<Vec<String>, _> = argv
                    .iter()
                    .enumerate()
                    .map(|(j, a)| scalar(a, &at.index(j)).map(|s| shell_quote(&s)))
                    .collect();
                lines.push(words?.join(" "));
            }
            other => {
                return Err(ConvertError::invalid(
                    at,
                    format!(
                        "expected a command string or an argv list, got {}",
                        kind(&other)
                    ),
                ));
            }
        }
    }
    Ok(lines)
}

/// `bootcmd` → a oneshot unit that runs the commands (with `set -e`) early on every boot, as
/// cloud-init does, with `INSTANCE_ID` set, output to the journal only. Ignition has already
/// written the files by then.
fn add_bootcmd_unit(lines: &[String], facts: &MachineFacts, out: &mut Config) {
    let script_path = add_script(out, "bootcmd.sh", &script("bootcmd", lines));
    let unit = format!(
        "[Unit]\n\
         Description=cloud-config bootcmd (every boot)\n\
         After=local-fs.target {STAGE_UNIT}\n\
         Before={RUNCMD_UNIT}\n\n\
         [Service]\n\
         Type=oneshot\n\
         RemainAfterExit=yes\n\
         Environment=INSTANCE_ID={}\n\
         ExecStart=/bin/bash {script_path}\n\
         {JOURNAL_ONLY_OUTPUT}\n\
         [Install]\n\
         WantedBy=multi-user.target\n",
        facts.instance_id
    );
    v3::units(out).push(v3::unit(BOOTCMD_UNIT, Some(unit), true));
}

/// `runcmd` (CABPK: pre-kubeadm commands, `kubeadm init|join … && echo success > SUCCESS_FILE`,
/// post-kubeadm commands) → a oneshot unit running them in order with `set -e`, once per
/// instance, after the network is online and containerd is up. As with cloud-init, the success
/// file exists only if kubeadm (and every command before it) succeeded; a failing command stops
/// the script. When the unit finishes, a success file is copied to [`SUCCESS_FILE_PERSISTENT`]
/// so the heartbeat can still report bootstrap success after a reboot. The commands' output goes
/// to the journal only ([`JOURNAL_ONLY_OUTPUT`]): `kubeadm init` prints the join token, and the
/// console is the machine Pod's log.
fn add_runcmd_unit(lines: &[String], staged: bool, out: &mut Config) {
    let script_path = add_script(out, "runcmd.sh", &script("runcmd", lines));
    let stage = if staged {
        format!(" {STAGE_UNIT}")
    } else {
        String::new()
    };
    let unit = format!(
        "[Unit]\n\
         Description=cloud-config runcmd (Cluster API bootstrap commands, once per instance)\n\
         Wants=network-online.target containerd.service\n\
         After=network-online.target containerd.service {BOOTCMD_UNIT}{stage}\n\
         ConditionPathExists=!{RUNCMD_DONE}\n\n\
         [Service]\n\
         Type=oneshot\n\
         TimeoutStartSec=infinity\n\
         ExecStartPre=/usr/bin/mkdir -p /var/lib/capk\n\
         ExecStartPre=/usr/bin/touch {RUNCMD_DONE}\n\
         ExecStart=/bin/bash {script_path}\n\
         ExecStopPost=/bin/sh -c 'if [ -e {SUCCESS_FILE} ]; then cp {SUCCESS_FILE} {SUCCESS_FILE_PERSISTENT}; fi'\n\
         {JOURNAL_ONLY_OUTPUT}\n\
         [Install]\n\
         WantedBy=multi-user.target\n"
    );
    v3::units(out).push(v3::unit(RUNCMD_UNIT, Some(unit), true));
}

/// Writes `script` to `SCRIPT_DIR/<name>` (mode 0700) and returns its path.
fn add_script(out: &mut Config, name: &str, script: &str) -> String {
    let path = format!("{SCRIPT_DIR}/{name}");
    v3::files(out).push(v3::file(&path, content::text_resource(script), 0o700));
    path
}

/// A `set -e` bash script running the `what` key's command lines in order.
fn script(what: &str, lines: &[String]) -> String {
    let mut s = format!(
        "#!/bin/bash\n# Generated by capk-bootstrap from the cloud-config `{what}` key.\nset -e\n"
    );
    for l in lines {
        s.push_str(l);
        if !l.ends_with('\n') {
            s.push('\n');
        }
    }
    s
}

// ---------------------------------------------------------------------------------------------
// users

#[derive(Deserialize, Default)]
struct CloudUser {
    name: String,
    #[serde(default)]
    passwd: Option<String>,
    #[serde(default)]
    gecos: Option<String>,
    #[serde(default)]
    groups: Value,
    #[serde(default)]
    homedir: Option<String>,
    #[serde(default)]
    lock_passwd: Option<bool>,
    #[serde(default)]
    shell: Option<String>,
    #[serde(default)]
    primary_group: Option<String>,
    #[serde(default)]
    sudo: Value,
    #[serde(default)]
    ssh_authorized_keys: Option<Vec<String>>,
}

/// `users` → `passwd.users`. `passwd` becomes the password hash, locked (`!` prefix) unless
/// `lock_passwd: false`, as cloud-init locks passwords by default. `groups` is a list or a
/// comma-separated string. `sudo` rules (string or list) go to [`SUDOERS_FILE`] (mode 0440).
/// The entry `default` (the distribution's default user) is accepted: Flatcar's `core` exists.
fn convert_users(value: Value, out: &mut Config) -> Result<(), ConvertError> {
    let at = KeyPath::from("users");
    let mut sudoers = String::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for (i, item) in sequence(value, &at)?.into_iter().enumerate() {
        let at = at.index(i);
        let Some(cu) = cloud_user(item, &at)? else {
            continue;
        };
        check_user_name(&cu.name, i, &mut seen, &at)?;
        let groups = scalar_list(
            &cu.groups,
            &at.field("groups"),
            split_comma_list,
            "a list or a comma-separated string",
        )?;
        for r in sudo_rules(&cu.sudo, &at.field("sudo"))? {
            sudoers.push_str(&format!("{} {}\n", cu.name, r.trim()));
        }
        v3::users(out).push(ignition_user(cu, groups));
    }
    if !sudoers.is_empty() {
        let text =
            format!("# Generated by capk-bootstrap from cloud-config `users[].sudo`.\n{sudoers}");
        v3::files(out).push(v3::file(SUDOERS_FILE, content::text_resource(&text), 0o440));
    }
    Ok(())
}

/// One `users` entry: a mapping, or a bare user name; `None` for the entry `default`.
fn cloud_user(item: Value, at: &KeyPath) -> Result<Option<CloudUser>, ConvertError> {
    match item {
        Value::String(s) if s == "default" => Ok(None),
        Value::String(name) => Ok(Some(CloudUser {
            name,
            ..CloudUser::default()
        })),
        other => typed(other, at).map(Some),
    }
}

/// A user name is not blank and not defined twice; `seen` maps names to their `users` index.
fn check_user_name(
    name: &str,
    i: usize,
    seen: &mut BTreeMap<String, usize>,
    at: &KeyPath,
) -> Result<(), ConvertError> {
    if name.trim().is_empty() {
        return Err(ConvertError::invalid(
            at.field("name"),
            "a user needs a name",
        ));
    }
    if let Some(prev) = seen.insert(name.to_owned(), i) {
        return Err(ConvertError::invalid(
            at.field("name"),
            format!("user `{name}` is already defined at users[{prev}]"),
        ));
    }
    Ok(())
}

/// The names in a comma-separated string, trimmed, without empty ones.
fn split_comma_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|g| !g.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A user's `sudo` rules: one rule string, a list of them, or none (absent or `false`).
fn sudo_rules(sudo: &Value, at: &KeyPath) -> Result<Vec<String>, ConvertError> {
    if let Value::Bool(false) = sudo {
        return Ok(Vec::new());
    }
    let rules = scalar_list(
        sudo,
        at,
        |s| vec![s.to_owned()],
        "a sudoers rule string or a list of them",
    )?;
    Ok(rules.unwrap_or_default())
}

/// The Ignition user for `cu`; its password hash is locked unless `lock_passwd: false`.
fn ignition_user(cu: CloudUser, groups: Option<Vec<String>>) -> User {
    let lock = cu.lock_passwd.unwrap_or(true);
    let mut user = User::new(cu.name);
    user.gecos = cu.gecos;
    user.groups = groups.filter(|g| !g.is_empty());
    user.home_dir = cu.homedir;
    user.shell = cu.shell;
    user.primary_group = cu.primary_group;
    user.password_hash = cu.passwd.map(|h| {
        if lock && !h.starts_with('!') {
            format!("!{h}")
        } else {
            h
        }
    });
    user.ssh_authorized_keys = cu.ssh_authorized_keys.filter(|k| !k.is_empty());
    user
}

// ---------------------------------------------------------------------------------------------
// ntp

#[derive(Deserialize)]
struct Ntp {
    #[serde(default)]
    enabled: Option<bool>,
    #[serde(default)]
    servers: Option<Vec<String>>,
    #[serde(default)]
    pools: Option<Vec<String>>,
}

/// `ntp` → systemd-timesyncd (Flatcar's NTP client): servers and pools in [`NTP_DROPIN`], and
/// the service enabled. `enabled: false` configures nothing, as cloud-init skips the module.
fn convert_ntp(value: Value, out: &mut Config) -> Result<(), ConvertError> {
    let ntp: Ntp = typed(value, &"ntp".into())?;
    if ntp.enabled == Some(false) {
        return Ok(());
    }
    let servers: Vec<String> = ntp
        .servers
        .into_iter()
        .flatten()
        .chain(ntp.pools.into_iter().flatten())
        .collect();
    if !servers.is_empty() {
        for s in &servers {
            if s.is_empty() || s.chars().any(char::is_whitespace) {
                return Err(ConvertError::invalid(
                    "ntp.servers",
                    format!("`{s}` is not a host name or address"),
                ));
            }
        }
        let text = format!(
            "# Generated by capk-bootstrap from the cloud-config `ntp` key.\n[Time]\nNTP={}\n",
            servers.join(" ")
        );
        v3::files(out).push(v3::file(NTP_DROPIN, content::text_resource(&text), 0o644));
    }
    v3::units(out).push(v3::unit("systemd-timesyncd.service", None, true));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// disk_setup / fs_setup / mounts

#[derive(Deserialize)]
struct DiskSetup {
    #[serde(default)]
    table_type: Option<String>,
    #[serde(default)]
    layout: Value,
    #[serde(default)]
    overwrite: Option<bool>,
}

/// GPT type GUIDs for the MBR type codes CABPK emits.
fn type_guid(code: &str) -> Option<&'static str> {
    Some(match code.to_ascii_lowercase().as_str() {
        "83" => "0FC63DAF-8483-4772-8E79-3D69D8477DE4",
        "82" => "0657FD6D-A4AB-43C4-84E5-0933C84B4F4F",
        "fd" => "A19D880F-05FC-4D3B-A006-743F0F84911E",
        "8e" => "E6D6D379-F507-44C2-A23C-238F2A3DF928",
        "0c" | "07" => "EBD0A0A2-B9E5-4433-87C0-68B6B72699C7",
        _ => return None,
    })
}

/// `disk_setup` → `storage.disks`. Ignition writes GPT only, so `table_type` must be `gpt` or
/// absent. `layout: true` (or a single 100% entry, optionally typed) becomes one partition over
/// the whole disk; several partitions need sizes in MiB, which percentages cannot give, so they
/// are an error. `overwrite` → `wipeTable`.
fn convert_disk_setup(
    setup: &BTreeMap<String, DiskSetup>,
    out: &mut Config,
) -> Result<(), ConvertError> {
    for (device, d) in setup {
        let at = KeyPath::from("disk_setup").field(device);
        if !device.starts_with("/dev/") {
            return Err(ConvertError::invalid(
                at,
                "give the disk as a /dev path (cloud-init aliases such as ephemeral0 do not exist here)",
            ));
        }
        match d.table_type.as_deref() {
            None | Some("gpt") => {}
            Some(other) => {
                return Err(ConvertError::invalid(
                    at.field("table_type"),
                    format!(
                        "`{other}`: Ignition writes GPT partition tables only; set tableType: gpt"
                    ),
                ));
            }
        }
        let partition = |type_code: Option<String>| -> Result<Partition, ConvertError> {
            let type_guid = match type_code {
                None => None,
                Some(c) => Some(
                    type_guid(&c)
                        .ok_or_else(|| {
                            ConvertError::invalid(
                                at.field("layout"),
                                format!(
                                    "unknown partition type `{c}` (known: 83, 82, fd, 8e, 0c, 07)"
                                ),
                            )
                        })?
                        .to_owned(),
                ),
            };
            Ok(Partition {
                number: Some(1),
                type_guid,
                ..Default::default()
            })
        };
        let partitions = match &d.layout {
            Value::Null | Value::Bool(false) => None,
            Value::Bool(true) => Some(vec![partition(None)?]),
            Value::Sequence(parts) if parts.len() == 1 => {
                let (pct, code) = match &parts[0] {
                    Value::Sequence(pair) if pair.len() == 2 => (
                        scalar(&pair[0], &at.field("layout").index(0))?,
                        Some(scalar(&pair[1], &at.field("layout").index(0))?),
                    ),
                    v => (scalar(v, &at.field("layout").index(0))?, None),
                };
                if pct != "100" {
                    return Err(ConvertError::invalid(
                        at.field("layout"),
                        format!(
                            "a {pct}% partition cannot be expressed in Ignition, which sizes partitions in MiB; use 100 or `true`"
                        ),
                    ));
                }
                Some(vec![partition(code)?])
            }
            Value::Sequence(_) => {
                return Err(ConvertError::invalid(
                    at.field("layout"),
                    "several partitions sized in percent cannot be expressed in Ignition (sizes are in MiB); use one partition",
                ));
            }
            other => {
                return Err(ConvertError::invalid(
                    at.field("layout"),
                    format!("expected true, false or a list, got {}", kind(other)),
                ));
            }
        };
        v3::disks(out).push(Disk {
            device: device.clone(),
            partitions,
            wipe_table: d.overwrite,
        });
    }
    Ok(())
}

#[derive(Deserialize)]
struct FsSetup {
    #[serde(default)]
    label: Option<String>,
    #[serde(default)]
    filesystem: Option<String>,
    device: String,
    #[serde(default)]
    partition: Value,
    #[serde(default)]
    overwrite: Option<bool>,
    #[serde(default)]
    extra_opts: Value,
}

/// The block device a disk's partition `n` appears as.
fn partition_device(disk: &str, n: &str) -> String {
    if disk.starts_with("/dev/disk/") {
        format!("{disk}-part{n}")
    } else if disk.ends_with(|c: char| c.is_ascii_digit()) {
        format!("{disk}p{n}")
    } else {
        format!("{disk}{n}")
    }
}

/// `fs_setup` → `storage.filesystems` (format, label, `extra_opts` → options, `overwrite` →
/// `wipeFilesystem`). `partition` picks the partition of `device`: a number, `none` (the whole
/// device), or `auto`/`any` (partition 1 when `disk_setup` partitions that device, else the
/// whole device). Returns the devices by label, for `mounts`.
fn convert_fs_setup(
    value: Value,
    disk_setup: &BTreeMap<String, DiskSetup>,
    out: &mut Config,
) -> Result<BTreeMap<String, String>, ConvertError> {
    let at = KeyPath::from("fs_setup");
    let mut by_label = BTreeMap::new();
    for (i, item) in sequence(value, &at)?.into_iter().enumerate() {
        let at = at.index(i);
        let fs: FsSetup = typed(item, &at)?;
        let format = fs.filesystem.clone().ok_or_else(|| {
            ConvertError::invalid(
                at.field("filesystem"),
                "missing; give ext4, xfs, btrfs, vfat or swap",
            )
        })?;
        if !["ext4", "xfs", "btrfs", "vfat", "swap"].contains(&format.as_str()) {
            return Err(ConvertError::invalid(
                at.field("filesystem"),
                format!(
                    "`{format}` cannot be created by Ignition; use ext4, xfs, btrfs, vfat or swap"
                ),
            ));
        }
        if !fs.device.starts_with("/dev/") {
            return Err(ConvertError::invalid(
                at.field("device"),
                "give the device as a /dev path (cloud-init aliases such as ephemeral0 do not exist here)",
            ));
        }
        let partitioned = disk_setup
            .get(&fs.device)
            .is_some_and(|d| matches!(d.layout, Value::Bool(true) | Value::Sequence(_)));
        let device = match &fs.partition {
            Value::Null => fs.device.clone(),
            Value::String(s) if s == "none" => fs.device.clone(),
            Value::String(s) if s == "auto" || s == "any" => {
                if partitioned {
                    partition_device(&fs.device, "1")
                } else {
                    fs.device.clone()
                }
            }
            v => {
                let n = scalar(v, &at.field("partition"))?;
                if n.is_empty() || !n.chars().all(|c| c.is_ascii_digit()) {
                    return Err(ConvertError::invalid(
                        at.field("partition"),
                        format!("`{n}`: expected a partition number, auto, any or none"),
                    ));
                }
                partition_device(&fs.device, &n)
            }
        };
        let options = scalar_list(
            &fs.extra_opts,
            &at.field("extra_opts"),
            |s| s.split_whitespace().map(str::to_owned).collect(),
            "a list of mkfs options",
        )?;
        if let Some(label) = &fs.label {
            by_label.insert(label.clone(), device.clone());
        }
        v3::filesystems(out).push(Filesystem {
            device,
            format: Some(format),
            label: fs.label,
            mount_options: None,
            options,
            path: None,
            uuid: None,
            wipe_filesystem: fs.overwrite,
        });
    }
    Ok(by_label)
}

/// `mounts` → one systemd `.mount` unit per entry `[what, where, type, options, dump, pass]`.
/// `what` may be `LABEL=`, `UUID=`, `PARTUUID=`, a /dev path, a bare device name (`vdb` →
/// `/dev/vdb`), or — as CABPK's own Ignition output reads it — the label of an `fs_setup` entry.
/// Missing options default to `defaults,nofail` (cloud-init's defaults without its own unit);
/// dump and pass are fstab fields without effect on mount units. Swap entries are not supported.
fn convert_mounts(
    value: Value,
    fs_labels: &BTreeMap<String, String>,
    out: &mut Config,
) -> Result<(), ConvertError> {
    let at = KeyPath::from("mounts");
    for (i, item) in sequence(value, &at)?.into_iter().enumerate() {
        let at = at.index(i);
        let fields = sequence(item, &at)?;
        let field = |j: usize| -> Result<Option<String>, ConvertError> {
            match fields.get(j) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => scalar(v, &at.index(j)).map(Some),
            }
        };
        let (Some(what), Some(where_)) = (field(0)?, field(1)?) else {
            return Err(ConvertError::invalid(
                at,
                "a mount needs at least a device and a mount point",
            ));
        };
        let device = if let Some(l) = what.strip_prefix("LABEL=") {
            format!("/dev/disk/by-label/{l}")
        } else if let Some(u) = what.strip_prefix("UUID=") {
            format!("/dev/disk/by-uuid/{u}")
        } else if let Some(u) = what.strip_prefix("PARTUUID=") {
            format!("/dev/disk/by-partuuid/{u}")
        } else if what.starts_with('/') {
            what.clone()
        } else if let Some(dev) = fs_labels.get(&what) {
            dev.clone()
        } else if what == "swap" || what.starts_with("ephemeral") {
            return Err(ConvertError::invalid(
                at.index(0),
                format!(
                    "`{what}` is a cloud-init device alias that does not exist here; give a /dev path or LABEL="
                ),
            ));
        } else {
            format!("/dev/{what}")
        };
        if where_ == "none" || where_ == "swap" {
            return Err(ConvertError::invalid(
                at.index(1),
                "swap entries are not supported; give a mount point",
            ));
        }
        let Some(unit_name) = normalize_path(&where_).and_then(|p| mount_unit_name(&p)) else {
            return Err(ConvertError::invalid(
                at.index(1),
                format!("`{where_}` is not an absolute mount point"),
            ));
        };
        let fs_type = field(2)?.filter(|t| t != "auto");
        let options = field(3)?.unwrap_or_else(|| "defaults,nofail".to_owned());
        let wanted_by = if options.split(',').any(|o| o == "_netdev") {
            "remote-fs.target"
        } else {
            "local-fs.target"
        };
        let contents = MountUnit {
            description: &format!("cloud-config mount of {what}"),
            what: &device,
            where_: &normalize_path(&where_).unwrap_or(where_.clone()),
            fs_type: fs_type.as_deref(),
            options: Some(&options),
            wanted_by,
        }
        .contents();
        v3::units(out).push(v3::unit(&unit_name, Some(contents), true));
    }
    Ok(())
}
