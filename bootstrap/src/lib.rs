//! Converts Cluster API bootstrap data (CABPK `cloud-config` or Ignition 2.3) into the Ignition v3
//! config a Flatcar guest boots from. Pure functions over bytes and values; no Kubernetes client.
//!
//! ```text
//! bootstrap Secret {format, value} ──convert──▶ ignition_v3::Config ──MachineOverlay::apply──▶
//!     per-machine config ──to_json──▶ bytes for the Ignition Secret / fw_cfg
//! ```
//!
//! [`render_ignition`] does all three; it is what `capk-controller render-ignition` prints.
//!
//! The output spec is [`OUTPUT_SPEC_VERSION`] (3.4.0): Flatcar's Ignition reads 3.x up to 3.5,
//! and 3.4 is the newest spec that every supported input maps onto. Types come from the
//! `ignition-config` crate (coreos/ignition-config-rs, generated from upstream's schemas), so
//! the output cannot drift from the spec; spec 2.3 has no Rust crate and is typed here.
//!
//! # cloud-config
//!
//! Supported keys (all that CABPK v1.14 emits), each documented on its converter:
//!
//! | key | becomes |
//! | --- | --- |
//! | `write_files` | `storage.files`; encodings `text/plain`, `b64`, `base64`, `gz`, `gzip`, `gz+b64`, `gz+base64`, `gzip+b64`, `gzip+base64`; `owner`, `permissions` (quoted octal), `append`; `/run`, `/var/run`, `/tmp` paths staged and copied by [`STAGE_UNIT`] |
//! | `bootcmd` | [`BOOTCMD_UNIT`], every boot, `set -e` |
//! | `runcmd` | [`RUNCMD_UNIT`], once per instance, after network-online and containerd, `set -e`, output to the journal only (`kubeadm init` prints the join token; the console is the Pod's log) |
//! | `users` | `passwd.users` (`name`, `passwd`, `lock_passwd`, `gecos`, `groups`, `homedir`, `shell`, `primary_group`, `ssh_authorized_keys`), `sudo` → `/etc/sudoers.d/90-cloud-init-users`; the entry `default` is accepted |
//! | `ntp` | systemd-timesyncd drop-in (`enabled`, `servers`, `pools`) |
//! | `disk_setup` | `storage.disks` (GPT; `layout: true` or one 100% partition; `overwrite` → `wipeTable`) |
//! | `fs_setup` | `storage.filesystems` (ext4, xfs, btrfs, vfat, swap; `label`, `partition`, `overwrite`, `extra_opts`) |
//! | `mounts` | one `.mount` unit per entry |
//!
//! Rejected with an error naming the key: every other top-level key (`packages`, `hostname`,
//! `apt`, `ssh_pwauth`, `power_state`, …), unknown keys inside supported ones (for example
//! `write_files[].defer`, `users[].inactive`, `users[].system`, `ntp.ntp_client`,
//! `fs_setup[].replace_fs`, `fs_setup[].cmd`), `table_type: mbr`, percentage layouts other than
//! one 100% partition, swap mounts, cloud-init device aliases (`ephemeral0`, `swap`), YAML
//! `!!binary` values (use `encoding: b64`), unquoted numeric `permissions`, and any
//! Jinja other than the hostname and instance-id placeholders.
//!
//! Where the result knowingly differs from cloud-init on a cloud image:
//!
//! - `runcmd` runs with `set -e`: a failing command stops the ones after it (cloud-init goes on).
//!   The success file is still written only when kubeadm and everything before it succeeded.
//! - `bootcmd` sees the files already written (Ignition writes before boot; cloud-init runs
//!   `bootcmd` before `write_files`).
//! - `users[].groups` must exist in the image; cloud-init would create missing groups.
//! - A disk without `table_type` gets GPT (cloud-init's default is MBR, which Ignition cannot
//!   write).
//! - `fs_setup` without `overwrite` on a disk holding a different filesystem fails Ignition (and
//!   the boot); cloud-init would leave the disk alone.
//! - `mounts` without options use `defaults,nofail`.
#![forbid(unsafe_code)]

mod cloud_config;
pub mod content;
mod error;
pub mod heartbeat;
mod ignition;
mod jinja;
pub mod overlay;
pub mod systemd;
mod v3;

use std::fmt;
use std::str::FromStr;

pub use cloud_config::{
    BOOTCMD_UNIT, RUN_STAGING_DIR, RUNCMD_UNIT, STAGE_UNIT, SUCCESS_FILE, SUCCESS_FILE_PERSISTENT,
    SUPPORTED_KEYS as SUPPORTED_CLOUD_CONFIG_KEYS,
};
pub use error::{ConvertError, KeyPath};
/// The Ignition v3 types of the output spec.
pub use ignition_config::v3_4 as ignition_v3;
pub use overlay::{MachineOverlay, MergeReport};

/// The Ignition spec version of every config this crate emits.
pub const OUTPUT_SPEC_VERSION: &str = "3.4.0";

/// Largest bootstrap data accepted: a Secret holds at most 1 MiB.
pub const MAX_INPUT_BYTES: usize = 1024 * 1024;

/// Largest Ignition config emitted. It is stored in a Secret (1 MiB, less room for its other
/// keys) and read by the guest over fw_cfg, which is slow for large files.
pub const MAX_OUTPUT_BYTES: usize = 960 * 1024;

/// The `format` key of a CABPK bootstrap Secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootstrapFormat {
    /// `cloud-config` (CABPK's default, also when the key is absent).
    CloudConfig,
    /// `ignition` (Ignition spec 2.3 from CABPK; 3.x is accepted too).
    Ignition,
}

impl BootstrapFormat {
    /// Reads the Secret's `format` value; absent means `cloud-config`, as in CAPI.
    pub fn from_secret(format: Option<&str>) -> Result<Self, ConvertError> {
        format.map_or(Ok(Self::CloudConfig), str::parse)
    }

    /// The value as written in the Secret.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CloudConfig => "cloud-config",
            Self::Ignition => "ignition",
        }
    }
}

impl FromStr for BootstrapFormat {
    type Err = ConvertError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "cloud-config" | "" => Ok(Self::CloudConfig),
            "ignition" => Ok(Self::Ignition),
            other => Err(ConvertError::UnknownFormat(other.to_owned())),
        }
    }
}

impl fmt::Display for BootstrapFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The machine values substituted for cloud-init's Jinja placeholders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineFacts {
    /// The node name (`{{ ds.meta_data.local_hostname }}` and friends).
    pub hostname: String,
    /// The instance id (`{{ v1.instance_id }}`); the providerID's last part is a good choice.
    pub instance_id: String,
}

impl MachineFacts {
    /// Facts whose instance id equals the hostname.
    pub fn new(hostname: impl Into<String>) -> Self {
        let hostname = hostname.into();
        Self {
            instance_id: hostname.clone(),
            hostname,
        }
    }

    fn check(&self) -> Result<(), ConvertError> {
        overlay::check_hostname(&self.hostname)?;
        let ok = !self.instance_id.is_empty()
            && self.instance_id.len() <= 253
            && self
                .instance_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:/".contains(&b));
        if !ok {
            return Err(ConvertError::InvalidFacts {
                field: "instance id",
                value: self.instance_id.clone(),
                reason: "must be 1 to 253 letters, digits, '-', '_', '.', ':' or '/'".to_owned(),
            });
        }
        Ok(())
    }
}

/// Converts bootstrap data into an Ignition v3 config (without the per-machine overlay).
pub fn convert(
    format: BootstrapFormat,
    data: &[u8],
    facts: &MachineFacts,
) -> Result<ignition_v3::Config, ConvertError> {
    if data.len() > MAX_INPUT_BYTES {
        return Err(ConvertError::InputTooLarge {
            size: data.len(),
            limit: MAX_INPUT_BYTES,
        });
    }
    facts.check()?;
    let text = std::str::from_utf8(data).map_err(|e| ConvertError::NotUtf8 {
        offset: e.valid_up_to(),
    })?;
    let config = match format {
        BootstrapFormat::CloudConfig => cloud_config::convert(text, facts)?,
        BootstrapFormat::Ignition => ignition::convert(text)?,
    };
    check_duplicates(&config)?;
    Ok(config)
}

/// Ignition 3 refuses a config that defines a path, unit, filesystem, disk or user twice; say
/// which one here rather than at boot.
fn check_duplicates(config: &ignition_v3::Config) -> Result<(), ConvertError> {
    fn check<'a>(
        what: &str,
        field: &str,
        lists: &[(&str, Vec<&'a str>)],
    ) -> Result<(), ConvertError> {
        let mut seen: std::collections::BTreeMap<&'a str, String> = Default::default();
        for (list, names) in lists {
            for (i, name) in names.iter().enumerate() {
                let at = format!("{list}[{i}].{field}");
                if let Some(prev) = seen.insert(name, at.clone()) {
                    return Err(ConvertError::InvalidValue {
                        key: at.into(),
                        reason: format!(
                            "`{name}` is also defined at `{prev}`; Ignition 3 allows one entry per {what}"
                        ),
                    });
                }
            }
        }
        Ok(())
    }
    fn names<T>(list: &Option<Vec<T>>, key: impl Fn(&T) -> &str) -> Vec<&str> {
        list.iter().flatten().map(key).collect()
    }
    if let Some(s) = &config.storage {
        check(
            "path",
            "path",
            &[
                ("storage.files", names(&s.files, |f| &f.path)),
                ("storage.directories", names(&s.directories, |d| &d.path)),
                ("storage.links", names(&s.links, |l| &l.path)),
            ],
        )?;
        check(
            "device",
            "device",
            &[("storage.filesystems", names(&s.filesystems, |f| &f.device))],
        )?;
        check(
            "disk",
            "device",
            &[("storage.disks", names(&s.disks, |d| &d.device))],
        )?;
    }
    if let Some(sd) = &config.systemd {
        check(
            "unit",
            "name",
            &[("systemd.units", names(&sd.units, |u| &u.name))],
        )?;
    }
    if let Some(p) = &config.passwd {
        check(
            "user",
            "name",
            &[("passwd.users", names(&p.users, |u| &u.name))],
        )?;
        check(
            "group",
            "name",
            &[("passwd.groups", names(&p.groups, |g| &g.name))],
        )?;
    }
    Ok(())
}

/// Serialises a config as compact JSON without `null` fields, enforcing [`MAX_OUTPUT_BYTES`].
pub fn to_json(config: &ignition_v3::Config) -> Result<Vec<u8>, ConvertError> {
    let bytes = serde_json::to_vec(&without_nulls(config)).expect("a JSON value always serialises");
    if bytes.len() > MAX_OUTPUT_BYTES {
        return Err(ConvertError::OutputTooLarge {
            size: bytes.len(),
            limit: MAX_OUTPUT_BYTES,
        });
    }
    Ok(bytes)
}

/// Like [`to_json`], indented for people (`render-ignition`). The size limit applies to the
/// compact form, which is what is stored.
pub fn to_json_pretty(config: &ignition_v3::Config) -> Result<String, ConvertError> {
    to_json(config)?;
    Ok(serde_json::to_string_pretty(&without_nulls(config))
        .expect("a JSON value always serialises"))
}

fn without_nulls(config: &ignition_v3::Config) -> serde_json::Value {
    fn strip(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(map) => {
                map.retain(|_, v| !v.is_null());
                map.values_mut().for_each(strip);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let mut v = serde_json::to_value(config).expect("Ignition types always serialise");
    strip(&mut v);
    v
}

/// The result of [`render_ignition`].
#[derive(Debug, Clone)]
pub struct Rendered {
    /// The config as compact JSON.
    pub json: Vec<u8>,
    /// The config itself.
    pub config: ignition_v3::Config,
    /// Bootstrap entries the machine overlay replaced.
    pub merge: MergeReport,
}

/// Bootstrap data in, the Ignition the controller stores out: [`convert`], then the overlay
/// (when given), then [`to_json`].
pub fn render_ignition(
    format: BootstrapFormat,
    data: &[u8],
    facts: &MachineFacts,
    overlay: Option<&MachineOverlay>,
) -> Result<Rendered, ConvertError> {
    let mut config = convert(format, data, facts)?;
    let merge = match overlay {
        Some(o) => o.apply(&mut config)?,
        None => MergeReport::default(),
    };
    let json = to_json(&config)?;
    Ok(Rendered {
        json,
        config,
        merge,
    })
}
