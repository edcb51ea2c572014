//! KVMCluster reconciler: fetch → build (pure, in [`build`]) → apply → status.

pub mod build;

use std::{sync::Arc, time::Duration};

use capk_api::{
    capi::Cluster,
    constants::{KVMCLUSTER_FINALIZER, PAUSED_ANNOTATION, control_plane_service_name},
    v1alpha1::KVMCluster,
};
use k8s_openapi::{api::core::v1::Service, jiff::Timestamp};
use kube::{
    Api, Resource, ResourceExt,
    api::{Patch, PatchParams},
    runtime::{
        controller::Action,
        finalizer::{Event as Finalizer, finalizer},
    },
};
use serde_json::json;
use tracing::{info, instrument};

use self::build::ClusterState;
use crate::{
    context::{Context, FIELD_MANAGER},
    error::{Error, Result},
    report,
};

/// The owning Cluster's name, from the owner reference Cluster API sets.
pub fn owner_cluster_name(kc: &KVMCluster) -> Option<String> {
    report::capi_owner(kc, "Cluster")
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

    let svc = build::control_plane_service(kc, &cluster_name);
    let svc_name = svc.name_any();
    Api::<Service>::namespaced(ctx.client.clone(), &ns)
        .patch(
            &svc_name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&svc),
        )
        .await
        .map_err(|source| Error::Apply {
            kind: "Service",
            name: svc_name.clone(),
            source,
        })?;

    if let Some(endpoint) = build::endpoint_to_set(kc, &cluster_name, &ctx.settings.cluster_domain)
    {
        info!(host = ?endpoint.host, port = ?endpoint.port, "setting controlPlaneEndpoint");
        let patch = json!({"spec": {"controlPlaneEndpoint": endpoint}});
        crate::report::merge_patch(api, kc, "KVMCluster", &patch).await?;
    }
    write_status(api, kc, &ClusterState::Provisioned).await?;
    Ok(Action::await_change())
}

async fn cleanup(kc: &KVMCluster, cluster: Option<&Cluster>, ctx: &Context) -> Result<Action> {
    let ns = kc.namespace().ok_or(Error::MissingNamespace)?;
    if let Some(cluster) = cluster {
        let name = control_plane_service_name(&cluster.name_any());
        let svcs: Api<Service> = Api::namespaced(ctx.client.clone(), &ns);
        // Only delete the Service this KVMCluster owns.
        if let Some(svc) = svcs.get_opt(&name).await.map_err(|source| Error::Read {
            kind: "Service",
            name: name.clone(),
            source,
        })? && svc
            .owner_references()
            .iter()
            .any(|o| Some(&o.uid) == kc.meta().uid.as_ref())
        {
            svcs.delete(&name, &Default::default())
                .await
                .map_err(|source| Error::Delete {
                    kind: "Service",
                    name,
                    source,
                })?;
        }
        // The workload cluster goes with it: stop watching its Nodes.
        ctx.workloads.forget(&ns, &cluster.name_any());
    }
    Ok(Action::await_change())
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
