//! KVMCluster reconciler: fetch → probe the control-plane apiservers
//! ([`crate::remote::apiserver_health`]) → build (pure, in [`build`] and [`endpoints`]) →
//! apply → status.
//! What wakes it, and the controller that runs it: [`watches`].

pub mod build;
pub mod endpoints;
pub mod watches;

use std::{net::SocketAddr, sync::Arc, time::Duration};

use capk_api::{
    capi::Cluster,
    constants::{
        API_SERVER_PORT, BLOCK_MOVE_ANNOTATION, CLUSTER_NAME_LABEL,
        CONDITION_HOSTING_CLUSTER_AVAILABLE, CONDITION_PAUSED, KVMCLUSTER_FINALIZER, MOVE_LABEL,
        OWNER_NAMESPACE_LABEL, PAUSED_ANNOTATION, control_plane_service_name,
    },
    v1alpha1::KVMCluster,
};
use k8s_openapi::{
    api::{
        core::v1::{Namespace, Pod, Service},
        discovery::v1::EndpointSlice,
    },
    jiff::Timestamp,
};
use kube::{
    Api, ResourceExt,
    api::{ListParams, Patch, PatchParams, PostParams},
    runtime::{
        controller::Action,
        events::EventType,
        finalizer::{Event as Finalizer, finalizer},
    },
};
use serde_json::json;
use tracing::{info, instrument};

use self::{
    build::ClusterState,
    endpoints::{ControlPlaneMember, SERVICE_NAME_LABEL},
};
use crate::{
    k8s::conditions::DesiredCondition,
    k8s::objects::{self, read_error},
    k8s::ownership::{self, Claim, Owner},
    remote::apiserver_health::EndpointHealth,
    remote::hosting::{HostingKey, REASON_CONNECTING, Target, Unavailable},
    runtime::context::Context,
    runtime::error::{Error, Result},
    runtime::outcome,
};

/// Reconciles one KVMCluster; publishes a Warning Event when a step fails.
#[instrument(skip_all, fields(kvmcluster = %kc.name_any(), namespace = kc.namespace().unwrap_or_default()))]
pub async fn reconcile(kc: Arc<KVMCluster>, ctx: Arc<Context>) -> Result<Action> {
    outcome::reconciled(&ctx, "KVMCluster", &*kc, reconcile_inner(kc.clone(), &ctx)).await
}

async fn reconcile_inner(kc: Arc<KVMCluster>, ctx: &Context) -> Result<Action> {
    let ns = kc.namespace().ok_or(Error::MissingNamespace)?;
    let api: Api<KVMCluster> = Api::namespaced(ctx.client.clone(), &ns);
    // A Cluster that is gone (deleted without its dependents) is no owner: the KVMCluster
    // waits for one, and can be deleted.
    let owner = ownership::capi_owner(&*kc, "Cluster");
    let cluster = match &owner {
        Some(name) => get_cluster(ctx, &ns, name).await?,
        None => None,
    };
    if is_paused(&kc, cluster.as_ref()) {
        warn_move_blocked(ctx, &kc, owner.as_deref()).await;
        write_status(&api, &kc, &ClusterState::Paused).await?;
        return Ok(Action::await_change());
    }
    finalizer(&api, KVMCLUSTER_FINALIZER, kc, |event| async {
        match event {
            Finalizer::Apply(kc) => apply(&api, &kc, cluster.as_ref(), ctx).await,
            Finalizer::Cleanup(kc) => {
                let done = cleanup(&api, &kc, cluster.as_ref(), ctx).await;
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

/// When a KVMCluster that blocks `clusterctl move` ([`block_move`]) is newly paused, as a move
/// pauses it first: a Warning Event that says why the move waits and gives up, how to pivot, and
/// how to resume the Cluster a move that gave up leaves paused.
async fn warn_move_blocked(ctx: &Context, kc: &KVMCluster, cluster: Option<&str>) {
    let was_paused = kc
        .status
        .as_ref()
        .and_then(|s| s.contract.conditions.as_deref())
        .and_then(|cs| crate::k8s::conditions::find(cs, CONDITION_PAUSED))
        .is_some_and(|c| c.status == "True");
    if was_paused || !kc.annotations().contains_key(BLOCK_MOVE_ANNOTATION) {
        return;
    }
    let ns = kc.namespace().unwrap_or_default();
    let cluster = cluster.unwrap_or("NAME");
    let note = format!(
        "clusterctl move waits on this KVMCluster and then gives up, deleting nothing: its \
         machines' Pods live in the management cluster and a move would delete them with the \
         KVMMachines, and the workload cluster with them. Give the KVMCluster \
         spec.hostingCluster first (docs/hosting-and-move.md), then move. A move that gave up \
         leaves the Cluster paused: kubectl -n {ns} patch cluster {cluster} --type merge -p \
         '{{\"spec\":{{\"paused\":false}}}}'"
    );
    outcome::publish(ctx, kc, EventType::Warning, REASON_MOVE_BLOCKED, note).await;
}

/// Event reason: `clusterctl move` (or another pause) met a KVMCluster that blocks moves.
pub const REASON_MOVE_BLOCKED: &str = "MoveBlocked";

/// clusterctl's block-move annotation while the machines live in the management cluster
/// (`blocked`: no `spec.hostingCluster`): a move would delete their Pods with the KVMMachines,
/// so clusterctl waits, gives up and deletes nothing. With a hosting cluster the VMs stay where
/// they run, and the annotation goes once the Service there is the KVMCluster's by its labels.
async fn block_move(api: &Api<KVMCluster>, kc: &KVMCluster, blocked: bool) -> Result<()> {
    if kc.annotations().contains_key(BLOCK_MOVE_ANNOTATION) == blocked {
        return Ok(());
    }
    let value = blocked.then_some("true");
    let patch = json!({"metadata": {"annotations": {BLOCK_MOVE_ANNOTATION: value}}});
    objects::merge_patch(api, kc, "KVMCluster", &patch).await?;
    Ok(())
}

fn is_paused(kc: &KVMCluster, cluster: Option<&Cluster>) -> bool {
    cluster.is_some_and(Cluster::is_paused) || kc.annotations().contains_key(PAUSED_ANNOTATION)
}

/// The Cluster `name`, or `None` when it does not exist.
async fn get_cluster(ctx: &Context, ns: &str, name: &str) -> Result<Option<Cluster>> {
    Api::<Cluster>::namespaced(ctx.client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(read_error("Cluster", name))
}

/// Where `kc`'s objects live, or why that cluster cannot be used now; a Warning Event when it
/// stops being usable (a Normal one while its first list is on the way: every start and every
/// `clusterctl move` goes through that, and nothing is wrong).
async fn target(ctx: &Context, kc: &KVMCluster) -> std::result::Result<Target, Unavailable> {
    let result = match hosting_kubeconfig(ctx, kc).await {
        Ok(kubeconfig) => {
            ctx.hosting
                .target(&ctx.client, &ctx.caches.objects(), kc, kubeconfig)
                .await
        }
        Err(u) => Err(u),
    };
    if let Err(u) = &result {
        report_unavailable(ctx, kc, u).await;
    }
    result
}

/// An Event for why `kc`'s machines' place cannot be used, unless its condition says so
/// already (a Normal one while a hosting cluster's first list is on the way).
async fn report_unavailable(ctx: &Context, kc: &KVMCluster, u: &Unavailable) {
    let shown = kc
        .status
        .as_ref()
        .and_then(|s| s.contract.conditions.as_deref())
        .and_then(|cs| crate::k8s::conditions::find(cs, CONDITION_HOSTING_CLUSTER_AVAILABLE))
        .is_some_and(|c| c.status == "False" && c.reason == u.reason);
    if !shown {
        let kind = if u.reason == REASON_CONNECTING {
            EventType::Normal
        } else {
            EventType::Warning
        };
        outcome::publish(ctx, kc, kind, u.reason, u.message.clone()).await;
    }
}

/// Provisions the KVMCluster: validate → record where its machines live → find that cluster →
/// the control-plane Service and its endpoints → `spec.controlPlaneEndpoint` → status.
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
    // Validate (pure) before anything is applied: a refused Service type or annotation changes
    // nothing, not even a Service made before the operator narrowed the policy.
    if let Some(refused) = build::refused_spec(kc, &ctx.settings.tenant_policy) {
        return refuse_spec(api, kc, refused, ctx).await;
    }
    // The caches this reconcile reads (the hosting kubeconfig Secret among them) have listed.
    ctx.caches.ready().await;
    retain_hosting_links(ctx, None);
    let recorded = match record_machine_namespace(api, kc, &cluster_name, ctx).await? {
        Ok(recorded) => recorded,
        Err(u) => {
            report_unavailable(ctx, kc, &u).await;
            return wait_for_hosting(api, kc, &u).await;
        }
    };
    let kc = recorded.as_ref().unwrap_or(kc);
    // Where the Service and the machines live. A hosting cluster that cannot be used now is a
    // condition; nothing there is touched until it can (its recovery wakes this reconcile).
    let target = match target(ctx, kc).await {
        Ok(t) => t,
        Err(u) => return wait_for_hosting(api, kc, &u).await,
    };
    let name = build::service_name_in(kc, &cluster_name, &target.home);
    let service = build::control_plane_service(kc, &cluster_name, &name, &target.home);
    refuse_foreign_service(kc, &target, &name).await?;
    let node_port = apply_service(&target, &service).await?;
    let (endpoints, recheck) = sync_endpoints(kc, &cluster_name, &name, &ns, &target, ctx).await?;
    set_control_plane_endpoint(api, kc, &name, &target, node_port, ctx).await?;
    block_move(api, kc, target.key().is_none()).await?;
    let state = ClusterState::Provisioned {
        endpoints,
        hosting: target.condition(),
    };
    write_status(api, kc, &state).await?;
    // The health check's pace: the apiservers are probed again then, or sooner when a
    // control-plane machine Pod changes.
    Ok(Action::requeue(recheck))
}

/// A spec the operator's tenant policy refuses: a Warning Event (unless the condition says so
/// already) and the condition; nothing else changes until the spec does.
async fn refuse_spec(
    api: &Api<KVMCluster>,
    kc: &KVMCluster,
    refused: DesiredCondition,
    ctx: &Context,
) -> Result<Action> {
    let shown = kc
        .status
        .as_ref()
        .and_then(|s| s.contract.conditions.as_deref())
        .and_then(|cs| crate::k8s::conditions::find(cs, refused.type_))
        .is_some_and(|c| c.reason == refused.reason && c.message == refused.message);
    if !shown {
        let note = refused.message.clone();
        outcome::publish(
            ctx,
            kc,
            EventType::Warning,
            build::REASON_SPEC_INVALID,
            note,
        )
        .await;
    }
    write_status(api, kc, &ClusterState::SpecInvalid(refused)).await?;
    Ok(Action::await_change())
}

/// Writes why the cluster where `kc`'s objects live cannot be used now (the
/// `HostingClusterAvailable` condition).
async fn write_hosting_unavailable(
    api: &Api<KVMCluster>,
    kc: &KVMCluster,
    u: &Unavailable,
) -> Result<()> {
    let down = u.condition(CONDITION_HOSTING_CLUSTER_AVAILABLE);
    write_status(api, kc, &ClusterState::HostingUnavailable(down)).await
}

/// Shows why the hosting cluster cannot be used now and looks again in a minute (or when it
/// recovers: that wakes the reconcile).
async fn wait_for_hosting(
    api: &Api<KVMCluster>,
    kc: &KVMCluster,
    u: &Unavailable,
) -> Result<Action> {
    write_hosting_unavailable(api, kc, u).await?;
    Ok(Action::requeue(Duration::from_secs(60)))
}

/// Sets `spec.controlPlaneEndpoint` to the control-plane Service `service` when
/// [`build::endpoint_to_set`] says it is not set yet.
async fn set_control_plane_endpoint(
    api: &Api<KVMCluster>,
    kc: &KVMCluster,
    service: &str,
    target: &Target,
    node_port: Option<i32>,
    ctx: &Context,
) -> Result<()> {
    let Some(endpoint) = build::endpoint_to_set(
        kc,
        service,
        &ctx.settings.cluster_domain,
        &target.home,
        node_port,
    ) else {
        return Ok(());
    };
    info!(host = ?endpoint.host, port = ?endpoint.port, "setting controlPlaneEndpoint");
    let patch = json!({"spec": {"controlPlaneEndpoint": endpoint}});
    objects::merge_patch(api, kc, "KVMCluster", &patch).await?;
    Ok(())
}

/// Reason: the operator's machine namespace for this cluster is a tenant's (it holds clusters).
pub const REASON_MACHINE_NAMESPACE_REFUSED: &str = "MachineNamespaceRefused";

/// Event reason: the cluster's machine namespace was chosen.
pub const REASON_MACHINE_NAMESPACE_CHOSEN: &str = "MachineNamespaceChosen";

/// Chooses, once, the namespace of the management cluster where the cluster's machines live
/// while it names no hosting cluster, and records it in `status.machineNamespace`: the
/// operator's machine namespace for a new cluster; for one provisioned before it was recorded
/// (made by a release without the choice), or whose Service is already in its own namespace,
/// its own namespace, so that running VMs never move. Returns the KVMCluster as recorded, or
/// `None` when it was already; refuses a machine namespace that holds Cluster API clusters
/// (a tenant's namespace, as `capk-{namespace}` can name: its users could exec into another
/// tenant's machine Pods).
async fn record_machine_namespace(
    api: &Api<KVMCluster>,
    kc: &KVMCluster,
    cluster: &str,
    ctx: &Context,
) -> Result<std::result::Result<Option<KVMCluster>, Unavailable>> {
    if crate::remote::hosting::machine_namespace(kc).is_some() {
        return Ok(Ok(None));
    }
    let ns = kc.namespace().ok_or(Error::MissingNamespace)?;
    let provisioned = kc
        .status
        .as_ref()
        .and_then(|s| s.contract.initialization.as_ref())
        .and_then(|i| i.provisioned)
        .unwrap_or(false);
    let beside = Target::management(&ctx.client, ctx.caches.objects(), &ns, &ns);
    let chosen = if provisioned
        || beside
            .service(&control_plane_service_name(cluster))
            .is_some()
    {
        ns.clone()
    } else {
        ctx.settings.machine_namespace.of(&ns)
    };
    if chosen != ns {
        let in_chosen = |other: Option<String>| other.as_deref() == Some(chosen.as_str());
        let tenants = ctx
            .caches
            .kvm_clusters
            .state()
            .iter()
            .any(|k| in_chosen(k.namespace()))
            || ctx
                .caches
                .clusters
                .state()
                .iter()
                .any(|c| in_chosen(c.namespace()));
        if tenants {
            return Ok(Err(Unavailable {
                reason: REASON_MACHINE_NAMESPACE_REFUSED,
                message: format!(
                    "the machine namespace {chosen} (the operator's CAPK_MACHINE_NAMESPACE) holds Cluster API clusters: whoever may exec into Pods there would reach this cluster's privileged machine Pods; the operator must name a namespace of its own"
                ),
            }));
        }
        ensure_machine_namespace(ctx, &chosen).await?;
    }
    let patch = json!({"status": {"machineNamespace": chosen}});
    let recorded = api
        .patch_status(
            &kc.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .map_err(Error::UpdateStatus)?;
    info!(namespace = %chosen, "recorded the machine namespace");
    let note = format!(
        "machines live in namespace {chosen} of the management cluster when no hosting cluster is named"
    );
    outcome::publish(
        ctx,
        kc,
        EventType::Normal,
        REASON_MACHINE_NAMESPACE_CHOSEN,
        note,
    )
    .await;
    Ok(Ok(Some(recorded)))
}

/// Makes machine namespace `name` when it does not exist, labelled to admit privileged Pods
/// (machine Pods are); one that exists is the operator's, left as it is.
async fn ensure_machine_namespace(ctx: &Context, name: &str) -> Result<()> {
    let namespace = Namespace {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(
                [(
                    POD_SECURITY_ENFORCE_LABEL.to_owned(),
                    "privileged".to_owned(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        ..Default::default()
    };
    let api = Api::<Namespace>::all(ctx.client.clone());
    match api.create(&PostParams::default(), &namespace).await {
        Ok(_) => {
            info!(namespace = name, "made the machine namespace");
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(source) => Err(Error::Apply {
            kind: "Namespace",
            name: name.to_owned(),
            source,
        }),
    }
}

/// Pod Security's label for the level a namespace enforces.
const POD_SECURITY_ENFORCE_LABEL: &str = "pod-security.kubernetes.io/enforce";

/// How often [`prune_hosting_links`] looks for hosting clusters no KVMCluster names any more.
pub const HOSTING_LINK_PRUNE_PERIOD: Duration = Duration::from_secs(10);

/// Drops, every [`HOSTING_LINK_PRUNE_PERIOD`] until `stopped`, the links (client and watches) of
/// hosting clusters that no KVMCluster names any more, and of workload clusters no KVMMachine
/// belongs to any more. A KVMCluster or KVMMachine can go without a reconcile that would drop
/// its link: `clusterctl move` pauses it, removes its finalizer and deletes it, and the
/// controller of the source cluster would otherwise keep watching the hosting namespace and the
/// workload cluster's Nodes with the moved credentials for as long as it runs.
pub async fn prune_hosting_links(
    ctx: Arc<Context>,
    stopped: impl std::future::Future<Output = ()>,
) {
    let prune = async {
        ctx.caches.ready().await;
        loop {
            tokio::time::sleep(HOSTING_LINK_PRUNE_PERIOD).await;
            retain_hosting_links(&ctx, None);
            let (kvm_machines, machines) =
                (ctx.caches.kvm_machines.state(), ctx.caches.machines.state());
            ctx.workloads.retain(|ns, cluster| {
                let labelled = kvm_machines.iter().any(|km| {
                    km.namespace().as_deref() == Some(ns)
                        && km.labels().get(CLUSTER_NAME_LABEL).map(String::as_str) == Some(cluster)
                });
                labelled
                    || machines.iter().any(|m| {
                        m.namespace().as_deref() == Some(ns) && m.spec.cluster_name == cluster
                    })
            });
        }
    };
    tokio::select! {
        () = prune => {}
        () = stopped => {}
    }
}

/// Drops the links of hosting clusters no KVMCluster names any more (`leaving`: one that is
/// about to be gone).
fn retain_hosting_links(ctx: &Context, leaving: Option<&str>) {
    let in_use: Vec<HostingKey> = ctx
        .caches
        .kvm_clusters
        .state()
        .iter()
        .filter(|kc| leaving.is_none_or(|l| kc.uid().as_deref() != Some(l)))
        .filter_map(|kc| HostingKey::of(kc))
        .collect();
    ctx.hosting.retain(|k| in_use.contains(k));
}

/// The resourceVersion of `kc`'s hosting kubeconfig Secret (`None`: none named, or it does
/// not exist), or why it cannot be read. The Secret carries clusterctl's move label, which
/// the controller puts on it when it lacks it ([`objects::labelled_secret`]): `clusterctl move`
/// then takes it along with the cluster, so the moved KVMCluster still reaches its machines,
/// and the controller's watch of hosting kubeconfigs ([`crate::k8s::caches::hosting_kubeconfigs`])
/// sees it, a user's hand-made Secret too.
pub async fn hosting_kubeconfig(
    ctx: &Context,
    kc: &KVMCluster,
) -> std::result::Result<Option<String>, Unavailable> {
    let Some(key) = HostingKey::of(kc) else {
        return Ok(None);
    };
    let secret = objects::labelled_secret(
        &ctx.client,
        &ctx.caches.hosting_kubeconfigs,
        &key.secret_namespace,
        &key.secret,
        (MOVE_LABEL, ""),
    )
    .await
    .map_err(|e| Unavailable {
        reason: crate::remote::hosting::REASON_KUBECONFIG_INVALID,
        message: e.to_string(),
    })?;
    Ok(secret.map(|s| s.resource_version().unwrap_or_default()))
}

/// Refuses a Service of the control-plane Service's name that belongs to someone else (the
/// apply would take it over). Ours carry our label, so are cached; one the cache does not show
/// is looked up.
async fn refuse_foreign_service(kc: &KVMCluster, target: &Target, name: &str) -> Result<()> {
    let meta = match target.service(name) {
        Some(cached) => Some(cached.metadata.clone()),
        None => target
            .api::<Service>()
            .get_metadata_opt(name)
            .await
            .map_err(read_error("Service", name))?
            .map(|m| m.metadata),
    };
    match meta.map(|m| ownership::claim(&m, &Owner::cluster(kc), &target.home)) {
        Some(Claim::Foreign) => Err(Error::Foreign {
            kind: "Service",
            name: name.to_owned(),
            place: target.describe(),
        }),
        _ => Ok(()),
    }
}

/// Server-side applies the control-plane Service. The apply also sets the labels naming the
/// KVMCluster and, outside the management cluster, drops the owner reference an earlier apply
/// set: adoption is the apply itself. Returns the Service's node port (type NodePort: requested
/// or allocated).
async fn apply_service(target: &Target, svc: &Service) -> Result<Option<i32>> {
    let services: Api<Service> = target.api();
    let applied = objects::apply(&services, svc, "Service").await?;
    Ok(applied
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .and_then(|p| p.first())
        .and_then(|p| p.node_port))
}

/// The endpoints of control-plane Service `service`: probes every control-plane machine's
/// apiserver, then does what [`endpoints::decide_endpoints`] decides: writes the EndpointSlice
/// when it changed and says who left or came back in an Event. Returns the
/// `ControlPlaneEndpointsReady` condition and when to probe again.
async fn sync_endpoints(
    kc: &KVMCluster,
    cluster: &str,
    service: &str,
    ns: &str,
    target: &Target,
    ctx: &Context,
) -> Result<(DesiredCondition, Duration)> {
    let pods = control_plane_pods_of(target, ns);
    let members = endpoints::control_plane_members(
        pods.iter().map(|p| &**p),
        &target.home.namespace,
        cluster,
    );
    let observed = probe_apiservers(ctx, &health_key(ns, &kc.name_any()), members).await;
    let slices: Api<EndpointSlice> = target.api();
    let current = list_endpoint_slices(&slices, service).await?;
    let decision =
        endpoints::decide_endpoints(kc, cluster, service, &observed, &current, &target.home);
    if let Some(slice) = &decision.write {
        objects::apply(&slices, slice, "EndpointSlice").await?;
        let ready = endpoints::ready_addresses(slice);
        info!(
            service,
            ?ready,
            total = slice.endpoints.len(),
            "control-plane endpoints written"
        );
    }
    if let Some((type_, note)) = decision.event {
        outcome::publish(ctx, kc, type_, "ControlPlaneEndpointsChanged", note).await;
    }
    Ok((decision.condition, decision.recheck))
}

/// The machine Pods in `target` of KVMClusters in management namespace `ns`: in a namespace
/// several management namespaces share, only this one's machines count.
///
/// An unsynced Pod cache would look like "no control plane" and empty the Service: the
/// management cluster's caches have listed (see `apply`), a hosting cluster's target exists
/// only once its caches have.
fn control_plane_pods_of(target: &Target, ns: &str) -> Vec<Arc<Pod>> {
    target
        .pods()
        .into_iter()
        .filter(|p| p.labels().get(OWNER_NAMESPACE_LABEL).map(String::as_str) == Some(ns))
        .collect()
}

/// Probes the apiserver of every member (the health monitor keeps their history under `key`):
/// each member with its health.
async fn probe_apiservers(
    ctx: &Context,
    key: &str,
    members: Vec<ControlPlaneMember>,
) -> Vec<(ControlPlaneMember, EndpointHealth)> {
    let targets: Vec<(String, SocketAddr)> = members
        .iter()
        .map(|m| {
            (
                m.uid.clone(),
                SocketAddr::new(m.ip.into(), API_SERVER_PORT as u16),
            )
        })
        .collect();
    let health = ctx.apiserver_health.check(key, &targets).await;
    members
        .into_iter()
        .map(|m| {
            let h = health.get(&m.uid).cloned().unwrap_or_default();
            (m, h)
        })
        .collect()
}

/// The EndpointSlices labelled for Service `service`, read consistently: a stale copy that
/// happened to equal the desired slice would skip a needed write.
async fn list_endpoint_slices(
    slices: &Api<EndpointSlice>,
    service: &str,
) -> Result<Vec<EndpointSlice>> {
    let selector = format!("{SERVICE_NAME_LABEL}={service}");
    Ok(slices
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(read_error("EndpointSlice", service))?
        .items)
}

/// The health monitor's key of a KVMCluster.
fn health_key(ns: &str, kvmcluster: &str) -> String {
    format!("{ns}/{kvmcluster}")
}

/// Deletes the control-plane Service and its EndpointSlice where they live (only when they are
/// this KVMCluster's). With a hosting cluster, its machines go first: each needs the KVMCluster
/// to find the hosting cluster its Pod is in.
async fn cleanup(
    api: &Api<KVMCluster>,
    kc: &KVMCluster,
    cluster: Option<&Cluster>,
    ctx: &Context,
) -> Result<Action> {
    let ns = kc.namespace().ok_or(Error::MissingNamespace)?;
    ctx.caches.ready().await;
    let cluster_name = cluster
        .map(ResourceExt::name_any)
        .or_else(|| kc.labels().get(CLUSTER_NAME_LABEL).cloned());
    refuse_while_machines_elsewhere(kc, &ns, cluster_name.as_deref(), ctx)?;
    let target = match target_to_clean(ctx, kc, &ns).await {
        Ok(t) => t,
        Err(u) => {
            write_hosting_unavailable(api, kc, &u).await?;
            return Err(Error::HostingUnavailable(u.message));
        }
    };
    if let Some(cluster) = cluster {
        let cluster_name = cluster.name_any();
        let owner = Owner::cluster(kc);
        // Only the Service and EndpointSlice this KVMCluster owns.
        let name = build::service_name_in(kc, &cluster_name, &target.home);
        objects::delete_if_owned(&target.api::<Service>(), "Service", &name, &owner).await?;
        let slices = target.api::<EndpointSlice>();
        objects::delete_if_owned(&slices, "EndpointSlice", &name, &owner).await?;
        // The workload cluster goes with it: stop watching its Nodes.
        ctx.workloads.forget(&ns, &cluster_name);
    }
    ctx.apiserver_health
        .forget(&health_key(&ns, &kc.name_any()));
    retain_hosting_links(ctx, kc.uid().as_deref());
    Ok(Action::await_change())
}

/// Machines elsewhere than beside the KVMCluster (a hosting cluster, a machine namespace) have
/// no owner references to it: they go first, while it still says where they are. An error
/// while any of Cluster `cluster`'s KVMMachines remains.
fn refuse_while_machines_elsewhere(
    kc: &KVMCluster,
    ns: &str,
    cluster: Option<&str>,
    ctx: &Context,
) -> Result<()> {
    let beside = HostingKey::of(kc).is_none()
        && crate::remote::hosting::machine_namespace(kc).is_none_or(|m| m == ns);
    let Some(cluster) = cluster.filter(|_| !beside) else {
        return Ok(());
    };
    let machines = ctx
        .caches
        .kvm_machines
        .state()
        .iter()
        .filter(|km| {
            km.namespace().as_deref() == Some(ns)
                && km.labels().get(CLUSTER_NAME_LABEL).map(String::as_str) == Some(cluster)
        })
        .count();
    if machines > 0 {
        return Err(Error::MachinesRemain(machines));
    }
    Ok(())
}

/// Where the objects to delete are. One that never chose a machine namespace made nothing
/// since the choice exists; before it, everything was beside it.
async fn target_to_clean(
    ctx: &Context,
    kc: &KVMCluster,
    ns: &str,
) -> std::result::Result<Target, Unavailable> {
    let unchosen =
        HostingKey::of(kc).is_none() && crate::remote::hosting::machine_namespace(kc).is_none();
    if unchosen {
        Ok(Target::management(
            &ctx.client,
            ctx.caches.objects(),
            ns,
            ns,
        ))
    } else {
        target(ctx, kc).await
    }
}

async fn write_status(api: &Api<KVMCluster>, kc: &KVMCluster, state: &ClusterState) -> Result<()> {
    objects::write_status(
        api,
        kc,
        |k| k.status.as_ref(),
        |k| build::status(k, state, Timestamp::now()),
    )
    .await
}

/// Requeue after a failure, after the cluster's back-off (which grows while it keeps failing);
/// the next watch event may come sooner.
pub fn error_policy(kc: Arc<KVMCluster>, error: &Error, ctx: Arc<Context>) -> Action {
    outcome::requeue_after(&ctx, "KVMCluster", &*kc, error)
}
