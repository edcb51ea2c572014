//! Deletion of a KVMMachine, top to bottom in [`delete`]: the machine Pod is deleted first (the
//! launcher shuts the guest down by ACPI) and waited for, then the Ignition Secret and the etcd
//! PVC, wherever they live and only when they are this machine's; last its etcd data is removed
//! from the MC node the machine Pod ran on ([`remove_etcd_data`], the I/O half of
//! [`etcd_cleanup`], whose pure half says which directory, which Pod and when to give up).

use std::time::Duration;

use capk_api::{constants::CONDITION_HOSTING_CLUSTER_AVAILABLE, v1alpha1::KVMMachine};
use k8s_openapi::{
    api::core::v1::{Node, PersistentVolumeClaim, Pod, Secret},
    jiff::Timestamp,
};
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, PostParams},
    runtime::{controller::Action, events::EventType},
};
use tracing::{info, warn};

use super::{
    etcd_cleanup::{self, Attempt, EtcdHostDir, Failed, Next, RemovableDir},
    names::MachineNames,
    status::{MachineState, has_ready_reason},
    writes,
};
use crate::{
    k8s::objects::{self, read_error},
    k8s::ownership::{self, Owner},
    remote::hosting::{Target, Unavailable},
    runtime::context::Context,
    runtime::error::{Error, Result},
    runtime::outcome,
};

/// Deletes the Pod (the launcher shuts the guest down by ACPI), then the Secret and the etcd
/// PVC, wherever they live (`there`) and only when they are this machine's, then its etcd data
/// on the MC node ([`remove_etcd_data`]); the finalizer goes once the Pod is gone so no VM
/// outlives its KVMMachine. A hosting cluster that cannot be reached holds the finalizer (and
/// says so) until it can.
pub async fn delete(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    there: std::result::Result<Target, Unavailable>,
    ctx: &Context,
) -> Result<Action> {
    let there = match there {
        Ok(t) => t,
        Err(u) => {
            let state =
                MachineState::HostingUnavailable(u.condition(CONDITION_HOSTING_CLUSTER_AVAILABLE));
            writes::status(
                api,
                km,
                &state,
                &[u.condition(CONDITION_HOSTING_CLUSTER_AVAILABLE)],
                None,
                None,
                None,
            )
            .await?;
            return Err(Error::HostingUnavailable(u.message));
        }
    };
    let owner = Owner::machine(km);
    let pods: Api<Pod> = there.api();
    let names = MachineNames::in_home(km, &there.home);
    delete_pod(api, km, &pods, &names.pod, &owner, &there).await?;
    let secrets: Api<Secret> = there.api();
    let pvcs: Api<PersistentVolumeClaim> = there.api();
    objects::delete_if_owned(&secrets, "Secret", &names.ignition_secret, &owner).await?;
    let claim = &names.etcd_claim;
    objects::delete_if_owned(&pvcs, "PersistentVolumeClaim", claim, &owner).await?;
    remove_etcd_data(api, km, &there, ctx).await
}

/// Deletes machine Pod `name` when it is this machine's, and fails until it is gone (the
/// launcher shuts the guest down meanwhile).
async fn delete_pod(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    pods: &Api<Pod>,
    name: &str,
    owner: &Owner,
    there: &Target,
) -> Result<()> {
    let pod = pods.get_opt(name).await.map_err(read_error("Pod", name))?;
    match pod {
        Some(pod) if owner.owns(&pod.metadata) => {
            // Where its etcd data is, recorded before the Pod goes (if apply has not yet). A
            // record made is left as it is: the annotation is no longer set back, so an edit of
            // it during the deletion stops the cleanup ([`remove_etcd_data`]).
            if let Some(etcd) = EtcdHostDir::of_pod(&pod)
                && EtcdHostDir::recorded(km).is_none()
            {
                writes::record_etcd_dir(api, km, &etcd).await?;
            }
            if pod.metadata.deletion_timestamp.is_none() {
                pods.delete(name, &DeleteParams::default())
                    .await
                    .map_err(|source| Error::Delete {
                        kind: "Pod",
                        name: name.to_owned(),
                        source,
                    })?;
            }
            // The Pod's deletion event wakes us; the requeue is a safety net.
            Err(Error::PodStillTerminating(name.to_owned()))
        }
        Some(_) => {
            warn!(pod = %name, place = %there.describe(), "not deleting a Pod that belongs to someone else");
            Ok(())
        }
        None => Ok(()),
    }
}

/// Condition reason and Event reason: the cleanup Pod removes the etcd data.
pub const REASON_REMOVING_ETCD_DATA: &str = "RemovingEtcdData";
/// Warning Event and condition reason: a cleanup Pod failed; another follows after a back-off.
pub const REASON_ETCD_CLEANUP_FAILED: &str = "EtcdCleanupFailed";
/// Normal Event: the etcd data is gone from the MC node.
pub const REASON_ETCD_DATA_REMOVED: &str = "EtcdDataRemoved";
/// Warning Event: the cleanup Pod refused the directory (its owner marker does not name this
/// KVMMachine's UID): nothing was removed, and the deletion goes on.
pub const REASON_ETCD_CLEANUP_REFUSED: &str = capk_api::etcd_owner::REASON_CLEANUP_REFUSED;
/// Warning Event: the etcd data could not be removed and is left on the MC node.
pub const REASON_ETCD_DATA_LEFT: &str = "EtcdDataLeft";

/// Removes the machine's etcd data from the MC node its machine Pod ran on (hostPath etcd
/// storage only: where [`EtcdHostDir`] was recorded) by a cleanup Pod on that node, in the
/// machine Pod's cluster and namespace ([`etcd_cleanup`]). `Ok` (the finalizer goes) once the
/// cleanup Pod succeeded, when there is nothing to remove, or when the cleanup is given up (the
/// node is gone, [`etcd_cleanup::GIVE_UP_AFTER`] passed): then a Warning Event names the
/// directory left and its node. A failed cleanup Pod is a Warning Event and the `Ready` reason,
/// and is made again after a back-off.
async fn remove_etcd_data(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    there: &Target,
    ctx: &Context,
) -> Result<Action> {
    let done = Ok(Action::await_change());
    // Read afresh: the cache may not show the record made just before the machine Pod was
    // deleted, nor that an earlier reconcile finished (and forgot) the cleanup, after which a
    // missing cleanup Pod must not be made again.
    let Some(fresh) = api
        .get_opt(&km.name_any())
        .await
        .map_err(read_error("KVMMachine", &km.name_any()))?
    else {
        return done;
    };
    let km = &fresh;
    let allowed = &ctx.settings.tenant_policy.etcd_host_path_prefixes;
    let dir = match etcd_cleanup::what_to_remove(km, allowed) {
        Ok(Some(dir)) => dir,
        Ok(None) => return done,
        Err(left) => {
            writes::forget_etcd_dir(api, km).await?;
            give_up(ctx, km, &left.node, &left.dir, &left.why).await;
            return done;
        }
    };
    let pods: Api<Pod> = there.api();
    let (name, existing) = cleanup_pod_of(km, &pods, there).await?;
    let node_gone = node_gone(&there.client, &dir.node).await;
    let next = etcd_cleanup::next(&dir, &name, existing.as_ref(), node_gone, Timestamp::now());
    match next {
        Next::Removed => {
            objects::delete_if_present(&pods, "Pod", &name).await?;
            writes::forget_etcd_dir(api, km).await?;
            let note = format!("removed {} on node {}", dir.path(), dir.node);
            info!(node = %dir.node, dir = %dir.path(), "etcd data removed");
            outcome::publish(ctx, km, EventType::Normal, REASON_ETCD_DATA_REMOVED, note).await;
            done
        }
        Next::Refused(why) => {
            objects::delete_if_present(&pods, "Pod", &name).await?;
            writes::forget_etcd_dir(api, km).await?;
            let (node, path) = (&dir.node, dir.path());
            let note = format!(
                "etcd data left on node {node} in {path}: the cleanup refused it: {why}; nothing \
                 was removed"
            );
            warn!(node = %node, dir = %path, reason = %why, "etcd cleanup refused");
            let reason = REASON_ETCD_CLEANUP_REFUSED;
            outcome::publish(ctx, km, EventType::Warning, reason, note).await;
            done
        }
        Next::GiveUp(why) => {
            objects::delete_if_present(&pods, "Pod", &name).await?;
            writes::forget_etcd_dir(api, km).await?;
            give_up(ctx, km, &dir.node, &dir.path(), &why).await;
            done
        }
        Next::Running(message) => {
            // Its changes wake us; the requeue is a safety net.
            let retry = Duration::from_secs(10);
            Err(Error::EtcdCleanupPending { message, retry })
        }
        Next::BackOff(failed) => {
            report_failure(api, km, ctx, &failed).await?;
            let (message, retry) = (failed.message, failed.wait);
            Err(Error::EtcdCleanupPending { message, retry })
        }
        Next::Start(attempt, failed) => {
            if let Some(failed) = &failed {
                report_failure(api, km, ctx, failed).await?;
                // A terminated Pod is deleted at once: its name is free again.
                objects::delete_if_present(&pods, "Pod", &name).await?;
            }
            let previous = failed.as_ref().map(|f| f.message.as_str());
            create_cleanup_pod(api, km, there, ctx, &dir, &attempt, previous).await
        }
    }
}

/// A failed cleanup Pod, reported once per attempt: a Warning Event and the `Ready` reason.
async fn report_failure(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    ctx: &Context,
    failed: &Failed,
) -> Result<()> {
    let reason = REASON_ETCD_CLEANUP_FAILED;
    if has_ready_reason(km, reason, &failed.label()) {
        return Ok(());
    }
    let backoff = failed.attempt.backoff().as_secs();
    let note = format!("{}; retrying in {backoff}s", failed.message);
    outcome::publish(ctx, km, EventType::Warning, reason, note).await;
    let message = failed.message.clone();
    let state = MachineState::Deleting { reason, message };
    writes::status(api, km, &state, &[], None, None, None).await
}

/// The machine's cleanup Pod in `there`, and its name: none yet while nothing of that name is
/// there. Someone else's Pod of that name stops the cleanup.
async fn cleanup_pod_of(
    km: &KVMMachine,
    pods: &Api<Pod>,
    there: &Target,
) -> Result<(String, Option<Pod>)> {
    let name = MachineNames::in_home(km, &there.home).etcd_cleanup_pod;
    match pods
        .get_opt(&name)
        .await
        .map_err(read_error("Pod", &name))?
    {
        Some(p) if Owner::machine(km).owns(&p.metadata) => Ok((name, Some(p))),
        Some(_) => Err(Error::Foreign {
            kind: "Pod",
            name,
            place: there.describe(),
        }),
        None => Ok((name, None)),
    }
}

/// Creates cleanup Pod attempt `attempt` and says so in `Ready` (with why the one before
/// failed). Its namespace being deleted (no Pod can be made there any more) gives the cleanup
/// up.
async fn create_cleanup_pod(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    there: &Target,
    ctx: &Context,
    dir: &RemovableDir,
    attempt: &Attempt,
    previous_failure: Option<&str>,
) -> Result<Action> {
    let cluster = ownership::cluster_of(km).unwrap_or_default();
    let image = &ctx.settings.machine_defaults.launcher_image;
    let pod = etcd_cleanup::cleanup_pod(km, &cluster, &there.home, dir, image, attempt);
    let name = pod.name_any();
    let pods: Api<Pod> = there.api();
    match pods.create(&PostParams::default(), &pod).await {
        Ok(_) => {}
        // Made meanwhile (a second reconcile): it is looked at next time.
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        // Refused for good (the namespace is being deleted, admission, quota, RBAC): retrying
        // would hold the deletion forever.
        Err(kube::Error::Api(s)) if etcd_cleanup::refusal(&s, &there.home.namespace).is_some() => {
            let why = etcd_cleanup::refusal(&s, &there.home.namespace).unwrap_or_default();
            writes::forget_etcd_dir(api, km).await?;
            give_up(ctx, km, &dir.node, &dir.path(), &why).await;
            return Ok(Action::await_change());
        }
        Err(source) => {
            return Err(Error::Apply {
                kind: "Pod",
                name,
                source,
            });
        }
    }
    info!(pod = %name, node = %dir.node, dir = %dir.path(), attempt = attempt.number, "removing etcd data");
    let message = format!(
        "cleanup Pod {name} removes {} on node {} (attempt {}{})",
        dir.path(),
        dir.node,
        attempt.number,
        previous_failure
            .map(|f| format!("; {f}"))
            .unwrap_or_default()
    );
    let state = MachineState::Deleting {
        reason: REASON_REMOVING_ETCD_DATA,
        message: message.clone(),
    };
    writes::status(api, km, &state, &[], None, None, None).await?;
    Err(Error::EtcdCleanupPending {
        message,
        retry: Duration::from_secs(10),
    })
}

/// Whether Node `name` is known not to exist. Unknown (a hosting cluster's credential may not
/// read Nodes, a failed request) is not gone: the time bound decides then.
async fn node_gone(client: &kube::Client, name: &str) -> bool {
    match Api::<Node>::all(client.clone())
        .get_metadata_opt(name)
        .await
    {
        Ok(found) => found.is_none(),
        Err(e) => {
            tracing::debug!(node = %name, error = %e, "cannot tell whether the node exists");
            false
        }
    }
}

/// Gives the etcd data cleanup up: a Warning Event names the directory left and its node.
async fn give_up(ctx: &Context, km: &KVMMachine, node: &str, dir: &str, why: &str) {
    let note = format!(
        "etcd data left on node {node} in {dir}: {why}; remove that directory on the node by hand"
    );
    warn!(node, dir, reason = why, "etcd data left on the node");
    outcome::publish(ctx, km, EventType::Warning, REASON_ETCD_DATA_LEFT, note).await;
}
