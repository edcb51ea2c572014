//! KVMCluster reconciler: fetch → probe the control-plane apiservers
//! ([`crate::apiserver_health`]) → build (pure, in [`build`] and [`endpoints`]) → apply → status.

pub mod build;
pub mod endpoints;

use std::{net::SocketAddr, sync::Arc, time::Duration};

use capk_api::{
    capi::Cluster,
    constants::{
        API_SERVER_PORT, CLUSTER_NAME_LABEL, KVMCLUSTER_FINALIZER, MACHINE_ROLE_LABEL,
        PAUSED_ANNOTATION, ROLE_CONTROL_PLANE, control_plane_service_name,
    },
    v1alpha1::KVMCluster,
};
use k8s_openapi::{
    api::{
        core::v1::{Endpoints, Pod, Service},
        discovery::v1::EndpointSlice,
    },
    jiff::Timestamp,
};
use kube::{
    Api, Resource, ResourceExt,
    api::{ListParams, Patch, PatchParams},
    runtime::{
        controller::Action,
        events::EventType,
        finalizer::{Event as Finalizer, finalizer},
        reflector::{ObjectRef, Store},
    },
};
use serde_json::json;
use tracing::{info, instrument, warn};

use self::{
    build::ClusterState,
    endpoints::{ControlPlaneMember, SERVICE_NAME_LABEL},
};
use crate::{
    apiserver_health::{self, EndpointHealth},
    conditions::DesiredCondition,
    context::{Context, FIELD_MANAGER},
    error::{Error, Result},
    report,
};

/// The owning Cluster's name, from the owner reference Cluster API sets.
pub fn owner_cluster_name(kc: &KVMCluster) -> Option<String> {
    report::capi_owner(kc, "Cluster")
}

/// The KVMCluster whose control-plane Service a control-plane machine Pod is an endpoint of
/// (found through its Cluster, by the Pod's cluster-name label); `None` for other Pods.
pub fn kvmcluster_of_pod(pod: &Pod, clusters: &Store<Cluster>) -> Option<ObjectRef<KVMCluster>> {
    let labels = pod.labels();
    if labels.get(MACHINE_ROLE_LABEL).map(String::as_str) != Some(ROLE_CONTROL_PLANE) {
        return None;
    }
    let ns = pod.namespace()?;
    let cluster = clusters.get(&ObjectRef::new(labels.get(CLUSTER_NAME_LABEL)?).within(&ns))?;
    let infra = cluster.spec.infrastructure_ref.as_ref()?;
    (infra.kind == "KVMCluster").then(|| ObjectRef::new(&infra.name).within(&ns))
}

/// Reconciles one KVMCluster; publishes a Warning Event when a step fails.
#[instrument(skip_all, fields(kvmcluster = %kc.name_any(), namespace = kc.namespace().unwrap_or_default()))]
pub async fn reconcile(kc: Arc<KVMCluster>, ctx: Arc<Context>) -> Result<Action> {
    let _timer = ctx.metrics.start("KVMCluster");
    let result = reconcile_inner(kc.clone(), &ctx).await;
    report::outcome(&ctx, "KVMCluster", &*kc, result).await
}

async fn reconcile_inner(kc: Arc<KVMCluster>, ctx: &Context) -> Result<Action> {
    let ns = kc.namespace().ok_or(Error::MissingNamespace)?;
    let api: Api<KVMCluster> = Api::namespaced(ctx.client.clone(), &ns);
    // A Cluster that is gone (deleted without its dependents) is no owner: the KVMCluster
    // waits for one, and can be deleted.
    let owner = owner_cluster_name(&kc);
    let cluster = match &owner {
        Some(name) => get_cluster(ctx, &ns, name).await?,
        None => None,
    };
    if is_paused(&kc, cluster.as_ref()) {
        write_status(&api, &kc, &ClusterState::Paused).await?;
        return Ok(Action::await_change());
    }
    finalizer(&api, KVMCLUSTER_FINALIZER, kc, |event| async {
        match event {
            Finalizer::Apply(kc) => apply(&api, &kc, cluster.as_ref(), ctx).await,
            Finalizer::Cleanup(kc) => {
                let done = cleanup(&kc, cluster.as_ref(), ctx).await;
                // Without the Cluster, its workload cluster link still goes.
                if cluster.is_none()
                    && let Some(name) = &owner
                {
                    ctx.workloads.forget(&ns, name);
                }
                done
            }
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

fn is_paused(kc: &KVMCluster, cluster: Option<&Cluster>) -> bool {
    cluster.is_some_and(Cluster::is_paused) || kc.annotations().contains_key(PAUSED_ANNOTATION)
}

/// The Cluster `name`, or `None` when it does not exist.
async fn get_cluster(ctx: &Context, ns: &str, name: &str) -> Result<Option<Cluster>> {
    Api::<Cluster>::namespaced(ctx.client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(|source| Error::Read {
            kind: "Cluster",
            name: name.to_owned(),
            source,
        })
}

async fn apply(
    api: &Api<KVMCluster>,
    kc: &KVMCluster,
    cluster: Option<&Cluster>,
    ctx: &Context,
) -> Result<Action> {
    let Some(cluster) = cluster else {
        write_status(api, kc, &ClusterState::WaitingForOwner).await?;
        return Ok(Action::await_change());
    };
    let cluster_name = cluster.name_any();
    let ns = kc.namespace().ok_or(Error::MissingNamespace)?;

    apply_service(ctx, &ns, &build::control_plane_service(kc, &cluster_name)).await?;
    let (endpoints, recheck) = sync_endpoints(kc, &cluster_name, &ns, ctx).await?;

    if let Some(endpoint) = build::endpoint_to_set(kc, &cluster_name, &ctx.settings.cluster_domain)
    {
        info!(host = ?endpoint.host, port = ?endpoint.port, "setting controlPlaneEndpoint");
        let patch = json!({"spec": {"controlPlaneEndpoint": endpoint}});
        crate::report::merge_patch(api, kc, "KVMCluster", &patch).await?;
    }
    write_status(api, kc, &ClusterState::Provisioned { endpoints }).await?;
    // The health check's pace: the apiservers are probed again then, or sooner when a
    // control-plane machine Pod changes.
    Ok(Action::requeue(recheck))
}

/// Server-side applies the control-plane Service. A Service made by an earlier controller had a
/// selector and `publishNotReadyAddresses`; the apply drops both (this field manager set them).
/// Should another manager hold them, they are removed explicitly: a selector would keep
/// Kubernetes' controllers writing endpoints for every control-plane Pod, answering or not.
async fn apply_service(ctx: &Context, ns: &str, svc: &Service) -> Result<()> {
    let name = svc.name_any();
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    let applied = services
        .patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(svc),
        )
        .await
        .map_err(|source| Error::Apply {
            kind: "Service",
            name: name.clone(),
            source,
        })?;
    let spec = applied.spec.as_ref();
    if spec.is_some_and(|s| s.selector.is_some() || s.publish_not_ready_addresses == Some(true)) {
        info!(service = %name, "removing the selector another field manager set on the control-plane Service");
        let patch = json!({"spec": {"selector": null, "publishNotReadyAddresses": null}});
        report::merge_patch(&services, &applied, "Service", &patch).await?;
    }
    Ok(())
}

/// The control-plane Service's endpoints: probes every control-plane machine's apiserver, writes
/// the EndpointSlice when it changed, and deletes what Kubernetes' controllers wrote while the
/// Service had a selector. Returns the `ControlPlaneEndpointsReady` condition and when to probe
/// again.
async fn sync_endpoints(
    kc: &KVMCluster,
    cluster: &str,
    ns: &str,
    ctx: &Context,
) -> Result<(DesiredCondition, Duration)> {
    // An unsynced Pod cache would look like "no control plane" and empty the Service.
    ctx.caches.ready().await;
    let pods = ctx.caches.pods.state();
    let members = endpoints::control_plane_members(pods.iter().map(|p| &**p), ns, cluster);
    let targets: Vec<(String, SocketAddr)> = members
        .iter()
        .map(|m| {
            (
                m.uid.clone(),
                SocketAddr::new(m.ip.into(), API_SERVER_PORT as u16),
            )
        })
        .collect();
    let health = ctx
        .apiserver_health
        .check(&health_key(ns, &kc.name_any()), &targets)
        .await;
    let observed: Vec<(ControlPlaneMember, EndpointHealth)> = members
        .into_iter()
        .map(|m| {
            let h = health.get(&m.uid).cloned().unwrap_or_default();
            (m, h)
        })
        .collect();
    let condition = endpoints::endpoints_condition(&observed);
    let recheck = apiserver_health::recheck_after(observed.iter().map(|(_, h)| h));

    let desired = endpoints::endpoint_slice(kc, cluster, &observed);
    let name = desired.name_any();
    let slices: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), ns);
    // A consistent read: a stale copy that happened to equal the desired slice would skip a
    // needed write.
    let current = slices
        .list(&ListParams::default().labels(&format!("{SERVICE_NAME_LABEL}={name}")))
        .await
        .map_err(|source| Error::Read {
            kind: "EndpointSlice",
            name: name.clone(),
            source,
        })?
        .items;
    let ours = current.iter().find(|s| s.name_any() == name);
    if !ours.is_some_and(|s| endpoints::slice_is_current(s, &desired)) {
        slices
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&desired),
            )
            .await
            .map_err(|source| Error::Apply {
                kind: "EndpointSlice",
                name: name.clone(),
                source,
            })?;
        let ready: Vec<String> = desired
            .endpoints
            .iter()
            .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
            .flat_map(|e| e.addresses.clone())
            .collect();
        info!(service = %name, ?ready, total = desired.endpoints.len(), "control-plane endpoints written");
        // Who left or came back, for `kubectl describe` (not on the first write).
        if ours.is_some() {
            let type_ = if condition.reason == "APIServersAnswering" {
                EventType::Normal
            } else {
                EventType::Warning
            };
            report::publish(
                ctx,
                kc,
                type_,
                "ControlPlaneEndpointsChanged",
                condition.message.clone(),
            )
            .await;
        }
    }
    let left = endpoints::left_by_kubernetes(&current);
    if !left.is_empty() {
        remove_left_by_kubernetes(ctx, ns, &name, &left).await?;
    }
    Ok((condition, recheck))
}

/// Deletes what Kubernetes' controllers wrote for the Service while it had a selector: first the
/// v1 Endpoints of its Endpoints controller (its EndpointSliceMirroring controller copies the
/// Endpoints of a selector-less Service into a slice), then the slices. Neither controller
/// removes them by itself once the selector is gone.
async fn remove_left_by_kubernetes(
    ctx: &Context,
    ns: &str,
    svc: &str,
    slices: &[String],
) -> Result<()> {
    let legacy: Api<Endpoints> = Api::namespaced(ctx.client.clone(), ns);
    let meta = legacy
        .get_metadata_opt(svc)
        .await
        .map_err(|source| Error::Read {
            kind: "Endpoints",
            name: svc.to_owned(),
            source,
        })?;
    if meta.is_some_and(|m| {
        m.labels()
            .get(endpoints::ENDPOINTS_MANAGED_BY_LABEL)
            .map(String::as_str)
            == Some(endpoints::KUBE_ENDPOINTS_CONTROLLER)
    }) {
        report::delete_if_present(&legacy, "Endpoints", svc).await?;
    }
    let api: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), ns);
    for name in slices {
        report::delete_if_present(&api, "EndpointSlice", name).await?;
    }
    warn!(service = %svc, ?slices, "deleted the endpoints Kubernetes kept from when the control-plane Service had a selector");
    Ok(())
}

/// The health monitor's key of a KVMCluster.
fn health_key(ns: &str, kvmcluster: &str) -> String {
    format!("{ns}/{kvmcluster}")
}

async fn cleanup(kc: &KVMCluster, cluster: Option<&Cluster>, ctx: &Context) -> Result<Action> {
    let ns = kc.namespace().ok_or(Error::MissingNamespace)?;
    if let Some(cluster) = cluster {
        let name = control_plane_service_name(&cluster.name_any());
        // Only delete the Service and EndpointSlice this KVMCluster owns.
        delete_owned(
            &Api::<Service>::namespaced(ctx.client.clone(), &ns),
            "Service",
            &name,
            kc,
        )
        .await?;
        delete_owned(
            &Api::<EndpointSlice>::namespaced(ctx.client.clone(), &ns),
            "EndpointSlice",
            &name,
            kc,
        )
        .await?;
        // The workload cluster goes with it: stop watching its Nodes.
        ctx.workloads.forget(&ns, &cluster.name_any());
    }
    ctx.apiserver_health
        .forget(&health_key(&ns, &kc.name_any()));
    Ok(Action::await_change())
}

/// Deletes `name` when `kc` owns it.
async fn delete_owned<K>(
    api: &Api<K>,
    kind: &'static str,
    name: &str,
    kc: &KVMCluster,
) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let current = api.get_opt(name).await.map_err(|source| Error::Read {
        kind,
        name: name.to_owned(),
        source,
    })?;
    if current.is_some_and(|o| {
        o.owner_references()
            .iter()
            .any(|r| Some(&r.uid) == kc.meta().uid.as_ref())
    }) {
        report::delete_if_present(api, kind, name).await?;
    }
    Ok(())
}

async fn write_status(api: &Api<KVMCluster>, kc: &KVMCluster, state: &ClusterState) -> Result<()> {
    report::write_status(
        api,
        kc,
        |k| k.status.as_ref(),
        |k| build::status(k, state, Timestamp::now()),
    )
    .await
}

/// Requeue after a failure; the next watch event may come sooner.
pub fn error_policy(_kc: Arc<KVMCluster>, _error: &Error, _ctx: Arc<Context>) -> Action {
    Action::requeue(Duration::from_secs(10))
}
