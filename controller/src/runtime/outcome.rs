//! What every reconciler does the same way around a reconcile: run it as an active worker
//! within its deadline, publish Events, turn its outcome into a metric, a log line, a Warning
//! Event and the wait before the next one, and take what its controller yields. (Their writes
//! are in [`crate::k8s::objects`].)

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{
    Resource, ResourceExt,
    runtime::{
        controller,
        events::{Event, EventType},
        reflector::ObjectRef,
    },
};
use tracing::{debug, info, warn};

use crate::{
    metrics::Metrics,
    runtime::backoff::ReconcileBackoff,
    runtime::context::Context,
    runtime::error::{Error, Result},
};

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
        note: Some(crate::remote::redact::cap(&note, MAX_EVENT_NOTE_BYTES)),
        action: "Reconcile".into(),
        secondary: None,
    };
    let _ = ctx.recorder.publish(&ev, &obj.object_ref(&())).await;
}

/// Runs one reconcile of `obj`, a `kind`: an active worker while it runs, abandoned after the
/// deadline ([`within_deadline`]), its outcome recorded ([`outcome`]).
pub async fn reconciled<K>(
    ctx: &Context,
    kind: &'static str,
    obj: &K,
    reconcile: impl std::future::Future<Output = Result<kube::runtime::controller::Action>>,
) -> Result<kube::runtime::controller::Action>
where
    K: Resource<DynamicType = ()> + crate::metrics::ObjectState,
{
    let _timer = ctx.metrics.start(kind);
    let result = within_deadline(reconcile).await;
    outcome(ctx, kind, obj, result).await
}

/// Records a reconcile's outcome: it is counted (controller-runtime's result, the object's
/// gauges), and a failure is also counted by category, logged and published as an Event whose
/// reason is the category.
async fn outcome<K>(
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
            let text = e.to_string();
            let note = if e.is_own_words() {
                crate::remote::redact::cap(&text, crate::remote::redact::MAX_MESSAGE_BYTES)
            } else {
                crate::remote::redact::untrusted_message(&text)
            };
            publish(ctx, obj, EventType::Warning, e.category(), note).await;
        }
    }
    result
}

/// Runs `reconcile` within [`crate::runtime::backoff::RECONCILE_DEADLINE`]; one that takes longer is
/// abandoned as [`Error::Deadline`] (and retried with back-off).
async fn within_deadline<T>(reconcile: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    let deadline = crate::runtime::backoff::RECONCILE_DEADLINE;
    tokio::time::timeout(deadline, reconcile)
        .await
        .unwrap_or(Err(Error::Deadline(deadline)))
}

/// The wait before the next reconcile of `obj` after `error`: what the step asked for, else
/// the object's back-off ([`crate::runtime::backoff`]).
pub fn requeue_after<K: Resource>(
    ctx: &Context,
    kind: &str,
    obj: &K,
    error: &Error,
) -> kube::runtime::controller::Action {
    let after = error.retry_after().unwrap_or_else(|| {
        let key =
            crate::runtime::backoff::key(kind, obj.meta().namespace.as_deref(), &obj.name_any());
        ctx.backoff.failed(&key)
    });
    kube::runtime::controller::Action::requeue(after)
}

/// Takes what a controller yields for one reconcile request of a `kind` object. A request for an
/// object that is no longer in the controller's cache ([`controller::Error::ObjectNotFound`]:
/// the watch saw it deleted, or a back-off timer outlived it) means the object is gone, maybe
/// without a reconcile that saw its deletion finish (`clusterctl move` pauses, strips the
/// finalizer and deletes; a failed last reconcile leaves a back-off behind): its back-off
/// entry and its per-object series are dropped, so neither outlives it, the series cannot
/// keep an alert firing for a machine that has moved away, and a later object of the same
/// name starts with a clean record.
pub fn finished<K, ReconcileErr, QueueErr>(
    backoff: &ReconcileBackoff,
    metrics: &Metrics,
    kind: &'static str,
    result: std::result::Result<
        (ObjectRef<K>, kube::runtime::controller::Action),
        controller::Error<ReconcileErr, QueueErr>,
    >,
) where
    K: Resource,
    ReconcileErr: std::error::Error + 'static,
    QueueErr: std::error::Error + 'static,
{
    let key = |obj: &ObjectRef<_>| {
        crate::runtime::backoff::key(kind, obj.namespace.as_deref(), &obj.name)
    };
    match result {
        Ok((obj, _)) => {
            debug!(kind, object = %obj, "reconciled");
            backoff.succeeded(&key(&obj.erase()));
        }
        Err(controller::Error::ObjectNotFound(obj)) => {
            debug!(kind, object = %obj, "gone: its back-off and series are dropped");
            backoff.forget(&key(&obj));
            let meta = ObjectMeta {
                name: Some(obj.name.clone()),
                namespace: obj.namespace.clone(),
                ..Default::default()
            };
            metrics.object(kind, &meta, false, true);
        }
        Err(e) => warn!(kind, error = %e, "reconcile error"),
    }
}

/// Runs a controller of `kind` objects until it stops, taking each result it yields
/// ([`finished`]).
pub async fn finish_each<K, ReconcileErr, QueueErr>(
    results: impl futures::Stream<
        Item = std::result::Result<
            (ObjectRef<K>, kube::runtime::controller::Action),
            controller::Error<ReconcileErr, QueueErr>,
        >,
    >,
    ctx: &Context,
    kind: &'static str,
) where
    K: Resource,
    ReconcileErr: std::error::Error + 'static,
    QueueErr: std::error::Error + 'static,
{
    use futures::StreamExt;
    results
        .for_each(|result| {
            finished(&ctx.backoff, &ctx.metrics, kind, result);
            futures::future::ready(())
        })
        .await
}

#[cfg(test)]
mod tests {
    use capk_api::v1alpha1::KVMMachine;
    use kube::runtime::{controller::Action, watcher};

    use super::*;
    use crate::runtime::backoff::{FIRST, key};

    type Outcome = std::result::Result<
        (ObjectRef<KVMMachine>, Action),
        controller::Error<Error, watcher::Error>,
    >;

    #[test]
    fn a_gone_object_leaves_no_back_off_and_no_series_and_a_success_resets_its_wait() {
        let (backoff, metrics) = (ReconcileBackoff::default(), Metrics::default());
        let meta = |name: &str| ObjectMeta {
            name: Some(name.into()),
            namespace: Some("team-a".into()),
            ..Default::default()
        };
        let series = |name: &str| {
            format!(
                "capk_object_provisioned{{kind=\"KVMMachine\",namespace=\"team-a\",name=\"{name}\"}} 0"
            )
        };
        for name in ["moved", "failing"] {
            metrics.object("KVMMachine", &meta(name), false, false);
            backoff.failed(&key("KVMMachine", Some("team-a"), name));
            backoff.failed(&key("KVMMachine", Some("team-a"), name));
        }
        assert!(metrics.render().contains(&series("moved")));

        let gone = ObjectRef::<KVMMachine>::new("moved").within("team-a");
        let not_found: Outcome = Err(controller::Error::ObjectNotFound(Box::new(gone.erase())));
        finished(&backoff, &metrics, "KVMMachine", not_found);
        assert_eq!(
            backoff.objects(),
            1,
            "only the failing machine has a record"
        );
        let text = metrics.render();
        assert!(!text.contains("name=\"moved\""), "{text}");
        assert!(text.contains(&series("failing")), "{text}");

        let failing = ObjectRef::<KVMMachine>::new("failing").within("team-a");
        let ok: Outcome = Ok((failing, Action::await_change()));
        finished(&backoff, &metrics, "KVMMachine", ok);
        assert_eq!(backoff.objects(), 0);
        assert_eq!(
            backoff.failed(&key("KVMMachine", Some("team-a"), "failing")),
            FIRST
        );
    }
}
