//! Pure: removing a control-plane machine's etcd data from its MC node once its KVMMachine is
//! deleted (`etcdStorage.type: hostPath`).
//!
//! The machine Pod mounts `<hostPath>/<namespace>/<pod>` from its node, and the launcher keeps
//! the etcd disk there, so it survives the Pod. Where that was is recorded, read from the machine
//! Pod itself as soon as it is on a node, in the KVMMachine's `status.etcdHostDir`: the spec's
//! author (a tenant) cannot write status, and the record survives a controller restart and a
//! machine Pod that is gone before the KVMMachine. A copy goes into the annotation
//! [`ETCD_HOST_DIR_ANNOTATION`] (`<node>:<directory>`) for people and `clusterctl move` (which
//! moves annotations, not status); a tenant can edit it, so it never names what is removed: an
//! annotation that disagrees with the record stops the cleanup, with a Warning.
//!
//! After the machine Pod is gone, a short-lived cleanup Pod runs on that node, with the launcher
//! image, the directory's parent mounted and `rm -rf -- <that directory>` as its command (as
//! local-path-provisioner's helper Pod removes a volume). Nothing wider is ever removed: the
//! directory must be absolute and plain, under a directory the operator allows etcd data in,
//! and end in the machine's own `<namespace>/<pod>`.
//! The cleanup Pod carries the machine's owner labels, not an owner reference: the garbage
//! collector of a KVMMachine deleted in the foreground would delete it while it works.

use std::{collections::BTreeMap, time::Duration};

use capk_api::{constants::MAX_SUBDOMAIN_LEN, etcd_owner::EtcdOwner, v1alpha1::KVMMachine};
use k8s_openapi::{
    api::core::v1::{
        Container, HostPathVolumeSource, Pod, PodSpec, ResourceRequirements, SecurityContext,
        Toleration, Volume,
    },
    apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::ObjectMeta},
    jiff::{SignedDuration, Timestamp},
};
use kube::ResourceExt;

use super::{
    names::{MachineNames, etcd_dir_name},
    pod_layout::mount,
};
use crate::{
    k8s::ownership::{Home, Owner},
    kvmcluster::build::owned_labels,
};

// The annotations are defined with the others, where the controller's caches keep them.
pub use capk_api::constants::{
    ETCD_CLEANUP_ATTEMPT_ANNOTATION as ATTEMPT_ANNOTATION,
    ETCD_CLEANUP_SINCE_ANNOTATION as SINCE_ANNOTATION, ETCD_HOST_DIR_ANNOTATION,
};
/// `app.kubernetes.io/component` of cleanup Pods.
pub const COMPONENT: &str = "etcd-cleanup";
/// How long the cleanup may take, from its first attempt, before the directory is left (and
/// said so): the node may never run the Pod (NotReady, unreachable).
pub const GIVE_UP_AFTER: Duration = Duration::from_secs(10 * 60);
/// How long one cleanup Pod may run (`activeDeadlineSeconds`): an image pull and an `rm`.
pub const POD_DEADLINE_SECONDS: i64 = 300;
/// Where the directory's parent is mounted in the cleanup Pod.
const MOUNT_DIR: &str = "/var/lib/capk/etcd-cleanup";

/// Where a machine Pod kept its etcd disk: a directory on an MC node, and the KVMMachine UID
/// its launcher marked it with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdHostDir {
    /// The node the machine Pod ran on.
    pub node: String,
    /// The hostPath directory it mounted.
    pub dir: String,
    /// The UID of the Pod's `--etcd-owner` (none in the annotation, which names a place only).
    pub owner_uid: Option<String>,
}

impl EtcdHostDir {
    /// Of a machine Pod that is on a node and mounts a hostPath etcd volume; `None` for an
    /// emptyDir or PVC etcd volume, a worker, or a Pod not scheduled yet.
    pub fn of_pod(pod: &Pod) -> Option<Self> {
        let spec = pod.spec.as_ref()?;
        let node = spec.node_name.clone().filter(|n| !n.is_empty())?;
        let dir = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == capk_api::constants::ETCD_VOLUME)?
            .host_path
            .as_ref()?
            .path
            .clone();
        let owner_uid = spec
            .containers
            .iter()
            .flat_map(|c| c.args.iter().flatten())
            .find_map(|a| a.strip_prefix("--etcd-owner="))
            .and_then(|o| o.parse::<EtcdOwner>().ok())
            .map(|o| o.uid);
        Some(Self {
            node,
            dir,
            owner_uid,
        })
    }

    /// What the KVMMachine's `status.etcdHostDir` records: the controller wrote it from the
    /// machine Pod, and the spec's author cannot write status, so it is the record the cleanup
    /// acts on.
    pub fn recorded(km: &KVMMachine) -> Option<Self> {
        let r = km.status.as_ref()?.etcd_host_dir.as_ref()?;
        Some(Self {
            node: r.node.clone(),
            dir: r.path.clone(),
            owner_uid: r.owner_uid.clone(),
        })
    }

    /// What the KVMMachine's [`ETCD_HOST_DIR_ANNOTATION`] says, if anything: for people and
    /// `clusterctl move`; anyone who may edit the KVMMachine may edit it, so it only ever
    /// stops a cleanup (when it disagrees with [`Self::recorded`]), never directs one.
    pub fn annotated(km: &KVMMachine) -> Option<Self> {
        let value = km.annotations().get(ETCD_HOST_DIR_ANNOTATION)?;
        let (node, dir) = value.split_once(':')?;
        Some(Self {
            node: node.to_owned(),
            dir: dir.to_owned(),
            owner_uid: None,
        })
    }

    /// Whether `other` names the same directory on the same node (what the annotation can say).
    pub fn same_place(&self, other: &Self) -> bool {
        self.node == other.node && self.dir == other.dir
    }

    /// As `status.etcdHostDir`.
    pub fn to_status(&self) -> capk_api::v1alpha1::EtcdHostDirStatus {
        capk_api::v1alpha1::EtcdHostDirStatus {
            node: self.node.clone(),
            path: self.dir.clone(),
            owner_uid: self.owner_uid.clone(),
        }
    }

    /// The annotation's value: `<node>:<directory>` (a node name has no colon).
    pub fn annotation(&self) -> String {
        format!("{}:{}", self.node, self.dir)
    }

    /// The directory as the cleanup removes it, when it is the machine's own: an absolute,
    /// plain path (no empty, `.` or `..` element) under one of the operator's `allowed`
    /// directories, ending in `<namespace>/<pod>` of `km`, on a node whose name is a DNS
    /// subdomain. Otherwise why not.
    pub fn removable(&self, km: &KVMMachine, allowed: &[String]) -> Result<RemovableDir, String> {
        let node_ok = !self.node.is_empty()
            && self.node.len() <= MAX_SUBDOMAIN_LEN
            && self
                .node
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
            && self.node.starts_with(|c: char| c.is_ascii_alphanumeric())
            && self.node.ends_with(|c: char| c.is_ascii_alphanumeric());
        if !node_ok {
            return Err(format!("{:?} is not a node name", self.node));
        }
        let Some(rest) = self.dir.strip_prefix('/') else {
            return Err(format!("{:?} is not an absolute path", self.dir));
        };
        let elements: Vec<&str> = rest.split('/').collect();
        if elements
            .iter()
            .any(|e| e.is_empty() || *e == "." || *e == "..")
        {
            return Err(format!(
                "{:?} is not a plain path (an empty, '.' or '..' element)",
                self.dir
            ));
        }
        if self.dir.len() > 4096 || self.dir.contains('\0') {
            return Err(format!("{:?} is not a usable path", self.dir));
        }
        if !crate::settings::TenantPolicy::allows(allowed, &self.dir) {
            return Err(format!(
                "{:?} is not in a directory the operator allows etcd data in (allowed: {})",
                self.dir,
                crate::settings::TenantPolicy::describe(allowed)
            ));
        }
        let ns = km.namespace().unwrap_or_else(|| "default".into());
        let name = etcd_dir_name(km);
        match elements.as_slice() {
            [.., n, last] if *n == ns && *last == name => Ok(RemovableDir {
                node: self.node.clone(),
                parent: format!("/{}", elements[..elements.len() - 1].join("/")),
                name,
            }),
            _ => Err(format!(
                "{:?} is not the machine's own directory (it must end in /{ns}/{name})",
                self.dir
            )),
        }
    }
}

/// A directory the cleanup may remove: `<parent>/<name>` on `node`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemovableDir {
    /// The node.
    pub node: String,
    /// The directory's parent (`<hostPath>/<namespace>`), the only thing mounted.
    pub parent: String,
    /// The directory's name in it (the KVMMachine's name, [`etcd_dir_name`]).
    pub name: String,
}

impl RemovableDir {
    /// The whole directory, as on the node.
    pub fn path(&self) -> String {
        format!("{}/{}", self.parent, self.name)
    }
}

/// One cleanup Pod: its number and when the first one was made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// 1 for the first.
    pub number: u32,
    /// When the first attempt was made: the cleanup is given up [`GIVE_UP_AFTER`] later.
    pub since: Timestamp,
}

impl Attempt {
    /// The first attempt, made at `now`.
    pub fn first(now: Timestamp) -> Self {
        Self {
            number: 1,
            since: now,
        }
    }

    /// The attempt after this one.
    pub fn next(&self) -> Self {
        Self {
            number: self.number.saturating_add(1),
            since: self.since,
        }
    }

    /// The attempt a cleanup Pod is, from its annotations (else its creation).
    pub fn of(pod: &Pod) -> Option<Self> {
        let a = pod.annotations();
        let created = pod.metadata.creation_timestamp.as_ref().map(|t| t.0);
        Some(Self {
            number: a.get(ATTEMPT_ANNOTATION)?.parse().ok()?,
            since: a
                .get(SINCE_ANNOTATION)
                .and_then(|s| s.parse().ok())
                .or(created)?,
        })
    }

    /// Whether the cleanup has been tried for longer than [`GIVE_UP_AFTER`] at `now`.
    pub fn expired(&self, now: Timestamp) -> bool {
        now.duration_since(self.since).as_secs() > GIVE_UP_AFTER.as_secs() as i64
    }

    /// How long to wait after this attempt failed before the next: 5 s, doubled each time, at
    /// most 80 s.
    pub fn backoff(&self) -> Duration {
        crate::runtime::backoff::doubling(
            Duration::from_secs(5),
            Duration::from_secs(80),
            self.number,
        )
    }
}

/// The labels of a cleanup Pod: the cluster's, the machine's owner labels and the component,
/// but not the machine role (a control-plane role would make it an apiserver endpoint).
pub fn labels(km: &KVMMachine, cluster: &str) -> BTreeMap<String, String> {
    let mut labels = owned_labels(cluster);
    labels.extend(Owner::machine(km).labels());
    labels.insert("app.kubernetes.io/component".into(), COMPONENT.into());
    labels
}

/// The cleanup Pod removing `dir` of `km` (of cluster `cluster`), made in `home` where the
/// machine Pod was, running `image` (the launcher's: it is on the node already, and has `rm`).
pub fn cleanup_pod(
    km: &KVMMachine,
    cluster: &str,
    home: &Home,
    dir: &RemovableDir,
    image: &str,
    attempt: &Attempt,
) -> Pod {
    let resources = ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_owned(), Quantity("10m".into())),
            ("memory".to_owned(), Quantity("16Mi".into())),
        ])),
        limits: Some(BTreeMap::from([(
            "memory".to_owned(),
            Quantity("64Mi".into()),
        )])),
        ..Default::default()
    };
    Pod {
        metadata: ObjectMeta {
            name: Some(MachineNames::in_home(km, home).etcd_cleanup_pod),
            namespace: Some(home.namespace.clone()),
            labels: Some(labels(km, cluster)),
            annotations: Some(BTreeMap::from([
                (ATTEMPT_ANNOTATION.to_owned(), attempt.number.to_string()),
                (SINCE_ANNOTATION.to_owned(), attempt.since.to_string()),
                (
                    ETCD_HOST_DIR_ANNOTATION.to_owned(),
                    EtcdHostDir {
                        node: dir.node.clone(),
                        dir: dir.path(),
                        owner_uid: None,
                    }
                    .annotation(),
                ),
            ])),
            ..Default::default()
        },
        spec: Some(PodSpec {
            // Bound to the node, past the scheduler: the data is there and nowhere else.
            node_name: Some(dir.node.clone()),
            // Whatever taints the node has now, this Pod must run there.
            tolerations: Some(vec![Toleration {
                operator: Some("Exists".into()),
                ..Default::default()
            }]),
            restart_policy: Some("Never".into()),
            active_deadline_seconds: Some(POD_DEADLINE_SECONDS),
            termination_grace_period_seconds: Some(5),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            containers: vec![Container {
                name: "remove".into(),
                image: Some(image.to_owned()),
                image_pull_policy: Some("IfNotPresent".into()),
                // Removes the directory only when its owner marker names this KVMMachine's UID
                // (a path is made of names tenants choose); exit code
                // CLEANUP_REFUSED_EXIT_CODE otherwise.
                command: Some(vec![
                    "capk-launcher".into(),
                    "remove-etcd-data".into(),
                    format!("--dir={MOUNT_DIR}/{}", dir.name),
                    format!("--owner={}", owner_of(km)),
                ]),
                // The files were written by the privileged launcher: as root, with whatever
                // labels (SELinux) a privileged container leaves; the same rights remove them.
                security_context: Some(SecurityContext {
                    privileged: Some(true),
                    run_as_user: Some(0),
                    ..Default::default()
                }),
                resources: Some(resources),
                volume_mounts: Some(vec![mount("parent", MOUNT_DIR, false)]),
                termination_message_policy: Some("FallbackToLogsOnError".into()),
                ..Default::default()
            }],
            volumes: Some(vec![Volume {
                name: "parent".into(),
                host_path: Some(HostPathVolumeSource {
                    path: dir.parent.clone(),
                    // Only ever `<hostPath>/<namespace>`, which the machine Pod's own
                    // DirectoryOrCreate made; recreated empty if someone removed it since.
                    type_: Some("DirectoryOrCreate".into()),
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    }
}

/// The KVMMachine as the launcher marks its etcd directory and the cleanup checks the mark:
/// its namespace and name, and the UID its machine Pod was made for as recorded in
/// `status.etcdHostDir.ownerUID` (after `clusterctl move` made the KVMMachine again, the old
/// one's: the data is the same machine's), or its own UID when nothing is recorded.
pub fn owner_of(km: &KVMMachine) -> EtcdOwner {
    let recorded = EtcdHostDir::recorded(km).and_then(|r| r.owner_uid);
    EtcdOwner {
        namespace: km.namespace().unwrap_or_else(|| "default".into()),
        name: km.name_any(),
        uid: recorded.or_else(|| km.uid()).unwrap_or_default(),
    }
}

/// Why the cleanup Pod refused the directory (its marker does not name this KVMMachine), when
/// it did: nothing was removed, and another attempt would not change that.
pub fn refused(pod: &Pod) -> Option<String> {
    let t = pod
        .status
        .as_ref()?
        .container_statuses
        .iter()
        .flatten()
        .filter_map(|c| c.state.as_ref()?.terminated.as_ref())
        .next()?;
    if t.exit_code != capk_api::etcd_owner::CLEANUP_REFUSED_EXIT_CODE {
        return None;
    }
    let text = t.message.as_deref().unwrap_or_default().trim();
    let line = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default();
    let why = line
        .split_once(": ")
        .filter(|(r, _)| *r == capk_api::etcd_owner::REASON_CLEANUP_REFUSED)
        .map(|(_, m)| m)
        .unwrap_or(line);
    Some(crate::remote::redact::untrusted_message(why))
}

/// Why the apiserver refused a cleanup Pod for good, if it did: the namespace is being deleted
/// (no Pod can be made there any more), or admission, a quota or RBAC refuse it (403, 422, ...).
/// `None` for what passes by itself: a conflict, throttling, a server error.
pub fn refusal(status: &kube::core::Status, namespace: &str) -> Option<String> {
    let terminating = status
        .details
        .as_ref()
        .is_some_and(|d| d.causes.iter().any(|c| c.reason == "NamespaceTerminating"));
    if status.code == 403 && terminating {
        return Some(format!(
            "namespace {namespace} is being deleted, so no cleanup Pod can run there (delete \
             Clusters before their namespace)"
        ));
    }
    if crate::runtime::error::refused_for_good(status) {
        return Some(format!(
            "the cleanup Pod was refused (HTTP {}): {}",
            status.code,
            crate::remote::redact::untrusted_message(&status.message)
        ));
    }
    None
}

/// Why a cleanup Pod failed, in words: the container's exit and message, or the Pod's reason
/// (`DeadlineExceeded`, an eviction).
pub fn failure(pod: &Pod) -> String {
    let status = pod.status.clone().unwrap_or_default();
    let exited = status
        .container_statuses
        .iter()
        .flatten()
        .filter_map(|c| c.state.as_ref()?.terminated.as_ref())
        .next()
        .map(|t| {
            format!(
                "rm exited with code {}{}",
                t.exit_code,
                t.message
                    .as_deref()
                    .map(|m| format!(": {}", m.trim()))
                    .unwrap_or_default()
            )
        });
    let pod_reason = status.reason.map(|r| {
        format!(
            "{r}{}",
            status
                .message
                .map(|m| format!(": {}", m.trim()))
                .unwrap_or_default()
        )
    });
    match (pod_reason, exited) {
        (Some(r), Some(e)) => format!("{r}; {e}"),
        (Some(r), None) => r,
        (None, Some(e)) => e,
        (None, None) => "phase Failed".into(),
    }
}

/// When a failed cleanup Pod finished: its container's end, else its latest condition change,
/// else its creation.
pub fn finished_at(pod: &Pod) -> Option<Timestamp> {
    let status = pod.status.as_ref();
    let ended = status
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| c.state.as_ref()?.terminated.as_ref()?.finished_at.as_ref())
        .map(|t| t.0)
        .max();
    let changed = status
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| c.last_transition_time.as_ref())
        .map(|t| t.0)
        .max();
    ended
        .or(changed)
        .or_else(|| pod.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

/// A record the cleanup does not remove, and why: forgotten, with a Warning Event naming the
/// directory left on its node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Left {
    /// The node.
    pub node: String,
    /// The directory, as on the node.
    pub dir: String,
    /// Why it is left.
    pub why: String,
}

/// What a deleted KVMMachine's record says may be removed (pure): `Ok(None)` when nothing is
/// recorded, `Ok(Some(dir))` to go on, `Err(left)` when the record is given up. Only the record
/// (`status.etcdHostDir`, which a tenant cannot write) names a directory: an annotation alone,
/// or one that disagrees with the record, removes nothing; nor does a directory outside what
/// the operator allows (`allowed`).
pub fn what_to_remove(km: &KVMMachine, allowed: &[String]) -> Result<Option<RemovableDir>, Left> {
    let annotated = EtcdHostDir::annotated(km);
    let Some(recorded) = EtcdHostDir::recorded(km) else {
        return match annotated {
            None => Ok(None),
            Some(a) => Err(Left {
                node: a.node,
                dir: a.dir,
                why: format!(
                    "only the annotation {ETCD_HOST_DIR_ANNOTATION} names it, not \
                     status.etcdHostDir (recorded by the controller from the machine Pod), so \
                     nothing is removed"
                ),
            }),
        };
    };
    let left = |why: String| Left {
        node: recorded.node.clone(),
        dir: recorded.dir.clone(),
        why,
    };
    if let Some(a) = annotated.filter(|a| !a.same_place(&recorded)) {
        return Err(left(format!(
            "the annotation {ETCD_HOST_DIR_ANNOTATION} was changed to {:?} after the controller \
             recorded the directory, so nothing is removed",
            a.annotation()
        )));
    }
    recorded.removable(km, allowed).map(Some).map_err(left)
}

/// A cleanup Pod that failed: which attempt, what its message says, and when the next may start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failed {
    /// The failed attempt.
    pub attempt: Attempt,
    /// `attempt N to remove <dir> on node <node> failed: <why>`.
    pub message: String,
    /// How long until the next attempt may start (zero: now).
    pub wait: Duration,
}

impl Failed {
    /// `attempt N`: what the `Ready` condition's message starts with, so it is reported once.
    pub fn label(&self) -> String {
        format!("attempt {}", self.attempt.number)
    }
}

/// What the cleanup of `dir` does next (pure), from its cleanup Pod `pod` (named `name`; none
/// yet), whether the node is known to be gone and the time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// The cleanup Pod succeeded: delete it, forget the record, a Normal Event.
    Removed,
    /// The cleanup Pod refused the directory (its marker names another machine, or none): left
    /// as it is, for good; delete the Pod, forget the record, a Warning Event.
    Refused(String),
    /// Give up (tried for [`GIVE_UP_AFTER`], or the node is gone): delete the Pod, forget the
    /// record, a Warning Event naming what is left.
    GiveUp(String),
    /// Make the cleanup Pod of this attempt: the first, or the next once a failed one's back-off
    /// ran out (the failed Pod deleted first).
    Start(Attempt, Option<Failed>),
    /// A failed attempt waits out its back-off.
    BackOff(Failed),
    /// The cleanup Pod is at work.
    Running(String),
}

/// What the cleanup does next ([`Next`]).
pub fn next(
    dir: &RemovableDir,
    name: &str,
    pod: Option<&Pod>,
    node_gone: bool,
    now: Timestamp,
) -> Next {
    let phase = pod
        .and_then(|p| p.status.as_ref()?.phase.clone())
        .unwrap_or_else(|| "Pending".into());
    let Some(pod) = pod else {
        return if node_gone {
            Next::GiveUp(format!("node {} no longer exists", dir.node))
        } else {
            Next::Start(Attempt::first(now), None)
        };
    };
    if phase == "Succeeded" {
        return Next::Removed;
    }
    if let Some(why) = Some(pod).filter(|_| phase == "Failed").and_then(refused) {
        return Next::Refused(why);
    }
    let attempt = Attempt::of(pod);
    if attempt.as_ref().is_some_and(|a| a.expired(now)) {
        return Next::GiveUp(format!(
            "the cleanup Pod {name} did not succeed within {} minutes (phase {phase})",
            GIVE_UP_AFTER.as_secs() / 60
        ));
    }
    if node_gone {
        return Next::GiveUp(format!("node {} no longer exists", dir.node));
    }
    if phase != "Failed" {
        return Next::Running(format!(
            "cleanup Pod {name} removes {} on node {} (phase {phase})",
            dir.path(),
            dir.node
        ));
    }
    let attempt = attempt.unwrap_or_else(|| Attempt::first(now));
    let due = finished_at(pod).unwrap_or(now)
        + SignedDuration::try_from(attempt.backoff()).unwrap_or_default();
    let failed = Failed {
        message: format!(
            "attempt {} to remove {} on node {} failed: {}",
            attempt.number,
            dir.path(),
            dir.node,
            failure(pod)
        ),
        wait: if now < due {
            now.duration_until(due).unsigned_abs()
        } else {
            Duration::ZERO
        },
        attempt,
    };
    if failed.wait.is_zero() {
        Next::Start(failed.attempt.next(), Some(failed))
    } else {
        Next::BackOff(failed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvmmachine::testing::{kvm_machine, management};
    use serde_json::json;

    fn km() -> KVMMachine {
        kvm_machine(
            "demo-cp-x7k2p",
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi"},
                   "etcdStorage": {"type": "hostPath", "hostPath": "/var/lib/capk/etcd"}}),
        )
    }

    /// The shipped allowlist.
    fn shipped() -> Vec<String> {
        vec![crate::settings::DEFAULT_ETCD_HOST_PATH_PREFIX.into()]
    }

    fn dir(node: &str, dir: &str) -> EtcdHostDir {
        EtcdHostDir {
            node: node.into(),
            dir: dir.into(),
            owner_uid: None,
        }
    }

    #[test]
    fn the_cleanup_pod_removes_the_machines_directory_on_its_node_and_nothing_else() {
        let km = km();
        let target = dir("mc-node-1", "/var/lib/capk/etcd/team-a/demo-cp-x7k2p")
            .removable(&km, &shipped())
            .unwrap();
        let since: Timestamp = "2026-11-23T10:00:00Z".parse().unwrap();
        let pod = cleanup_pod(
            &km,
            "demo",
            &management(),
            &target,
            "localhost/capk/capk-launcher:dev",
            &Attempt::first(since),
        );
        insta::assert_yaml_snapshot!(pod);
        let back = Attempt::of(&pod).unwrap();
        assert_eq!(back, Attempt::first(since));
        assert_eq!(back.next().number, 2);
        assert_eq!(back.next().since, since);
    }

    #[test]
    fn only_a_hostpath_volume_of_a_pod_on_a_node_is_recorded() {
        let pod = |spec: serde_json::Value| -> Pod {
            serde_json::from_value(json!({"metadata": {"name": "m"}, "spec": spec})).unwrap()
        };
        let host = json!({"name": "etcd", "hostPath": {"path": "/srv/etcd/team-a/m"}});
        assert_eq!(
            EtcdHostDir::of_pod(&pod(
                json!({"nodeName": "n1", "containers": [], "volumes": [host]})
            )),
            Some(dir("n1", "/srv/etcd/team-a/m"))
        );
        // Not scheduled: no node, nothing to clean.
        assert_eq!(
            EtcdHostDir::of_pod(&pod(json!({"containers": [], "volumes": [host]}))),
            None
        );
        for other in [
            json!({"name": "etcd", "emptyDir": {}}),
            json!({"name": "etcd", "persistentVolumeClaim": {"claimName": "m-etcd"}}),
            json!({"name": "hostvol-data", "hostPath": {"path": "/srv/data"}}),
        ] {
            let p = pod(json!({"nodeName": "n1", "containers": [], "volumes": [other]}));
            assert_eq!(EtcdHostDir::of_pod(&p), None, "{other}");
        }
    }

    #[test]
    fn the_owner_is_the_one_the_pod_was_made_for_even_after_a_move() {
        let mut km = km();
        km.metadata.uid = Some("2222".into());
        // Nothing recorded yet: the KVMMachine's own UID.
        assert_eq!(owner_of(&km).to_string(), "team-a/demo-cp-x7k2p/2222");
        // Its Pod names an older UID (it was made for the KVMMachine before `clusterctl move`
        // made this one): recorded from the Pod, and named again by Pods made again and by the
        // cleanup, since the marker in the directory says that UID.
        let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "demo-cp-x7k2p"},
            "spec": {"nodeName": "n1",
                "containers": [{"name": "launcher",
                    "args": ["--etcd-disk=/var/lib/capk/etcd/etcd.img",
                             "--etcd-owner=team-a/demo-cp-x7k2p/1111"]}],
                "volumes": [{"name": "etcd",
                    "hostPath": {"path": "/var/lib/capk/etcd/team-a/demo-cp-x7k2p"}}]}}))
        .unwrap();
        let seen = EtcdHostDir::of_pod(&pod).unwrap();
        assert_eq!(seen.owner_uid.as_deref(), Some("1111"));
        km.status = Some(capk_api::v1alpha1::KVMMachineStatus {
            etcd_host_dir: Some(seen.to_status()),
            ..Default::default()
        });
        assert_eq!(
            owner_of(&km).to_string(),
            "team-a/demo-cp-x7k2p/1111",
            "a Pod made again after a move would refuse its own data"
        );
        // The annotation names a place, not an owner: it still agrees with the record.
        assert!(
            seen.same_place(
                &EtcdHostDir::annotated(&{
                    let mut k = km.clone();
                    k.metadata.annotations = Some(BTreeMap::from([(
                        ETCD_HOST_DIR_ANNOTATION.to_owned(),
                        seen.annotation(),
                    )]));
                    k
                })
                .unwrap()
            )
        );
    }

    #[test]
    fn status_is_the_record_and_the_annotation_only_a_copy() {
        let mut km = km();
        let d = dir("mc-node-1", "/var/lib/capk/etcd/team-a/demo-cp-x7k2p");
        km.metadata.annotations = Some(BTreeMap::from([(
            ETCD_HOST_DIR_ANNOTATION.to_owned(),
            d.annotation(),
        )]));
        // The annotation alone (written by whoever edits the KVMMachine) records nothing.
        assert_eq!(EtcdHostDir::recorded(&km), None);
        assert_eq!(EtcdHostDir::annotated(&km), Some(d.clone()));
        km.status = Some(capk_api::v1alpha1::KVMMachineStatus {
            etcd_host_dir: Some(d.to_status()),
            ..Default::default()
        });
        assert_eq!(EtcdHostDir::recorded(&km), Some(d));
    }

    #[test]
    fn nothing_but_the_machines_own_plain_directory_is_removable() {
        let km = km();
        let ok = dir("mc-node-1", "/var/lib/capk/etcd/team-a/demo-cp-x7k2p")
            .removable(&km, &shipped())
            .unwrap();
        assert_eq!(ok.parent, "/var/lib/capk/etcd/team-a");
        assert_eq!(ok.path(), "/var/lib/capk/etcd/team-a/demo-cp-x7k2p");
        // hostPath "/": the parent is the namespace's directory, never "/".
        let everywhere = vec!["/".to_owned()];
        let root = dir("n", "/team-a/demo-cp-x7k2p")
            .removable(&km, &everywhere)
            .unwrap();
        assert_eq!(root.parent, "/team-a");
        // Outside the operator's directories: refused, whatever its last elements.
        for outside in [
            "/team-a/demo-cp-x7k2p",
            "/var/lib/kubelet/team-a/demo-cp-x7k2p",
        ] {
            let err = dir("n", outside).removable(&km, &shipped()).unwrap_err();
            assert!(
                err.contains("not in a directory the operator allows etcd data in"),
                "{outside}: {err}"
            );
        }
        for (bad, why) in [
            ("/", "not a plain path"),
            ("/var/lib/capk/etcd", "not the machine's own"),
            ("/var/lib/capk/etcd/team-a", "not the machine's own"),
            (
                "/var/lib/capk/etcd/team-b/demo-cp-x7k2p",
                "not the machine's own",
            ),
            ("/var/lib/capk/etcd/team-a/other", "not the machine's own"),
            ("/team-a/../team-a/demo-cp-x7k2p", "not a plain path"),
            ("/var/./team-a/demo-cp-x7k2p", "not a plain path"),
            ("/var//team-a/demo-cp-x7k2p", "not a plain path"),
            ("/var/team-a/demo-cp-x7k2p/", "not a plain path"),
            ("var/team-a/demo-cp-x7k2p", "not an absolute path"),
            ("", "not an absolute path"),
        ] {
            let err = dir("n", bad).removable(&km, &everywhere).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
        for node in ["", "Node", "a b", "n;rm", "-n", "n/1"] {
            let err = dir(node, "/team-a/demo-cp-x7k2p")
                .removable(&km, &everywhere)
                .unwrap_err();
            assert!(err.contains("not a node name"), "{node}: {err}");
        }
    }

    #[test]
    fn retries_back_off_and_the_cleanup_is_bounded() {
        let t0: Timestamp = "2026-11-23T10:00:00Z".parse().unwrap();
        let first = Attempt::first(t0);
        let waits: Vec<u64> = std::iter::successors(Some(first.clone()), |a| Some(a.next()))
            .take(7)
            .map(|a| a.backoff().as_secs())
            .collect();
        assert_eq!(waits, [5, 10, 20, 40, 80, 80, 80]);
        let at = |secs: i64| t0 + k8s_openapi::jiff::SignedDuration::from_secs(secs);
        assert!(!first.expired(at(599)));
        assert!(first.expired(at(601)));
        assert!(!first.expired(at(-700)), "a clock behind is not expiry");
    }

    #[test]
    fn only_a_lasting_refusal_gives_the_cleanup_up() {
        let status = |code: u16, causes: serde_json::Value| -> kube::core::Status {
            serde_json::from_value(json!({"status": "Failure", "code": code,
                "message": "pods \"m-etcd-cleanup\" is forbidden: violates PodSecurity",
                "details": {"causes": causes}}))
            .unwrap()
        };
        let terminating = json!([{"reason": "NamespaceTerminating",
            "message": "namespace team-a is being terminated", "field": "metadata.namespace"}]);
        let why = refusal(&status(403, terminating), "team-a").unwrap();
        assert!(why.contains("namespace team-a is being deleted"), "{why}");
        let why = refusal(&status(403, json!([])), "team-a").unwrap();
        assert!(
            why.contains("HTTP 403") && why.contains("PodSecurity"),
            "{why}"
        );
        assert!(refusal(&status(422, json!([])), "team-a").is_some());
        for passing in [409, 429, 500, 503] {
            assert_eq!(
                refusal(&status(passing, json!([])), "team-a"),
                None,
                "{passing}"
            );
        }
    }

    #[test]
    fn a_failure_says_why() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "m-etcd-cleanup"},
            "status": {"phase": "Failed", "containerStatuses": [{"name": "remove",
                "ready": false, "restartCount": 0, "image": "i", "imageID": "",
                "state": {"terminated": {"exitCode": 1,
                    "message": "rm: cannot remove 'x': Read-only file system\n",
                    "finishedAt": "2026-11-23T10:00:07Z"}}}]}}))
        .unwrap();
        assert_eq!(
            failure(&pod),
            "rm exited with code 1: rm: cannot remove 'x': Read-only file system"
        );
        assert_eq!(
            finished_at(&pod),
            Some("2026-11-23T10:00:07Z".parse().unwrap())
        );
        let deadline: Pod = serde_json::from_value(json!({
            "metadata": {"name": "m-etcd-cleanup"},
            "status": {"phase": "Failed", "reason": "DeadlineExceeded",
                       "message": "Pod was active on the node longer than the specified deadline"}}))
        .unwrap();
        assert!(failure(&deadline).starts_with("DeadlineExceeded: Pod was active"));
    }

    fn removable() -> RemovableDir {
        RemovableDir {
            node: "mc-node-1".into(),
            parent: "/var/lib/capk/etcd/team-a".into(),
            name: "demo-cp-x7k2p".into(),
        }
    }

    /// A cleanup Pod of `attempt` (first made at `since`) in `phase`, its container ended with
    /// `exit` at `finished`.
    fn cleanup(attempt: u32, since: &str, phase: &str, exit: Option<(i32, &str)>) -> Pod {
        let statuses = exit.map_or(json!([]), |(code, message)| {
            json!([{"name": "remove", "ready": false, "restartCount": 0, "image": "i",
                    "imageID": "", "state": {"terminated": {"exitCode": code,
                    "message": message, "finishedAt": "2026-11-23T10:00:10Z"}}}])
        });
        serde_json::from_value(json!({
            "metadata": {"name": "m-etcd-cleanup", "annotations": {
                ATTEMPT_ANNOTATION: attempt.to_string(), SINCE_ANNOTATION: since}},
            "status": {"phase": phase, "containerStatuses": statuses}}))
        .unwrap()
    }

    #[test]
    fn the_record_alone_names_what_is_removed() {
        let mut km = km();
        let d = dir("mc-node-1", "/var/lib/capk/etcd/team-a/demo-cp-x7k2p");
        assert_eq!(what_to_remove(&km, &shipped()), Ok(None));
        let annotate = |km: &mut KVMMachine, d: &EtcdHostDir| {
            km.metadata.annotations = Some(BTreeMap::from([(
                ETCD_HOST_DIR_ANNOTATION.to_owned(),
                d.annotation(),
            )]));
        };
        // An annotation alone removes nothing and is given up, naming what it names.
        annotate(&mut km, &d);
        let left = what_to_remove(&km, &shipped()).unwrap_err();
        assert_eq!(
            (left.node.as_str(), left.dir.as_str()),
            ("mc-node-1", d.dir.as_str())
        );
        assert!(left.why.starts_with("only the annotation"), "{}", left.why);
        // Recorded and annotated alike: removable.
        km.status = Some(capk_api::v1alpha1::KVMMachineStatus {
            etcd_host_dir: Some(d.to_status()),
            ..Default::default()
        });
        assert_eq!(what_to_remove(&km, &shipped()), Ok(Some(removable())));
        // The annotation moved elsewhere after the record: nothing removed, the record named.
        annotate(
            &mut km,
            &dir("mc-node-2", "/var/lib/capk/etcd/team-a/demo-cp-x7k2p"),
        );
        let left = what_to_remove(&km, &shipped()).unwrap_err();
        assert_eq!(left.node, "mc-node-1");
        assert!(left.why.contains("was changed to"), "{}", left.why);
        // Outside what the operator allows: left.
        annotate(&mut km, &d);
        let left = what_to_remove(&km, &["/srv/etcd".into()]).unwrap_err();
        assert_eq!(left.dir, d.dir);
    }

    #[test]
    fn the_cleanup_starts_waits_retries_and_ends() {
        let t0: Timestamp = "2026-11-23T10:00:00Z".parse().unwrap();
        let at = |secs: i64| t0 + SignedDuration::from_secs(secs);
        let since = "2026-11-23T10:00:00Z";
        let dir = removable();
        let next =
            |pod: Option<&Pod>, gone: bool, now| next(&dir, "m-etcd-cleanup", pod, gone, now);
        // No Pod yet: the first attempt, unless the node is gone.
        assert_eq!(next(None, false, t0), Next::Start(Attempt::first(t0), None));
        assert!(
            matches!(next(None, true, t0), Next::GiveUp(w) if w == "node mc-node-1 no longer exists")
        );
        // At work.
        let running = cleanup(1, since, "Running", None);
        assert!(
            matches!(next(Some(&running), false, at(5)), Next::Running(m) if m.contains("(phase Running)"))
        );
        assert!(matches!(next(Some(&running), true, at(5)), Next::GiveUp(_)));
        // Done.
        let done = cleanup(1, since, "Succeeded", Some((0, "")));
        assert_eq!(next(Some(&done), true, at(5)), Next::Removed);
        // Refused by the launcher: for good, whatever the time.
        let code = capk_api::etcd_owner::CLEANUP_REFUSED_EXIT_CODE;
        let refused = cleanup(
            1,
            since,
            "Failed",
            Some((code, "EtcdCleanupRefused: marker names team-b/x/u")),
        );
        assert_eq!(
            next(Some(&refused), false, at(5)),
            Next::Refused("marker names team-b/x/u".into())
        );
        // Failed: the back-off (5 s after the first) runs from when it ended (10 s), then the
        // next attempt, the failed one's message carried along.
        let failed = cleanup(1, since, "Failed", Some((1, "rm: busy")));
        let Next::BackOff(f) = next(Some(&failed), false, at(12)) else {
            panic!()
        };
        assert_eq!(
            (f.attempt.number, f.wait, f.label()),
            (1, Duration::from_secs(3), "attempt 1".into())
        );
        assert_eq!(
            f.message,
            "attempt 1 to remove /var/lib/capk/etcd/team-a/demo-cp-x7k2p on node mc-node-1 failed: rm exited with code 1: rm: busy"
        );
        let Next::Start(a, Some(f)) = next(Some(&failed), false, at(15)) else {
            panic!()
        };
        assert_eq!((a.number, a.since, f.wait), (2, t0, Duration::ZERO));
        // Tried for longer than the bound: given up.
        let late = at(GIVE_UP_AFTER.as_secs() as i64 + 1);
        assert!(
            matches!(next(Some(&failed), false, late), Next::GiveUp(w) if w.contains("did not succeed within 10 minutes"))
        );
    }
}
