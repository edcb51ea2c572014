//! The per-machine Ignition fragment (hostname, DNS, NTP, iSCSI name, disks, host volumes,
//! heartbeat) and how it is merged into the config converted from the bootstrap data.
//!
//! # Conflict rule
//!
//! The machine's facts win. When the bootstrap data and the overlay define the same thing, the
//! bootstrap entry is removed and the overlay's is kept:
//!
//! - files, directories and links: the same path (whatever kind of node the bootstrap put there);
//! - systemd units: the same unit name (the whole unit, with its drop-ins);
//! - filesystems and disks: the same device.
//!
//! Everything else is kept from both, bootstrap entries first. Every removed entry is listed in
//! the returned [`MergeReport`] so the caller can log it or raise an Event. NTP is the exception
//! that needs no removal: the overlay's timesyncd drop-in sorts after the one converted from
//! cloud-config and resets the server list, so the machine's servers replace the bootstrap's.

use std::net::IpAddr;

use ignition_config::v3_4::{Config, Filesystem};

use crate::cloud_config::{SUCCESS_FILE, SUCCESS_FILE_PERSISTENT};
use crate::error::ConvertError;
use crate::heartbeat::HEARTBEAT_PREFIX;
use crate::systemd::{MountUnit, mount_unit_name, shell_quote};
use crate::{content, v3};

/// Where the etcd disk is mounted.
pub const ETCD_MOUNT_PATH: &str = "/var/lib/etcd";
/// The etcd filesystem's label; Ignition reuses an existing filesystem only if it matches.
pub const ETCD_LABEL: &str = "capk-etcd";
/// Empties a freshly formatted etcd disk for kubeadm: mkfs.ext4 leaves `lost+found`, and `kubeadm
/// init`/`join` refuse a non-empty etcd data directory (preflight `DirAvailable--var-lib-etcd`).
/// `rmdir` removes only an empty directory, so nothing fsck recovered is ever lost.
pub const ETCD_DISK_EMPTY_UNIT: &str = "capk-etcd-disk-empty.service";
/// The bootstrap units that run kubeadm: CABPK Ignition's and capk-bootstrap's runcmd.
const KUBEADM_UNITS: &str = "kubeadm.service capk-runcmd.service";
/// The overlay's timesyncd drop-in (sorts after the cloud-config one).
pub const NTP_DROPIN: &str = "/etc/systemd/timesyncd.conf.d/60-capk-machine.conf";
/// The overlay's resolved drop-in.
pub const DNS_DROPIN: &str = "/etc/systemd/resolved.conf.d/60-capk-machine.conf";
/// The open-iscsi initiator name file.
pub const ISCSI_INITIATOR_FILE: &str = "/etc/iscsi/initiatorname.iscsi";
/// Environment file with the machine's facts, for Ignition-format templates: the Flatcar CAPI
/// templates read `/run/metadata/flatcar` (coreos-metadata) through `EnvironmentFile=` and
/// `envsubst`, which has no qemu provider; this file is the KVM equivalent
/// (`CAPK_HOSTNAME=…`).
pub const METADATA_ENV_FILE: &str = "/etc/capk/metadata.env";
/// The heartbeat unit.
pub const HEARTBEAT_UNIT: &str = "capk-heartbeat.service";
/// The heartbeat script.
pub const HEARTBEAT_SCRIPT: &str = "/etc/capk/heartbeat.sh";

/// A filesystem format the overlay can create.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsFormat {
    Ext4,
    Xfs,
}

impl FsFormat {
    fn as_str(self) -> &'static str {
        match self {
            FsFormat::Ext4 => "ext4",
            FsFormat::Xfs => "xfs",
        }
    }
}

/// DNS servers and search domains for systemd-resolved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dns {
    pub servers: Vec<IpAddr>,
    pub search: Vec<String>,
}

/// A virtio-blk data disk (containerd, kubelet) the guest sees as
/// `/dev/disk/by-id/virtio-<serial>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataDisk {
    /// The virtio-blk serial QEMU gives the disk (at most 20 bytes).
    pub serial: String,
    pub format: FsFormat,
    /// Where the filesystem is mounted in the guest.
    pub mount_path: String,
    /// Filesystem label (ext4: up to 16 bytes, xfs: up to 12).
    pub label: Option<String>,
    /// Make a fresh filesystem even if one exists (the disk is scratch space).
    pub wipe: bool,
}

/// The etcd disk: mounted on [`ETCD_MOUNT_PATH`] and formatted only when it holds no
/// filesystem (`wipeFilesystem: false`), so etcd's data survives a re-provisioned VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdDisk {
    pub serial: String,
    pub format: FsFormat,
}

/// A host directory shared over virtio-9p under `tag`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostVolume {
    /// The 9p mount tag QEMU exports.
    pub tag: String,
    /// Guest mount point; `None` means `/data/<tag>` (the legacy kvm-operator layout).
    pub mount_path: Option<String>,
    pub read_only: bool,
}

/// The heartbeat the guest writes to the launcher over a virtio-serial port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heartbeat {
    /// The virtio-serial port name; the guest sees `/dev/virtio-ports/<name>`.
    pub port_name: String,
    /// Seconds between two lines.
    pub interval_seconds: u32,
}

/// Per-machine facts, turned into an Ignition fragment by [`MachineOverlay::fragment`] and
/// merged by [`MachineOverlay::apply`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MachineOverlay {
    pub hostname: String,
    pub dns: Option<Dns>,
    pub ntp_servers: Vec<String>,
    pub iscsi_initiator_name: Option<String>,
    pub data_disks: Vec<DataDisk>,
    pub etcd_disk: Option<EtcdDisk>,
    pub host_volumes: Vec<HostVolume>,
    pub heartbeat: Option<Heartbeat>,
}

/// What [`MachineOverlay::apply`] replaced in the bootstrap config.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MergeReport {
    pub replaced: Vec<Replaced>,
}

/// One bootstrap entry the overlay replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replaced {
    /// `file`, `directory`, `link`, `unit`, `filesystem` or `disk`.
    pub kind: &'static str,
    /// Its path, unit name or device.
    pub name: String,
}

fn invalid(field: &'static str, value: &str, reason: impl Into<String>) -> ConvertError {
    ConvertError::InvalidFacts {
        field,
        value: value.to_owned(),
        reason: reason.into(),
    }
}

/// A host name the kernel accepts: dot-separated RFC 1123 labels, at most 64 bytes.
pub(crate) fn check_hostname(h: &str) -> Result<(), ConvertError> {
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if h.is_empty() || h.len() > 64 || !h.split('.').all(label_ok) {
        return Err(invalid(
            "hostname",
            h,
            "must be RFC 1123 labels of letters, digits and '-', at most 64 bytes",
        ));
    }
    Ok(())
}

fn check_token(field: &'static str, v: &str, max: usize) -> Result<(), ConvertError> {
    if v.is_empty()
        || v.len() > max
        || !v
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(invalid(
            field,
            v,
            format!("must be 1 to {max} letters, digits, '-', '_' or '.'"),
        ));
    }
    Ok(())
}

fn check_path(field: &'static str, p: &str) -> Result<String, ConvertError> {
    mount_unit_name(p)
        .filter(|n| n != "-.mount")
        .ok_or_else(|| {
            invalid(
                field,
                p,
                "must be an absolute path other than /, without . or ..",
            )
        })
}

impl MachineOverlay {
    /// The Ignition fragment for these facts (validated first).
    pub fn fragment(&self) -> Result<Config, ConvertError> {
        let mut out = v3::empty_config();
        add_hostname(&mut out, &self.hostname)?;
        if let Some(dns) = &self.dns {
            add_dns(&mut out, dns)?;
        }
        add_ntp_servers(&mut out, &self.ntp_servers)?;
        if let Some(name) = &self.iscsi_initiator_name {
            add_iscsi_initiator_name(&mut out, name)?;
        }
        for d in &self.data_disks {
            add_disk(
                &mut out,
                &d.serial,
                d.format,
                &d.mount_path,
                d.label.as_deref(),
                d.wipe,
            )?;
        }
        if let Some(e) = &self.etcd_disk {
            add_etcd_disk(&mut out, e)?;
        }
        for v in &self.host_volumes {
            add_host_volume(&mut out, v)?;
        }
        if let Some(h) = &self.heartbeat {
            add_heartbeat(&mut out, h)?;
        }
        Ok(out)
    }

    /// Builds the fragment and merges it into `base` by the module's conflict rule.
    pub fn apply(&self, base: &mut Config) -> Result<MergeReport, ConvertError> {
        let fragment = self.fragment()?;
        Ok(merge(base, fragment))
    }
}

/// Adds a root-owned text file at `path`.
fn add_text_file(out: &mut Config, path: &str, text: &str, mode: i64) {
    v3::files(out).push(v3::file(path, content::text_resource(text), mode));
}

/// `/etc/hostname` and the [`METADATA_ENV_FILE`] that carries the host name to templates.
fn add_hostname(out: &mut Config, hostname: &str) -> Result<(), ConvertError> {
    check_hostname(hostname)?;
    add_text_file(out, "/etc/hostname", &format!("{hostname}\n"), 0o644);
    add_text_file(
        out,
        METADATA_ENV_FILE,
        &format!("CAPK_HOSTNAME={hostname}\n"),
        0o644,
    );
    Ok(())
}

/// The resolved drop-in [`DNS_DROPIN`].
fn add_dns(out: &mut Config, dns: &Dns) -> Result<(), ConvertError> {
    for d in &dns.search {
        check_token("DNS search domain", d, 253)?;
    }
    let mut text = String::from("# Generated by capk-bootstrap: the machine's DNS.\n[Resolve]\n");
    if !dns.servers.is_empty() {
        let servers: Vec<String> = dns.servers.iter().map(IpAddr::to_string).collect();
        text.push_str(&format!("DNS={}\n", servers.join(" ")));
    }
    if !dns.search.is_empty() {
        text.push_str(&format!("Domains={}\n", dns.search.join(" ")));
    }
    add_text_file(out, DNS_DROPIN, &text, 0o644);
    Ok(())
}

/// The timesyncd drop-in [`NTP_DROPIN`] and an enabled timesyncd, unless `servers` is empty.
fn add_ntp_servers(out: &mut Config, servers: &[String]) -> Result<(), ConvertError> {
    if servers.is_empty() {
        return Ok(());
    }
    for s in servers {
        check_token("NTP server", s, 253)?;
    }
    // The empty assignment resets servers set by earlier drop-ins (cloud-config's).
    let text = format!(
        "# Generated by capk-bootstrap: the machine's NTP servers.\n[Time]\nNTP=\nNTP={}\n",
        servers.join(" ")
    );
    add_text_file(out, NTP_DROPIN, &text, 0o644);
    v3::units(out).push(v3::unit("systemd-timesyncd.service", None, true));
    Ok(())
}

/// The open-iscsi initiator name file [`ISCSI_INITIATOR_FILE`].
fn add_iscsi_initiator_name(out: &mut Config, name: &str) -> Result<(), ConvertError> {
    let ok = (name.starts_with("iqn.") || name.starts_with("eui."))
        && name.len() <= 223
        && name.bytes().all(|b| b.is_ascii_graphic());
    if !ok {
        return Err(invalid(
            "iSCSI initiator name",
            name,
            "must start with iqn. or eui., have no spaces and be at most 223 bytes",
        ));
    }
    add_text_file(
        out,
        ISCSI_INITIATOR_FILE,
        &format!("InitiatorName={name}\n"),
        0o644,
    );
    Ok(())
}

/// A filesystem on the virtio-blk disk `serial` and the mount unit for `mount_path`.
fn add_disk(
    out: &mut Config,
    serial: &str,
    format: FsFormat,
    mount_path: &str,
    label: Option<&str>,
    wipe: bool,
) -> Result<(), ConvertError> {
    check_token("disk serial", serial, 20)?;
    let unit_name = check_path("disk mount path", mount_path)?;
    if let Some(l) = label {
        let max = match format {
            FsFormat::Ext4 => 16,
            FsFormat::Xfs => 12,
        };
        check_token("filesystem label", l, max)?;
    }
    let device = format!("/dev/disk/by-id/virtio-{serial}");
    v3::filesystems(out).push(Filesystem {
        device: device.clone(),
        format: Some(format.as_str().to_owned()),
        label: label.map(str::to_owned),
        mount_options: None,
        options: None,
        path: None,
        uuid: None,
        wipe_filesystem: Some(wipe),
    });
    let contents = MountUnit {
        description: &format!("Disk {serial}"),
        what: &device,
        where_: mount_path,
        fs_type: Some(format.as_str()),
        options: None,
        wanted_by: "local-fs.target",
    }
    .contents();
    v3::units(out).push(v3::unit(&unit_name, Some(contents), true));
    Ok(())
}

/// The etcd disk on [`ETCD_MOUNT_PATH`] and [`ETCD_DISK_EMPTY_UNIT`], which empties it for kubeadm.
fn add_etcd_disk(out: &mut Config, e: &EtcdDisk) -> Result<(), ConvertError> {
    add_disk(
        out,
        &e.serial,
        e.format,
        ETCD_MOUNT_PATH,
        Some(ETCD_LABEL),
        false,
    )?;
    let mount = mount_unit_name(ETCD_MOUNT_PATH).expect("a valid constant path");
    let unit = format!(
        "[Unit]\n\
         Description=Empty the new etcd disk for kubeadm (mkfs's lost+found)\n\
         Requires={mount}\n\
         After={mount}\n\
         Before={KUBEADM_UNITS}\n\
         ConditionPathExists={ETCD_MOUNT_PATH}/lost+found\n\n\
         [Service]\n\
         Type=oneshot\n\
         ExecStart=/usr/bin/rmdir {ETCD_MOUNT_PATH}/lost+found\n\n\
         [Install]\n\
         WantedBy=multi-user.target\n"
    );
    v3::units(out).push(v3::unit(ETCD_DISK_EMPTY_UNIT, Some(unit), true));
    Ok(())
}

/// The 9p mount unit for one host volume.
fn add_host_volume(out: &mut Config, v: &HostVolume) -> Result<(), ConvertError> {
    capk_api::mount_tag::check(&v.tag).map_err(|_| {
        invalid(
            "9p mount tag",
            &v.tag,
            format!("must be {}", capk_api::mount_tag::RULE),
        )
    })?;
    let path = v
        .mount_path
        .clone()
        .unwrap_or_else(|| format!("/data/{}", v.tag));
    let unit_name = check_path("host volume mount path", &path)?;
    let options = if v.read_only {
        "trans=virtio,version=9p2000.L,ro"
    } else {
        "trans=virtio,version=9p2000.L"
    };
    let contents = MountUnit {
        description: &format!("Host volume {} (virtio-9p)", v.tag),
        what: &v.tag,
        where_: &path,
        fs_type: Some("9p"),
        options: Some(options),
        wanted_by: "local-fs.target",
    }
    .contents();
    v3::units(out).push(v3::unit(&unit_name, Some(contents), true));
    Ok(())
}

/// The heartbeat script [`HEARTBEAT_SCRIPT`] and its unit [`HEARTBEAT_UNIT`].
fn add_heartbeat(out: &mut Config, h: &Heartbeat) -> Result<(), ConvertError> {
    check_token("heartbeat port name", &h.port_name, 127)?;
    if h.interval_seconds == 0 {
        return Err(invalid(
            "heartbeat interval",
            "0",
            "must be at least one second",
        ));
    }
    add_text_file(out, HEARTBEAT_SCRIPT, &heartbeat_script(h), 0o755);
    let unit = format!(
        "[Unit]\n\
         Description=Heartbeat to capk-launcher over virtio-serial port {name}\n\n\
         [Service]\n\
         ExecStart=/bin/bash {HEARTBEAT_SCRIPT}\n\
         Restart=always\n\
         RestartSec=5\n\n\
         [Install]\n\
         WantedBy=multi-user.target\n",
        name = h.port_name
    );
    v3::units(out).push(v3::unit(HEARTBEAT_UNIT, Some(unit), true));
    Ok(())
}

/// The shell loop that writes one heartbeat line to the virtio-serial port.
fn heartbeat_script(h: &Heartbeat) -> String {
    let port = format!("/dev/virtio-ports/{}", h.port_name);
    format!(
        "#!/bin/bash\n\
         # Generated by capk-bootstrap: reports liveness and the Cluster API bootstrap state to\n\
         # capk-launcher over a virtio-serial port, one line every {interval} s (every second\n\
         # while the bootstrap is pending, so its success is reported within a second).\n\
         port={port}\n\
         while [ ! -e \"$port\" ]; do sleep 1; done\n\
         exec 3>\"$port\"\n\
         while :; do\n\
         \x20 state=pending\n\
         \x20 if [ -e {SUCCESS_FILE} ] || [ -e {SUCCESS_FILE_PERSISTENT} ]; then state=done; fi\n\
         \x20 read -r up _ </proc/uptime\n\
         \x20 printf '{HEARTBEAT_PREFIX} bootstrap=%s uptime=%s\\n' \"$state\" \"$up\" >&3\n\
         \x20 if [ \"$state\" = pending ]; then sleep 1; else sleep {interval}; fi\n\
         done\n",
        port = shell_quote(&port),
        interval = h.interval_seconds,
    )
}

/// Merges `overlay` into `base`; the overlay wins conflicts (see the module documentation).
pub fn merge(base: &mut Config, overlay: Config) -> MergeReport {
    let mut report = MergeReport::default();
    let Config {
        storage, systemd, ..
    } = overlay;

    if let Some(s) = storage {
        // Files, directories and links share one namespace: a path holds one node.
        let paths: Vec<String> = s
            .files
            .iter()
            .flatten()
            .map(|f| f.path.clone())
            .chain(s.directories.iter().flatten().map(|d| d.path.clone()))
            .chain(s.links.iter().flatten().map(|l| l.path.clone()))
            .collect();
        let bs = v3::storage(base);
        replace(
            &mut bs.files,
            s.files,
            &paths,
            |f| &f.path,
            "file",
            &mut report,
        );
        replace(
            &mut bs.directories,
            s.directories,
            &paths,
            |d| &d.path,
            "directory",
            &mut report,
        );
        replace(
            &mut bs.links,
            s.links,
            &paths,
            |l| &l.path,
            "link",
            &mut report,
        );
        let devices: Vec<String> = s
            .filesystems
            .iter()
            .flatten()
            .map(|f| f.device.clone())
            .collect();
        replace(
            &mut bs.filesystems,
            s.filesystems,
            &devices,
            |f| &f.device,
            "filesystem",
            &mut report,
        );
        let disks: Vec<String> = s.disks.iter().flatten().map(|d| d.device.clone()).collect();
        replace(
            &mut bs.disks,
            s.disks,
            &disks,
            |d| &d.device,
            "disk",
            &mut report,
        );
    }
    if let Some(units) = systemd.and_then(|s| s.units) {
        let names: Vec<String> = units.iter().map(|u| u.name.clone()).collect();
        let base_units = &mut base.systemd.get_or_insert_with(Default::default).units;
        replace(
            base_units,
            Some(units),
            &names,
            |u| &u.name,
            "unit",
            &mut report,
        );
    }
    report
}

/// Removes the `base` entries whose key is in `taken`, then appends `overlay`. A removed entry
/// is reported unless the overlay carries an identical one.
fn replace<T: PartialEq>(
    base: &mut Option<Vec<T>>,
    overlay: Option<Vec<T>>,
    taken: &[String],
    key: impl Fn(&T) -> &String,
    kind: &'static str,
    report: &mut MergeReport,
) {
    let overlay = overlay.unwrap_or_default();
    if let Some(items) = base.as_mut() {
        items.retain(|item| {
            if !taken.contains(key(item)) {
                return true;
            }
            if !overlay.contains(item) {
                report.replaced.push(Replaced {
                    kind,
                    name: key(item).clone(),
                });
            }
            false
        });
    }
    if !overlay.is_empty() {
        base.get_or_insert_with(Vec::new).extend(overlay);
    }
    if base.as_ref().is_some_and(Vec::is_empty) {
        *base = None;
    }
}
