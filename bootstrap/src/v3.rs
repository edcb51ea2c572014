//! Small constructors over the Ignition v3.4 types of `ignition-config`.

use ignition_config::v3_4::{
    Config, Directory, Disk, File, Filesystem, NodeGroup, NodeUser, Resource, Storage, Systemd,
    Unit, User,
};

/// An empty config of the output spec version.
pub fn empty_config() -> Config {
    Config::default()
}

pub fn storage(c: &mut Config) -> &mut Storage {
    c.storage.get_or_insert_with(Default::default)
}

pub fn files(c: &mut Config) -> &mut Vec<File> {
    storage(c).files.get_or_insert_with(Vec::new)
}

pub fn directories(c: &mut Config) -> &mut Vec<Directory> {
    storage(c).directories.get_or_insert_with(Vec::new)
}

pub fn disks(c: &mut Config) -> &mut Vec<Disk> {
    storage(c).disks.get_or_insert_with(Vec::new)
}

pub fn filesystems(c: &mut Config) -> &mut Vec<Filesystem> {
    storage(c).filesystems.get_or_insert_with(Vec::new)
}

pub fn units(c: &mut Config) -> &mut Vec<Unit> {
    c.systemd
        .get_or_insert_with(Systemd::default)
        .units
        .get_or_insert_with(Vec::new)
}

pub fn users(c: &mut Config) -> &mut Vec<User> {
    c.passwd
        .get_or_insert_with(Default::default)
        .users
        .get_or_insert_with(Vec::new)
}

/// A file owned by root with the given contents and mode, replacing whatever is at the path.
pub fn file(path: &str, contents: Resource, mode: i64) -> File {
    File {
        append: None,
        contents: Some(contents),
        group: None,
        mode: Some(mode),
        overwrite: Some(true),
        path: path.to_owned(),
        user: None,
    }
}

/// A directory with the given mode.
pub fn directory(path: &str, mode: i64) -> Directory {
    Directory {
        group: None,
        mode: Some(mode),
        overwrite: None,
        path: path.to_owned(),
        user: None,
    }
}

/// An enabled (or not) unit with the given contents.
pub fn unit(name: &str, contents: Option<String>, enabled: bool) -> Unit {
    Unit {
        contents,
        dropins: None,
        enabled: Some(enabled),
        mask: None,
        name: name.to_owned(),
    }
}

/// `user:group` (or `user`) as Ignition node owner fields; empty parts stay unset.
pub fn owner(owner: &str) -> (Option<NodeUser>, Option<NodeGroup>) {
    let mut parts = owner
        .splitn(2, ':')
        .map(str::trim)
        .map(|s| (!s.is_empty()).then(|| s.to_owned()));
    let user = parts.next().flatten().map(|name| NodeUser {
        id: None,
        name: Some(name),
    });
    let group = parts.next().flatten().map(|name| NodeGroup {
        id: None,
        name: Some(name),
    });
    (user, group)
}
