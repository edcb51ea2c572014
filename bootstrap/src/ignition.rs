//! Ignition input: spec 2.3.0 (CABPK's `format: ignition`, made by Flatcar's CLC transpiler)
//! translated to 3.4.0, and spec 3.0.0–3.5.0 passed through as 3.4.0 (every 3.x spec up to 3.5
//! only adds fields; a field newer than 3.4, such as 3.5's `luks[].cex`, is an error naming it).
//!
//! The 2.3 types below mirror Flatcar's `config/v2_3/types` (which CABPK marshals) plus
//! upstream's `proxy` and `httpHeaders`. Unknown keys are errors naming their path.
//!
//! Both paths get one addition: a drop-in that keeps [`KUBEADM_UNIT`]'s output off the serial
//! console (see [`keep_kubeadm_output_off_console`]).

use ignition_config::v3_4 as v3t;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::content;
use crate::error::{ConvertError, KeyPath, ignored_path};
use crate::systemd::{JOURNAL_ONLY_DROPIN, journal_only_dropin};
use crate::v3;

/// Input spec versions passed through (re-emitted as [`crate::OUTPUT_SPEC_VERSION`]).
pub const PASSTHROUGH_VERSIONS: &[&str] = &["3.0.0", "3.1.0", "3.2.0", "3.3.0", "3.4.0", "3.5.0"];

/// The unit CABPK's Ignition runs kubeadm in: `/etc/kubeadm.sh` with the pre-kubeadm commands,
/// `kubeadm init|join --config /etc/kubeadm.yml` and the post-kubeadm commands.
pub const KUBEADM_UNIT: &str = "kubeadm.service";

/// Reads an Ignition config of spec 2.3.0 or 3.0.0–3.5.0 and returns it as 3.4.0.
pub fn convert(text: &str) -> Result<v3t::Config, ConvertError> {
    #[derive(Deserialize)]
    struct Minimal {
        ignition: MinimalIgnition,
    }
    #[derive(Deserialize)]
    struct MinimalIgnition {
        version: Option<String>,
    }
    let minimal: Minimal =
        serde_json::from_str(text).map_err(|e| ConvertError::ParseIgnition(e.to_string()))?;
    let version = minimal
        .ignition
        .version
        .ok_or_else(|| ConvertError::ParseIgnition("`ignition.version` is missing".to_owned()))?;
    let mut config = if version == "2.3.0" {
        let v2: Config = parse(text, "2.3.0")?;
        translate(v2)?
    } else if PASSTHROUGH_VERSIONS.contains(&version.as_str()) {
        let mut c: v3t::Config = parse(text, "3.4.0, the spec capk-bootstrap emits")?;
        c.ignition.version = crate::OUTPUT_SPEC_VERSION.to_owned();
        c
    } else {
        return Err(ConvertError::UnsupportedIgnitionVersion { version });
    };
    keep_kubeadm_output_off_console(&mut config);
    Ok(config)
}

/// Adds the [`JOURNAL_ONLY_DROPIN`] drop-in to every (unmasked) [`KUBEADM_UNIT`] of `config`,
/// replacing a drop-in of that name the input may carry.
///
/// CABPK's unit sets no `StandardOutput=`, so its output (`kubeadm init` prints the join token)
/// follows systemd's `DefaultStandardOutput=`: `journal` in systemd's and Flatcar's defaults, and
/// journald forwards nothing to the console unless told to. On stock Flatcar the token therefore
/// stays off the console already; the drop-in makes that hold whatever the node image's
/// `DefaultStandardOutput=` is (`journal+console` or `tty` would put the token in `kubectl logs`)
/// and over a drop-in from `additionalConfig` that routes the output to the console. It cannot
/// override journald's `ForwardToConsole=`, which copies the whole journal to the console by the
/// node's own choice.
fn keep_kubeadm_output_off_console(config: &mut v3t::Config) {
    let units = config
        .systemd
        .iter_mut()
        .flat_map(|s| s.units.iter_mut().flatten());
    for unit in units.filter(|u| u.name == KUBEADM_UNIT && u.mask != Some(true)) {
        let dropins = unit.dropins.get_or_insert_with(Vec::new);
        dropins.retain(|d| d.name != JOURNAL_ONLY_DROPIN);
        dropins.push(v3t::Dropin {
            contents: Some(journal_only_dropin()),
            name: JOURNAL_ONLY_DROPIN.to_owned(),
        });
    }
}

fn parse<T: DeserializeOwned>(text: &str, spec: &str) -> Result<T, ConvertError> {
    let mut unknown: Option<KeyPath> = None;
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed: Result<T, _> = serde_path_to_error::deserialize(serde_ignored::Deserializer::new(
        &mut de,
        &mut |path: serde_ignored::Path<'_>| {
            if unknown.is_none() {
                unknown = Some(ignored_path(&path));
            }
        },
    ));
    if let Some(key) = unknown {
        return Err(ConvertError::unsupported(
            key,
            format!("not part of Ignition spec {spec}"),
        ));
    }
    parsed.map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            ConvertError::ParseIgnition(e.into_inner().to_string())
        } else {
            ConvertError::invalid(path, e.into_inner().to_string())
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Spec 2.3.0 types

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Config {
    ignition: Ignition,
    networkd: Option<Networkd>,
    passwd: Option<Passwd>,
    storage: Option<Storage>,
    systemd: Option<Systemd>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Ignition {
    #[allow(dead_code)]
    version: String,
    config: Option<IgnitionConfig>,
    security: Option<Security>,
    timeouts: Option<Timeouts>,
    proxy: Option<Proxy>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct IgnitionConfig {
    append: Option<Vec<Reference>>,
    replace: Option<Reference>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Reference {
    source: Option<String>,
    compression: Option<String>,
    verification: Option<Verification>,
    http_headers: Option<Vec<HttpHeader>>,
}

#[derive(Deserialize)]
struct HttpHeader {
    name: String,
    value: Option<String>,
}

#[derive(Deserialize)]
struct Verification {
    hash: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Security {
    tls: Option<Tls>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Tls {
    certificate_authorities: Option<Vec<Reference>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Timeouts {
    http_response_headers: Option<i64>,
    http_total: Option<i64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Proxy {
    http_proxy: Option<String>,
    https_proxy: Option<String>,
    no_proxy: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Storage {
    directories: Option<Vec<Directory>>,
    disks: Option<Vec<Disk>>,
    files: Option<Vec<File>>,
    filesystems: Option<Vec<Filesystem>>,
    links: Option<Vec<Link>>,
    raid: Option<Vec<Raid>>,
}

#[derive(Deserialize, Clone)]
struct NodeRef {
    id: Option<i64>,
    name: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct File {
    filesystem: Option<String>,
    path: String,
    overwrite: Option<bool>,
    user: Option<NodeRef>,
    group: Option<NodeRef>,
    append: Option<bool>,
    contents: Option<Reference>,
    mode: Option<i64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Directory {
    filesystem: Option<String>,
    path: String,
    overwrite: Option<bool>,
    user: Option<NodeRef>,
    group: Option<NodeRef>,
    mode: Option<i64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Link {
    filesystem: Option<String>,
    path: String,
    overwrite: Option<bool>,
    user: Option<NodeRef>,
    group: Option<NodeRef>,
    hard: Option<bool>,
    target: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Disk {
    device: String,
    partitions: Option<Vec<Partition>>,
    wipe_table: Option<bool>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Partition {
    guid: Option<String>,
    label: Option<String>,
    number: Option<i64>,
    should_exist: Option<bool>,
    size: Option<i64>,
    #[serde(rename = "sizeMiB")]
    size_mib: Option<i64>,
    start: Option<i64>,
    #[serde(rename = "startMiB")]
    start_mib: Option<i64>,
    type_guid: Option<String>,
    wipe_partition_entry: Option<bool>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Filesystem {
    mount: Option<Mount>,
    name: Option<String>,
    path: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Mount {
    create: Option<Create>,
    device: String,
    format: String,
    label: Option<String>,
    options: Option<Vec<String>>,
    uuid: Option<String>,
    wipe_filesystem: Option<bool>,
}

#[derive(Deserialize)]
struct Create {
    force: Option<bool>,
    options: Option<Vec<String>>,
}

#[derive(Deserialize)]
struct Raid {
    devices: Vec<String>,
    level: String,
    name: String,
    options: Option<Vec<String>>,
    spares: Option<i64>,
}

#[derive(Deserialize)]
struct Networkd {
    units: Option<Vec<NetworkdUnit>>,
}

#[derive(Deserialize)]
struct NetworkdUnit {
    contents: Option<String>,
    dropins: Option<Vec<Dropin>>,
    name: String,
}

#[derive(Deserialize)]
struct Dropin {
    contents: Option<String>,
    name: String,
}

#[derive(Deserialize)]
struct Systemd {
    units: Option<Vec<Unit>>,
}

#[derive(Deserialize)]
struct Unit {
    contents: Option<String>,
    dropins: Option<Vec<Dropin>>,
    enable: Option<bool>,
    enabled: Option<bool>,
    mask: Option<bool>,
    name: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Passwd {
    groups: Option<Vec<Group>>,
    users: Option<Vec<User>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Group {
    gid: Option<i64>,
    name: String,
    password_hash: Option<String>,
    system: Option<bool>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct User {
    create: Option<UserCreate>,
    gecos: Option<String>,
    groups: Option<Vec<String>>,
    home_dir: Option<String>,
    name: String,
    no_create_home: Option<bool>,
    no_log_init: Option<bool>,
    no_user_group: Option<bool>,
    password_hash: Option<String>,
    primary_group: Option<String>,
    ssh_authorized_keys: Option<Vec<String>>,
    shell: Option<String>,
    system: Option<bool>,
    uid: Option<i64>,
}

/// The deprecated `passwd.users[].create` block: the same fields, applied at creation.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct UserCreate {
    gecos: Option<String>,
    groups: Option<Vec<String>>,
    home_dir: Option<String>,
    no_create_home: Option<bool>,
    no_log_init: Option<bool>,
    no_user_group: Option<bool>,
    primary_group: Option<String>,
    shell: Option<String>,
    system: Option<bool>,
    uid: Option<i64>,
}

// ---------------------------------------------------------------------------------------------
// 2.3 → 3.4

fn resource(r: Reference) -> v3t::Resource {
    v3t::Resource {
        compression: r.compression.filter(|c| !c.is_empty()),
        http_headers: r.http_headers.map(|hs| {
            hs.into_iter()
                .map(|h| v3t::HttpHeadersItem {
                    name: h.name,
                    value: h.value,
                })
                .collect()
        }),
        source: r.source,
        verification: r
            .verification
            .and_then(|v| v.hash)
            .map(|hash| v3t::Verification { hash: Some(hash) }),
    }
}

fn node_user(n: Option<NodeRef>) -> Option<v3t::NodeUser> {
    n.filter(|n| n.id.is_some() || n.name.as_deref().is_some_and(|s| !s.is_empty()))
        .map(|n| v3t::NodeUser {
            id: n.id,
            name: n.name.filter(|s| !s.is_empty()),
        })
}

fn node_group(n: Option<NodeRef>) -> Option<v3t::NodeGroup> {
    node_user(n).map(|u| v3t::NodeGroup {
        id: u.id,
        name: u.name,
    })
}

/// 512-byte sectors (spec 2) to MiB (spec 3); only whole MiB translate exactly.
fn sectors_to_mib(
    sectors: Option<i64>,
    mib: Option<i64>,
    at: &KeyPath,
) -> Result<Option<i64>, ConvertError> {
    match (sectors, mib) {
        (Some(_), Some(_)) => Err(ConvertError::invalid(
            at.clone(),
            "give the size either in sectors or in MiB, not both",
        )),
        (None, m) => Ok(m),
        (Some(s), None) if s % 2048 == 0 => Ok(Some(s / 2048)),
        (Some(s), None) => Err(ConvertError::invalid(
            at.clone(),
            format!("{s} sectors is not a whole number of MiB; Ignition 3 sizes partitions in MiB"),
        )),
    }
}

/// The named spec-2 filesystems with their `path` (`None`: Ignition 2 mounts it itself); a
/// file, directory or link on one of them is written below that path.
#[derive(Default)]
struct FilesystemPaths(Vec<(String, Option<String>)>);

impl FilesystemPaths {
    /// Resolves the path prefix of a spec-2 `filesystem` reference: `root` is `/`; a filesystem
    /// with `path` is that path; a filesystem that Ignition 2 would mount itself has no spec-3
    /// equivalent for the files on it.
    fn prefix(&self, fs: Option<&str>, at: &KeyPath) -> Result<&str, ConvertError> {
        let name = fs.unwrap_or("root");
        if name == "root" {
            return Ok("");
        }
        match self.0.iter().find(|(n, _)| n == name) {
            Some((_, Some(p))) => Ok(p.trim_end_matches('/')),
            Some((_, None)) => Err(ConvertError::unsupported(
                at.clone(),
                format!(
                    "files on filesystem `{name}`, which Ignition 2 mounts itself, have no Ignition 3 equivalent; write them to the root filesystem and mount it with a unit"
                ),
            )),
            None => Err(ConvertError::invalid(
                at.clone(),
                format!("filesystem `{name}` is not defined in storage.filesystems"),
            )),
        }
    }
}

/// The entries of an optional spec-2 list, each with its key path (`list[i]`).
fn indexed<T>(list: &str, items: Option<Vec<T>>) -> impl Iterator<Item = (KeyPath, T)> {
    let at = KeyPath::from(list);
    items
        .into_iter()
        .flatten()
        .enumerate()
        .map(move |(i, item)| (at.index(i), item))
}

fn translate(c: Config) -> Result<v3t::Config, ConvertError> {
    let mut out = v3::empty_config();
    ignition_section(&mut out, c.ignition);
    // storage
    let storage = c.storage.unwrap_or(Storage {
        directories: None,
        disks: None,
        files: None,
        filesystems: None,
        links: None,
        raid: None,
    });
    let fs_paths = filesystems(&mut out, storage.filesystems)?;
    disks(&mut out, storage.disks)?;
    raid(&mut out, storage.raid);
    files(&mut out, storage.files, &fs_paths)?;
    directories_and_links(&mut out, storage.directories, storage.links, &fs_paths)?;
    networkd_units(&mut out, c.networkd)?;
    systemd_units(&mut out, c.systemd)?;
    passwd(&mut out, c.passwd)?;
    Ok(out)
}

/// `ignition`: merged and replacing configs, CAs, timeouts, the proxy.
fn ignition_section(out: &mut v3t::Config, ignition: Ignition) {
    if let Some(cfg) = ignition.config {
        let merge: Vec<_> = cfg.append.into_iter().flatten().map(resource).collect();
        let replace = cfg.replace.map(resource);
        if !merge.is_empty() || replace.is_some() {
            out.ignition.config = Some(v3t::IgnitionConfig {
                merge: (!merge.is_empty()).then_some(merge),
                replace,
            });
        }
    }
    if let Some(sec) = ignition.security {
        let cas: Vec<_> = sec
            .tls
            .and_then(|t| t.certificate_authorities)
            .into_iter()
            .flatten()
            .map(resource)
            .collect();
        if !cas.is_empty() {
            out.ignition.security = Some(v3t::Security {
                tls: Some(v3t::SecurityTls {
                    certificate_authorities: Some(cas),
                }),
            });
        }
    }
    if let Some(t) = ignition.timeouts
        && (t.http_response_headers.is_some() || t.http_total.is_some())
    {
        out.ignition.timeouts = Some(v3t::Timeouts {
            http_response_headers: t.http_response_headers,
            http_total: t.http_total,
        });
    }
    if let Some(p) = ignition.proxy {
        out.ignition.proxy = Some(v3t::Proxy {
            http_proxy: p.http_proxy,
            https_proxy: p.https_proxy,
            no_proxy: p.no_proxy,
        });
    }
}

/// `storage.filesystems`; returns each named filesystem's path, which prefixes file paths.
fn filesystems(
    out: &mut v3t::Config,
    filesystems: Option<Vec<Filesystem>>,
) -> Result<FilesystemPaths, ConvertError> {
    let mut fs_paths = FilesystemPaths::default();
    for (at, fs) in indexed("storage.filesystems", filesystems) {
        if let Some(name) = &fs.name {
            fs_paths.0.push((name.clone(), fs.path.clone()));
        }
        let Some(m) = fs.mount else {
            if fs.path.is_none() {
                return Err(ConvertError::invalid(
                    at,
                    "a filesystem needs `mount` or `path`",
                ));
            }
            // A filesystem given by `path` is already mounted; it only prefixes file paths.
            continue;
        };
        if fs.path.is_some() {
            return Err(ConvertError::invalid(
                at,
                "a filesystem has either `mount` or `path`, not both",
            ));
        }
        let (mut wipe, mut options) = (m.wipe_filesystem, m.options);
        if let Some(create) = m.create {
            if wipe.is_some() || options.is_some() {
                return Err(ConvertError::invalid(
                    at.field("mount.create"),
                    "the deprecated `create` cannot be combined with `wipeFilesystem` or `options`",
                ));
            }
            wipe = create.force;
            options = create.options;
        }
        v3::filesystems(out).push(v3t::Filesystem {
            device: m.device,
            format: Some(m.format),
            label: m.label,
            mount_options: None,
            options: options.filter(|o| !o.is_empty()),
            path: None,
            uuid: m.uuid,
            wipe_filesystem: wipe,
        });
    }
    Ok(fs_paths)
}

/// `storage.disks` and their partitions.
fn disks(out: &mut v3t::Config, disks: Option<Vec<Disk>>) -> Result<(), ConvertError> {
    for (at, d) in indexed("storage.disks", disks) {
        let mut parts = Vec::new();
        let partitions = d.partitions.unwrap_or_default();
        let any_numbered = partitions.iter().any(|p| p.number.unwrap_or(0) != 0);
        for (j, p) in partitions.into_iter().enumerate() {
            let at = at.field("partitions").index(j);
            let mut number = p.number.filter(|n| *n != 0);
            if number.is_none() && p.label.is_none() {
                // Spec 2 takes "the next available number"; spec 3 needs a number or a label to
                // identify the partition. Ignition runs on first boot, when the disk is blank (or
                // wiped), so the next available number is the partition's position — unless
                // other partitions of the disk carry explicit numbers. CABPK's
                // `partitions: [{}]` is this case.
                if any_numbered {
                    return Err(ConvertError::invalid(
                        at,
                        "a partition without number or label next to numbered ones has no Ignition 3 equivalent; give it a number or a label",
                    ));
                }
                number = Some(j as i64 + 1);
            }
            parts.push(v3t::Partition {
                guid: p.guid.filter(|s| !s.is_empty()),
                label: p.label,
                number,
                resize: None,
                should_exist: p.should_exist,
                size_mib: sectors_to_mib(p.size, p.size_mib, &at.field("size"))?,
                start_mib: sectors_to_mib(p.start, p.start_mib, &at.field("start"))?,
                type_guid: p.type_guid.filter(|s| !s.is_empty()),
                wipe_partition_entry: p.wipe_partition_entry,
            });
        }
        v3::disks(out).push(v3t::Disk {
            device: d.device,
            partitions: (!parts.is_empty()).then_some(parts),
            wipe_table: d.wipe_table,
        });
    }
    Ok(())
}

/// `storage.raid`.
fn raid(out: &mut v3t::Config, raid: Option<Vec<Raid>>) {
    let arrays: Vec<v3t::Raid> = raid
        .into_iter()
        .flatten()
        .map(|r| v3t::Raid {
            devices: Some(r.devices),
            level: Some(r.level),
            name: r.name,
            options: r.options,
            spares: r.spares,
        })
        .collect();
    if !arrays.is_empty() {
        v3::storage(out).raid = Some(arrays);
    }
}

/// `storage.files`, folded into one entry per path as spec 2 writes them in order.
fn files(
    out: &mut v3t::Config,
    files: Option<Vec<File>>,
    fs_paths: &FilesystemPaths,
) -> Result<(), ConvertError> {
    for (at, f) in indexed("storage.files", files) {
        let pre = fs_paths.prefix(f.filesystem.as_deref(), &at.field("filesystem"))?;
        let append = f.append.unwrap_or(false);
        let mut contents = f.contents.map(resource).unwrap_or_default();
        // Spec 2 writes an empty file when there is no source; spec 3 needs one to overwrite.
        if contents.source.is_none() {
            contents.source = Some("data:,".to_owned());
        }
        let mut file = v3t::File::new(format!("{pre}{}", f.path));
        file.mode = f.mode;
        file.user = node_user(f.user);
        file.group = node_group(f.group);
        if append && f.overwrite == Some(true) {
            return Err(ConvertError::invalid(
                at.field("overwrite"),
                "`overwrite: true` contradicts `append: true`",
            ));
        }
        // Spec 2 writes files in order, so a later entry for a path replaces an earlier one
        // (or appends to it); spec 3 wants one entry per path. Fold them the same way. (CABPK's
        // CLC template emits both entries of a `write_files` pair with `append`.)
        let files = v3::files(out);
        if let Some(earlier) = files.iter_mut().find(|e| e.path == file.path) {
            if append {
                earlier.append.get_or_insert_with(Vec::new).push(contents);
            } else {
                earlier.contents = Some(contents);
                earlier.append = None;
                earlier.overwrite = Some(f.overwrite.unwrap_or(true));
            }
            earlier.mode = file.mode.or(earlier.mode);
            earlier.user = file.user.or(earlier.user.take());
            earlier.group = file.group.or(earlier.group.take());
            continue;
        }
        if append {
            file.append = Some(vec![contents]);
        } else {
            // Spec 2 replaces existing files unless told otherwise; spec 3 defaults to false.
            file.overwrite = Some(f.overwrite.unwrap_or(true));
            file.contents = Some(contents);
        }
        files.push(file);
    }
    Ok(())
}

/// `storage.directories` and `storage.links`.
fn directories_and_links(
    out: &mut v3t::Config,
    directories: Option<Vec<Directory>>,
    links: Option<Vec<Link>>,
    fs_paths: &FilesystemPaths,
) -> Result<(), ConvertError> {
    for (at, d) in indexed("storage.directories", directories) {
        let pre = fs_paths.prefix(d.filesystem.as_deref(), &at.field("filesystem"))?;
        v3::directories(out).push(v3t::Directory {
            group: node_group(d.group),
            mode: d.mode,
            overwrite: d.overwrite,
            path: format!("{pre}{}", d.path),
            user: node_user(d.user),
        });
    }
    for (at, l) in indexed("storage.links", links) {
        let pre = fs_paths.prefix(l.filesystem.as_deref(), &at.field("filesystem"))?;
        v3::storage(out)
            .links
            .get_or_insert_with(Vec::new)
            .push(v3t::Link {
                group: node_group(l.group),
                hard: l.hard,
                overwrite: l.overwrite,
                path: format!("{pre}{}", l.path),
                target: Some(l.target),
                user: node_user(l.user),
            });
    }
    Ok(())
}

/// `networkd` units become files: Ignition 3 has no networkd section.
fn networkd_units(out: &mut v3t::Config, networkd: Option<Networkd>) -> Result<(), ConvertError> {
    for (at, u) in indexed("networkd.units", networkd.and_then(|n| n.units)) {
        if u.name.contains('/') || u.name.is_empty() {
            return Err(ConvertError::invalid(
                at.field("name"),
                format!("`{}` is not a unit file name", u.name),
            ));
        }
        let dir = "/etc/systemd/network";
        if let Some(text) = &u.contents {
            v3::files(out).push(v3::file(
                &format!("{dir}/{}", u.name),
                content::text_resource(text),
                0o644,
            ));
        }
        for (j, d) in u.dropins.into_iter().flatten().enumerate() {
            if d.name.contains('/') || d.name.is_empty() {
                return Err(ConvertError::invalid(
                    at.field("dropins").index(j).field("name"),
                    format!("`{}` is not a drop-in file name", d.name),
                ));
            }
            let text = d.contents.unwrap_or_default();
            v3::files(out).push(v3::file(
                &format!("{dir}/{}.d/{}", u.name, d.name),
                content::text_resource(&text),
                0o644,
            ));
        }
    }
    Ok(())
}

/// `systemd` units and their drop-ins, one entry per unit.
fn systemd_units(out: &mut v3t::Config, systemd: Option<Systemd>) -> Result<(), ConvertError> {
    for u in systemd.and_then(|s| s.units).into_iter().flatten() {
        let enabled = match (u.enabled, u.enable) {
            (Some(e), _) => Some(e),
            (None, Some(true)) => Some(true),
            (None, _) => None,
        };
        let dropins: Vec<_> = u
            .dropins
            .into_iter()
            .flatten()
            .map(|d| v3t::Dropin {
                contents: d.contents,
                name: d.name,
            })
            .collect();
        let units = v3::units(out);
        // Spec 2 applies unit entries in order (CABPK's additionalConfig is appended this way:
        // Flatcar templates add a drop-in to kubeadm.service); spec 3 wants one entry per unit.
        if let Some(earlier) = units.iter_mut().find(|e| e.name == u.name) {
            if u.contents.is_some() {
                earlier.contents = u.contents;
            }
            if enabled.is_some() {
                earlier.enabled = enabled;
            }
            if u.mask == Some(true) {
                earlier.mask = Some(true);
            }
            let list = earlier.dropins.get_or_insert_with(Vec::new);
            for d in dropins {
                list.retain(|e| e.name != d.name);
                list.push(d);
            }
            if list.is_empty() {
                earlier.dropins = None;
            }
            continue;
        }
        units.push(v3t::Unit {
            contents: u.contents,
            dropins: (!dropins.is_empty()).then_some(dropins),
            enabled,
            mask: u.mask.filter(|m| *m),
            name: u.name,
        });
    }
    Ok(())
}

/// `passwd` groups and users (the deprecated `create` folded in).
fn passwd(out: &mut v3t::Config, passwd: Option<Passwd>) -> Result<(), ConvertError> {
    if let Some(p) = passwd {
        for g in p.groups.into_iter().flatten() {
            out.passwd
                .get_or_insert_with(Default::default)
                .groups
                .get_or_insert_with(Vec::new)
                .push(v3t::Group {
                    gid: g.gid,
                    name: g.name,
                    password_hash: g.password_hash,
                    should_exist: None,
                    system: g.system,
                });
        }
        for u in p.users.into_iter().flatten() {
            let mut user = v3t::User::new(u.name);
            user.gecos = u.gecos;
            user.groups = u.groups.filter(|g| !g.is_empty());
            user.home_dir = u.home_dir;
            user.no_create_home = u.no_create_home;
            user.no_log_init = u.no_log_init;
            user.no_user_group = u.no_user_group;
            user.password_hash = u.password_hash;
            user.primary_group = u.primary_group;
            user.ssh_authorized_keys = u.ssh_authorized_keys.filter(|k| !k.is_empty());
            user.shell = u.shell;
            user.system = u.system;
            user.uid = u.uid;
            if let Some(cr) = u.create {
                // Deprecated in spec 2; its fields apply when the user is created, which is
                // what spec 3's user fields do.
                user.gecos = user.gecos.or(cr.gecos);
                user.groups = user.groups.or(cr.groups.filter(|g| !g.is_empty()));
                user.home_dir = user.home_dir.or(cr.home_dir);
                user.no_create_home = user.no_create_home.or(cr.no_create_home);
                user.no_log_init = user.no_log_init.or(cr.no_log_init);
                user.no_user_group = user.no_user_group.or(cr.no_user_group);
                user.primary_group = user.primary_group.or(cr.primary_group);
                user.shell = user.shell.or(cr.shell);
                user.system = user.system.or(cr.system);
                user.uid = user.uid.or(cr.uid);
            }
            v3::users(out).push(user);
        }
    }
    Ok(())
}
