//! The reconciler's writes to the KVMMachine itself: the one status write ([`status`], built by
//! [`super::status`]), one merge patch of clusterctl's block-move annotation, the etcd
//! directory's annotation and `spec.providerID` ([`patch_machine`]), and the record of where
//! the machine Pod keeps its etcd data, made and forgotten by the deletion ([`record_etcd_dir`],
//! [`forget_etcd_dir`]).

use capk_api::{
    constants::{BLOCK_MOVE_ANNOTATION, provider_id},
    v1alpha1::KVMMachine,
};
use k8s_openapi::jiff::Timestamp;
use kube::{Api, ResourceExt};
use serde_json::json;

use super::{
    etcd_cleanup::{self, EtcdHostDir},
    status::{self, MachineState},
};
use crate::{
    k8s::conditions::DesiredCondition,
    k8s::objects,
    runtime::error::{Error, Result},
};

/// The one status write: `state` with the Pod's conditions, and where the machine Pod keeps
/// its etcd data when `etcd` says, and the machine Pod's namespace when `pod_namespace` says
/// (otherwise what status recorded stays).
pub async fn status(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    state: &MachineState,
    pod: &[DesiredCondition],
    failure_domain: Option<&str>,
    etcd: Option<&EtcdHostDir>,
    pod_namespace: Option<&str>,
) -> Result<()> {
    objects::write_status(
        api,
        km,
        |k| k.status.as_ref(),
        |k| {
            let mut s = status::status(k, state, pod, failure_domain, Timestamp::now());
            if let Some(etcd) = etcd {
                s.etcd_host_dir = Some(etcd.to_status());
            }
            if let Some(ns) = pod_namespace {
                s.pod_namespace = Some(ns.to_owned());
            }
            s
        },
    )
    .await
}

/// One merge patch of the KVMMachine: clusterctl's block-move annotation set or removed (set
/// while a Pod is being created and while it lives in the management cluster), where the machine Pod keeps its etcd data (`etcd`, once it is on a
/// node), and `spec.providerID` when it has none. Nothing to change, no request. Returns the
/// patched object, if patched.
pub async fn patch_machine(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    block: bool,
    etcd: Option<&EtcdHostDir>,
) -> Result<Option<KVMMachine>> {
    let ns = km.namespace().ok_or(Error::MissingNamespace)?;
    let mut patch = json!({});
    let mut annotations = serde_json::Map::new();
    if km.annotations().contains_key(BLOCK_MOVE_ANNOTATION) != block {
        annotations.insert(BLOCK_MOVE_ANNOTATION.into(), json!(block.then_some("true")));
    }
    if let Some(etcd) =
        etcd.filter(|e| !EtcdHostDir::annotated(km).is_some_and(|a| a.same_place(e)))
    {
        annotations.insert(
            etcd_cleanup::ETCD_HOST_DIR_ANNOTATION.into(),
            json!(etcd.annotation()),
        );
    }
    if !annotations.is_empty() {
        patch["metadata"] = json!({ "annotations": annotations });
    }
    if km.spec.provider_id.is_none() {
        patch["spec"] = json!({"providerID": provider_id(&ns, &km.name_any())});
    }
    if patch == json!({}) {
        return Ok(None);
    }
    let patched = objects::merge_patch(api, km, "KVMMachine", &patch).await?;
    Ok(Some(patched))
}

/// Records where the machine Pod keeps its etcd data in the KVMMachine's status (the record
/// the cleanup trusts) and, for people and `clusterctl move`, in its annotation.
pub async fn record_etcd_dir(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    etcd: &EtcdHostDir,
) -> Result<()> {
    if EtcdHostDir::recorded(km).as_ref() != Some(etcd) {
        objects::write_status(
            api,
            km,
            |k| k.status.as_ref(),
            |k| capk_api::v1alpha1::KVMMachineStatus {
                etcd_host_dir: Some(etcd.to_status()),
                ..k.status.clone().unwrap_or_default()
            },
        )
        .await?;
    }
    if !EtcdHostDir::annotated(km).is_some_and(|a| a.same_place(etcd)) {
        let patch = json!({"metadata": {"annotations": {
            etcd_cleanup::ETCD_HOST_DIR_ANNOTATION: etcd.annotation()}}});
        objects::merge_patch(api, km, "KVMMachine", &patch).await?;
    }
    Ok(())
}

/// Removes the record of the etcd data's directory from the KVMMachine: the cleanup is over
/// (done or given up), and a reconcile that comes after it (from a cache that still shows the
/// finalizer) finds nothing to do.
pub async fn forget_etcd_dir(api: &Api<KVMMachine>, km: &KVMMachine) -> Result<()> {
    if EtcdHostDir::recorded(km).is_some() {
        objects::write_status(
            api,
            km,
            |k| k.status.as_ref(),
            |k| capk_api::v1alpha1::KVMMachineStatus {
                etcd_host_dir: None,
                ..k.status.clone().unwrap_or_default()
            },
        )
        .await?;
    }
    if EtcdHostDir::annotated(km).is_some() {
        let patch =
            json!({"metadata": {"annotations": {etcd_cleanup::ETCD_HOST_DIR_ANNOTATION: null}}});
        objects::merge_patch(api, km, "KVMMachine", &patch).await?;
    }
    Ok(())
}
