//! What both reconcilers do the same way: find their CAPI owner, write status only when it
//! changes, delete what they own, and turn a failed step into a metric, a log line and a Warning
//! Event.

use std::fmt::Debug;

use kube::{
    Api, Resource, ResourceExt,
    api::{DeleteParams, Patch, PatchParams},
    runtime::events::{Event, EventType},
};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::{
    context::{Context, FIELD_MANAGER},
    error::{Error, Result},
};

/// The name of the Cluster API object of `kind` (`Cluster`, `Machine`) that owns `obj`.
pub fn capi_owner<K: Resource>(obj: &K, kind: &str) -> Option<String> {
    obj.owner_references()
        .iter()
        .find(|o| o.kind == kind && o.api_version.starts_with("cluster.x-k8s.io/"))
        .map(|o| o.name.clone())
}

/// The longest Event note the apiserver accepts, in bytes.
pub const MAX_EVENT_NOTE_BYTES: usize = 1024;

/// Publishes an Event about `obj` (best effort: Events never fail a reconcile). The note is cut
/// to what the apiserver accepts, so a long error still makes an Event.
pub async fn publish<K>(ctx: &Context, obj: &K, type_: EventType, reason: &str, note: String)
where
    K: Resource<DynamicType = ()>,
{
    let ev = Event {
        type_,
        reason: reason.into(),
        note: Some(crate::redact::cap(&note, MAX_EVENT_NOTE_BYTES)),
        action: "Reconcile".into(),
        secondary: None,
    };
    let _ = ctx.recorder.publish(&ev, &obj.object_ref(&())).await;
}

/// Records a reconcile's outcome: it is counted (controller-runtime's result, the object's
/// gauges), and a failure is also counted by category, logged and published as an Event whose
/// reason is the category.
pub async fn outcome<K>(
    ctx: &Context,
    kind: &'static str,
    obj: &K,
    result: Result<kube::runtime::controller::Action>,
) -> Result<kube::runtime::controller::Action>
where
    K: Resource<DynamicType = ()> + crate::metrics::ObjectState,
{
    ctx.metrics.finished(kind, &result);
    // A deleting object whose reconcile succeeded has had its finalizer removed: it is gone.
    let gone = obj.meta().deletion_timestamp.is_some() && result.is_ok();
    ctx.metrics
        .object(kind, obj.meta(), obj.provisioned(), gone);
    if result.is_ok() {
        let key = crate::backoff::key(kind, obj.meta().namespace.as_deref(), &obj.name_any());
        ctx.backoff.succeeded(&key);
    }
    if let Err(e) = &result {
        ctx.metrics.failed(kind, e.category());
        if e.is_conflict() {
            // Someone else wrote the object first; the retry reads the new version.
            debug!(error = %e, "reconcile lost a write race; retrying");
        } else if e.is_object_gone() {
            debug!(error = %e, "the object was deleted while it was reconciled");
        } else if e.is_waiting() {
            info!(error = %e, "reconcile waits");
        } else {
            warn!(error = %e, "reconcile failed");
            // Servers' answers are quoted in the error, and a tenant's cluster may be the
            // server: the Event shows them like other untrusted text.
            let note = crate::redact::untrusted_message(&e.to_string());
            publish(ctx, obj, EventType::Warning, e.category(), note).await;
        }
    }
    result
}

/// Runs `reconcile` within [`crate::backoff::RECONCILE_DEADLINE`]; one that takes longer is
/// abandoned as [`Error::Deadline`] (and retried with back-off).
pub async fn within_deadline<T>(
    reconcile: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let deadline = crate::backoff::RECONCILE_DEADLINE;
    tokio::time::timeout(deadline, reconcile)
        .await
        .unwrap_or(Err(Error::Deadline(deadline)))
}

/// The wait before the next reconcile of `obj` after `error`: what the step asked for, else
/// the object's back-off ([`crate::backoff`]).
pub fn requeue_after<K: Resource>(
    ctx: &Context,
    kind: &str,
    obj: &K,
    error: &Error,
) -> kube::runtime::controller::Action {
    let after = error.retry_after().unwrap_or_else(|| {
        let key = crate::backoff::key(kind, obj.meta().namespace.as_deref(), &obj.name_any());
        ctx.backoff.failed(&key)
    });
    kube::runtime::controller::Action::requeue(after)
}

/// A JSON merge patch of `obj` by the controller's field manager; returns the patched object.
pub async fn merge_patch<K>(
    api: &Api<K>,
    obj: &K,
    kind: &'static str,
    patch: &serde_json::Value,
) -> Result<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    api.patch(
        &obj.name_any(),
        &PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        },
        &Patch::Merge(patch),
    )
    .await
    .map_err(|source| Error::Apply {
        kind,
        name: obj.name_any(),
        source,
    })
}

/// Writes `desired_for(obj)` as the status, only when it differs from the stored status. The
/// watch cache can lag behind our own last write, so the decision is made again on the stored
/// object: a stale copy never causes a redundant write.
pub async fn write_status<K, S>(
    api: &Api<K>,
    obj: &K,
    status_of: impl Fn(&K) -> Option<&S>,
    desired_for: impl Fn(&K) -> S,
) -> Result<()>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
    S: PartialEq + Serialize,
{
    if status_of(obj) == Some(&desired_for(obj)) {
        return Ok(());
    }
    let name = obj.name_any();
    let fresh = api.get_status(&name).await.map_err(Error::UpdateStatus)?;
    let desired = desired_for(&fresh);
    if status_of(&fresh) == Some(&desired) {
        return Ok(());
    }
    let patch = json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": desired,
    });
    api.patch_status(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(Error::UpdateStatus)?;
    Ok(())
}

/// Deletes `kind` `name` through `api`; already gone (404) counts as done.
pub async fn delete_if_present<K>(api: &Api<K>, kind: &'static str, name: &str) -> Result<()>
where
    K: Clone + DeserializeOwned + Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(source) => Err(Error::Delete {
            kind,
            name: name.to_owned(),
            source,
        }),
    }
}
