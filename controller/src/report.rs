//! What both reconcilers do the same way around a reconcile: find their CAPI owner, publish
//! Events, bound a reconcile's time, and turn its outcome into a metric, a log line, a Warning
//! Event and the wait before the next one. (Their writes are in [`crate::objects`].)

use kube::{
    Resource, ResourceExt,
    runtime::events::{Event, EventType},
};
use tracing::{debug, info, warn};

use crate::{
    context::Context,
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
