//! KVMMachine reconciler, a pipeline read top to bottom in [`apply`]: fetch (Machine, Cluster,
//! bootstrap data) → validate the spec ([`validate`], pure) → build the desired objects (pure,
//! one module each: [`ignition_secret`], [`etcd_claim`], [`pod`] with [`node_image`]) → apply
//! them → one status write ([`status`]). Deletion ([`cleanup`]) stops the machine Pod, deletes
//! what was made for it and removes its etcd data from the MC node ([`etcd_cleanup`]).

pub mod etcd_claim;
pub mod etcd_cleanup;
pub mod ignition_secret;
pub mod names;
pub mod node_image;
pub mod overhead;
pub mod placement;
pub mod pod;
pub mod pod_layout;
pub mod status;
pub mod validate;

use std::{sync::Arc, time::Duration};

use capk_api::{
    capi::{Cluster, Machine},
    constants::{
        BLOCK_MOVE_ANNOTATION, CLUSTER_NAME_LABEL, KVMMACHINE_FINALIZER, PAUSED_ANNOTATION,
        RENDERED_FROM_ANNOTATION, provider_id,
    },
    v1alpha1::{KVMCluster, KVMMachine},
};
use k8s_openapi::{
    api::core::v1::{Node, PersistentVolumeClaim, Pod, Secret},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
    jiff::Timestamp,
};
use kube::{
    Api, Resource, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
    core::PartialObjectMeta,
    runtime::{
        controller::Action,
        events::EventType,
        finalizer::{Event as Finalizer, finalizer},
        reflector::ObjectRef,
    },
};
use serde_json::json;
use tracing::{info, instrument, warn};

pub use self::placement::MachinePlacement;
use self::{
    etcd_cleanup::{Attempt, EtcdHostDir, RemovableDir},
    status::MachineState,
};
use crate::{
    conditions::DesiredCondition,
    context::{Context, FIELD_MANAGER},
    error::{Error, Result},
    hosting::{Target, Unavailable},
    ownership::{Claim, Owner},
    report,
    workload::{
        Gate, NodeFacts, PodNode, REASON_KUBECONFIG_INVALID, REASON_KUBECONFIG_REFUSED,
        kubeconfig_secret_name, set_gate,
    },
};

/// The owning Machine's name, from the owner reference Cluster API sets.
pub fn owner_machine_name(km: &KVMMachine) -> Option<String> {
    report::capi_owner(km, "Machine")
}

/// Reconciles one KVMMachine; publishes a Warning Event when a step fails.
#[instrument(skip_all, fields(kvmmachine = %km.name_any(), namespace = km.namespace().unwrap_or_default()))]
pub async fn reconcile(km: Arc<KVMMachine>, ctx: Arc<Context>) -> Result<Action> {
    let _timer = ctx.metrics.start("KVMMachine");
    let result = report::within_deadline(reconcile_inner(km.clone(), &ctx)).await;
    report::outcome(&ctx, "KVMMachine", &*km, result).await
}

async fn publish(ctx: &Context, km: &KVMMachine, type_: EventType, reason: &str, note: String) {
    report::publish(ctx, km, type_, reason, note).await
}

fn read_err(kind: &'static str, name: &str) -> impl FnOnce(kube::Error) -> Error {
    let name = name.to_owned();
    move |source| Error::Read { kind, name, source }
}

async fn reconcile_inner(km: Arc<KVMMachine>, ctx: &Context) -> Result<Action> {
    let ns = km.namespace().ok_or(Error::MissingNamespace)?;
    ctx.caches.ready().await;
    let api: Api<KVMMachine> = Api::namespaced(ctx.client.clone(), &ns);
    let machine = owner_machine_name(&km)
        .and_then(|name| ctx.caches.machines.get(&ObjectRef::new(&name).within(&ns)));
    let cluster = match &machine {
        Some(m) if !m.spec.cluster_name.is_empty() => ctx
            .caches
            .clusters
            .get(&ObjectRef::new(&m.spec.cluster_name).within(&ns)),
        _ => None,
    };
    let paused = cluster.as_deref().is_some_and(Cluster::is_paused)
        || km.annotations().contains_key(PAUSED_ANNOTATION);
    if paused {
        write_status(&api, &km, &MachineState::Paused, &[], None, None).await?;
        return Ok(Action::await_change());
    }
    let kvm_cluster = kvm_cluster_of(ctx, &ns, &km, machine.as_deref(), cluster.as_deref()).await?;
    finalizer(&api, KVMMACHINE_FINALIZER, km, |event| async {
        match event {
            Finalizer::Apply(km) => {
                let found = (
                    machine.as_deref(),
                    cluster.as_deref(),
                    kvm_cluster.as_deref(),
                );
                apply(&api, &km, found, ctx).await
            }
            Finalizer::Cleanup(km) => cleanup(&api, &km, kvm_cluster.as_deref(), ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

/// The KVMCluster of the machine's cluster, which says where the machine's objects live: the
/// one the Cluster's infrastructureRef names, or (the Cluster gone) the one labelled with the
/// cluster's name. One the Cluster names but the cache does not show yet is asked of the
/// apiserver: taking the management cluster for a hosting cluster would boot a second VM.
async fn kvm_cluster_of(
    ctx: &Context,
    ns: &str,
    km: &KVMMachine,
    machine: Option<&Machine>,
    cluster: Option<&Cluster>,
) -> Result<Option<Arc<KVMCluster>>> {
    if let Some(cluster) = cluster {
        let Some(infra) = cluster
            .spec
            .infrastructure_ref
            .as_ref()
            .filter(|r| r.kind == "KVMCluster")
        else {
            return Ok(None);
        };
        if let Some(kc) = ctx
            .caches
            .kvm_clusters
            .get(&ObjectRef::new(&infra.name).within(ns))
        {
            return Ok(Some(kc));
        }
        let read = Api::<KVMCluster>::namespaced(ctx.client.clone(), ns)
            .get_opt(&infra.name)
            .await
            .map_err(read_err("KVMCluster", &infra.name))?;
        return Ok(read.map(Arc::new));
    }
    let Some(name) = machine
        .map(|m| m.spec.cluster_name.clone())
        .filter(|n| !n.is_empty())
        .or_else(|| km.labels().get(CLUSTER_NAME_LABEL).cloned())
    else {
        return Ok(None);
    };
    Ok(ctx.caches.kvm_clusters.state().into_iter().find(|kc| {
        kc.namespace().as_deref() == Some(ns)
            && (crate::kvmcluster::owner_cluster_name(kc).as_ref() == Some(&name)
                || kc.labels().get(CLUSTER_NAME_LABEL) == Some(&name))
    }))
}

/// Where the machine's objects live: as its KVMCluster says, or (none) the management cluster,
/// in the machine's namespace.
async fn target_of(
    ctx: &Context,
    ns: &str,
    kvm_cluster: Option<&KVMCluster>,
) -> std::result::Result<Target, Unavailable> {
    match kvm_cluster {
        Some(kc) => {
            ctx.hosting
                .target(&ctx.client, &ctx.caches.objects(), kc)
                .await
        }
        None => Ok(Target::management(&ctx.client, ctx.caches.objects(), ns)),
    }
}

/// Makes `meta` (an existing object of the name the controller would give it) the machine's:
/// nothing when it already is; its labels and owner references patched when it is the
/// machine's by its labels or an owner reference ([`crate::ownership`]); an error when it is
/// someone else's. Returns whether it was patched.
async fn adopt<K>(
    api: &Api<K>,
    kind: &'static str,
    meta: &ObjectMeta,
    owner: &Owner,
    target: &Target,
) -> Result<bool>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let name = meta.name.clone().unwrap_or_default();
    match crate::ownership::claim(meta, owner, &target.home) {
        Claim::Current => Ok(false),
        Claim::Foreign => Err(Error::Foreign {
            kind,
            name,
            place: target.describe(),
        }),
        Claim::Adopt(patch) => {
            let _: PartialObjectMeta<K> = api
                .patch_metadata(
                    &name,
                    &PatchParams {
                        field_manager: Some(FIELD_MANAGER.into()),
                        ..Default::default()
                    },
                    &Patch::Merge(&patch),
                )
                .await
                .map_err(|source| Error::Apply {
                    kind,
                    name: name.clone(),
                    source,
                })?;
            info!(kind, name = %name, place = %target.describe(), "adopted");
            Ok(true)
        }
    }
}

/// One merge patch of the KVMMachine: clusterctl's block-move annotation set or removed (while
/// a Pod is being created), where the machine Pod keeps its etcd data (`etcd`, once it is on a
/// node), and `spec.providerID` when it has none. Nothing to change, no request. Returns the
/// patched object, if patched.
async fn patch_machine(
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
    if let Some(etcd) = etcd.filter(|e| EtcdHostDir::annotated(km).as_ref() != Some(*e)) {
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
    let patched = report::merge_patch(api, km, "KVMMachine", &patch).await?;
    Ok(Some(patched))
}

/// The bootstrap data, as far as the Ignition Secret needs it.
enum Bootstrap {
    /// The Ignition Secret was rendered from the bootstrap data's current version (and this
    /// controller's converter): nothing to read or render.
    Rendered,
    /// The bootstrap data to render: the Secret's `value` and `format`, and what it is (the
    /// Ignition Secret's annotation, [`ignition_secret::rendered_from`]).
    Read {
        value: Vec<u8>,
        format: Option<String>,
        source: String,
    },
}

/// Fetches the bootstrap data Secret `name` (next to the KVMMachine), unless the Ignition
/// Secret (in `target`) was rendered from its current version. `None` while it does not exist.
async fn fetch_bootstrap(
    km: &KVMMachine,
    name: &str,
    target: &Target,
    ctx: &Context,
) -> Result<Option<Bootstrap>> {
    let ns = km.namespace().ok_or(Error::MissingNamespace)?;
    let Some(meta) = ctx.caches.secret(&ns, name) else {
        return Ok(None);
    };
    let source = ignition_secret::rendered_from(name, &meta.resource_version().unwrap_or_default());
    let current = target.secret(&names::ignition_secret_name(km));
    if current.is_some_and(|s| s.annotations().get(RENDERED_FROM_ANNOTATION) == Some(&source)) {
        return Ok(Some(Bootstrap::Rendered));
    }
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(secret) = secrets
        .get_opt(name)
        .await
        .map_err(read_err("Secret", name))?
    else {
        return Ok(None);
    };
    // Render from what was read, recorded with the version that was read.
    let source =
        ignition_secret::rendered_from(name, &secret.resource_version().unwrap_or_default());
    let data = secret.data.unwrap_or_default();
    Ok(Some(Bootstrap::Read {
        value: data.get("value").map(|b| b.0.clone()).unwrap_or_default(),
        format: data
            .get("format")
            .map(|b| String::from_utf8_lossy(&b.0).into_owned()),
        source,
    }))
}

/// What the pipeline found: where the machine is, its Pod and what the Pod's readiness gate
/// says about its Node.
struct Observed {
    state: MachineState,
    pod: Option<Pod>,
    gate: Option<Gate>,
}

impl Observed {
    fn waiting(state: MachineState) -> Self {
        Self {
            state,
            pod: None,
            gate: None,
        }
    }
}

/// The KVMMachine pipeline, top to bottom: fetch the owner Machine → validate the spec (pure, as
/// early as the machine's role is known) → fetch the Cluster and the bootstrap data → build every
/// desired object (pure) → apply them → write the status, once. A step that cannot go on says why
/// in the status; nothing after it runs.
async fn apply(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    (machine, cluster, kvm_cluster): (Option<&Machine>, Option<&Cluster>, Option<&KVMCluster>),
    ctx: &Context,
) -> Result<Action> {
    let defaults = &ctx.settings.machine_defaults;
    // The KVMMachine as last written by this reconcile.
    let mut current = km.clone();
    // Where the objects live, once known.
    let mut target: Option<Target> = None;
    let observed = 'pipeline: {
        // 1. Fetch the owner Machine: where it puts this machine.
        let Some(machine) = machine else {
            break 'pipeline Observed::waiting(MachineState::WaitingForMachineOwner);
        };
        let placement = MachinePlacement::of(machine);

        // 2. Validate the spec: one the launcher or the apiserver would refuse is the user's to
        // fix (a condition, a Warning Event), at once, and nothing is applied for it.
        let valid = match validate::validate(km, &placement, defaults, &ctx.settings.tenant_policy)
        {
            Ok(v) => v,
            Err(e) => {
                let msg = e.to_string();
                warn_once(ctx, km, status::REASON_SPEC_INVALID, &msg).await;
                break 'pipeline Observed::waiting(MachineState::SpecInvalid(msg));
            }
        };

        // 3. Fetch what the machine is built from: its Cluster's infrastructure, the bootstrap
        // data.
        if !cluster.is_some_and(Cluster::infrastructure_provisioned) {
            break 'pipeline Observed::waiting(MachineState::WaitingForClusterInfrastructure);
        }
        // Where the machine's objects live: its KVMCluster says. A hosting cluster that cannot
        // be used now is a condition, and nothing there is touched meanwhile: a Pod not seen is
        // not a Pod lost.
        let ns = km.namespace().ok_or(Error::MissingNamespace)?;
        let there = match target_of(ctx, &ns, kvm_cluster).await {
            Ok(t) => target.insert(t),
            Err(u) => {
                break 'pipeline Observed::waiting(MachineState::HostingUnavailable(u.condition()));
            }
        };
        let Some(secret_name) = machine.spec.bootstrap.data_secret_name.as_deref() else {
            break 'pipeline Observed::waiting(MachineState::WaitingForBootstrapData);
        };
        let Some(bootstrap) = fetch_bootstrap(km, secret_name, there, ctx).await? else {
            let name = secret_name.to_owned();
            break 'pipeline Observed::waiting(MachineState::WaitingForBootstrapSecret(name));
        };

        // 4. Build every desired object. Bootstrap data that does not convert is the user's
        // (or the bootstrap provider's) to fix, like a bad spec.
        let ignition = match bootstrap {
            Bootstrap::Rendered => None,
            Bootstrap::Read {
                value,
                format,
                source,
            } => match ignition_secret::render(km, format.as_deref(), &value) {
                Ok(json) => Some(ignition_secret::desired(
                    km,
                    &placement,
                    &there.home,
                    json,
                    &source,
                )),
                Err(msg) => {
                    warn_once(ctx, km, status::REASON_BOOTSTRAP_DATA_INVALID, &msg).await;
                    break 'pipeline Observed::waiting(MachineState::BootstrapDataInvalid(msg));
                }
            },
        };
        let claim = etcd_claim::desired(km, &placement, &there.home);
        let desired_pod = pod::machine_pod(km, &placement, &there.home, &valid, defaults);

        // 5. Apply: the Ignition Secret, the etcd PVC, then the machine Pod. What exists under
        // their names is adopted when its labels name this machine (a moved KVMMachine, a switch
        // to an explicit hosting cluster) and refused when they name someone else: nothing is
        // ever made twice, nobody else's object taken over.
        let owner = Owner::machine(km);
        let secrets: Api<Secret> = there.api();
        let secret_name = names::ignition_secret_name(km);
        let existing = match there.secret(&secret_name) {
            Some(meta) => Some(meta.metadata.clone()),
            // A hosting cluster's cache holds only Secrets labelled as ours: before an apply
            // (which would overwrite whatever has the name), ask whether another one exists.
            None if ignition.is_some() && !there.home.management => secrets
                .get_metadata_opt(&secret_name)
                .await
                .map_err(read_err("Secret", &secret_name))?
                .map(|m| m.metadata),
            None => None,
        };
        if let Some(meta) = existing {
            // A new rendering's apply (below) sets labels and owner references itself; only a
            // foreign Secret must stop it.
            let foreign = crate::ownership::claim(&meta, &owner, &there.home) == Claim::Foreign;
            if ignition.is_none() || foreign {
                adopt(&secrets, "Secret", &meta, &owner, there).await?;
            }
        }
        if let Some(secret) = ignition {
            apply_object(&secrets, &secret, "Secret").await?;
        }
        if let Some(pvc) = claim {
            let pvcs: Api<PersistentVolumeClaim> = there.api();
            match there.claim(&pvc.name_any()) {
                Some(meta) => {
                    adopt(
                        &pvcs,
                        "PersistentVolumeClaim",
                        &meta.metadata,
                        &owner,
                        there,
                    )
                    .await?;
                }
                None => {
                    let (stored, new) =
                        create_if_absent(&pvcs, &pvc, "PersistentVolumeClaim").await?;
                    if !new {
                        adopt(
                            &pvcs,
                            "PersistentVolumeClaim",
                            &stored.metadata,
                            &owner,
                            there,
                        )
                        .await?;
                    }
                }
            }
        }
        let pods: Api<Pod> = there.api();
        let pod_name = names::pod_name(km);
        let was_provisioned = km
            .status
            .as_ref()
            .and_then(|s| s.initialization.as_ref())
            .and_then(|i| i.provisioned)
            .unwrap_or(false);
        // The cache can lag: a provisioned machine whose Pod the cache does not show is checked
        // with the apiserver before it is declared lost.
        let existing = match there.pod(&pod_name) {
            Some(p) => Some((*p).clone()),
            None if was_provisioned => pods
                .get_opt(&pod_name)
                .await
                .map_err(read_err("Pod", &pod_name))?,
            None => None,
        };
        // A provisioned machine whose Pod is gone (or failed for good) lost its VM and ephemeral
        // disks: report it and let a MachineHealthCheck replace the Machine, rather than
        // silently booting a fresh VM under the same Machine.
        let lost = was_provisioned
            && existing.as_ref().is_none_or(|p| {
                p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed")
            });
        if lost {
            let msg = format!(
                "machine Pod {pod_name} is gone or failed; the VM is lost and the Machine needs replacing"
            );
            if !has_ready_reason(km, status::REASON_MACHINE_POD_MISSING, "") {
                let reason = status::REASON_MACHINE_POD_MISSING;
                publish(ctx, km, EventType::Warning, reason, msg).await;
            }
            break 'pipeline Observed {
                state: MachineState::PodMissing,
                pod: existing,
                gate: None,
            };
        }
        // A Pod's spec is immutable: it is created once, and drift is not patched.
        let existing = match existing {
            Some(p) => {
                if adopt(&pods, "Pod", &p.metadata, &owner, there).await? {
                    let note = format!("adopted machine Pod {pod_name} in {}", there.describe());
                    publish(ctx, km, EventType::Normal, "MachinePodAdopted", note).await;
                }
                p
            }
            None => {
                // clusterctl move waits while a Pod is being created: a moved KVMMachine whose
                // Pod creation was cut short would otherwise look unprovisioned forever.
                if let Some(patched) = patch_machine(api, km, true, None).await? {
                    current = patched;
                }
                info!(pod = %pod_name, "creating machine Pod");
                let (created, new) = create_if_absent(&pods, &desired_pod, "Pod").await?;
                if new {
                    let note = format!("created machine Pod {pod_name} in {}", there.describe());
                    publish(ctx, km, EventType::Normal, "MachinePodCreated", note).await;
                } else if adopt(&pods, "Pod", &created.metadata, &owner, there).await? {
                    let note = format!("adopted machine Pod {pod_name} in {}", there.describe());
                    publish(ctx, km, EventType::Normal, "MachinePodAdopted", note).await;
                }
                created
            }
        };

        // The Node in the workload cluster: the Pod's readiness gate follows it (the Node watch
        // wakes this machine when it changes). A kubeconfig that is refused or unusable is the
        // user's to fix: a Warning Event, once.
        let kubeconfig = ctx
            .caches
            .secret(&ns, &kubeconfig_secret_name(&placement.cluster))
            .map(|m| m.resource_version().unwrap_or_default());
        let gate = ctx
            .workloads
            .node_gate(
                &ctx.client,
                kubeconfig.as_deref(),
                &ns,
                &placement.cluster,
                &names::hostname(km),
                NodeFacts {
                    provider_id: &provider_id(&ns, &km.name_any()),
                    pod_node: pod_node(&existing, there),
                },
            )
            .await;
        if [REASON_KUBECONFIG_REFUSED, REASON_KUBECONFIG_INVALID].contains(&gate.reason)
            && !has_condition(km, &status::node_condition(Some(&gate)))
        {
            publish(
                ctx,
                km,
                EventType::Warning,
                gate.reason,
                gate.message.clone(),
            )
            .await;
        }
        // The node image cannot be fetched or verified: the user's to fix (the URL, the
        // digest, the mirror), a Warning Event, once per message.
        let state = status::pod_state(&existing);
        if let MachineState::NodeImageFailed {
            reason, message, ..
        } = &state
        {
            warn_once(ctx, km, reason, message).await;
        }
        Observed {
            state,
            pod: Some(existing),
            gate: Some(gate),
        }
    };

    // 6. Status: one write. Then what may only follow it: with the Pod recorded, clusterctl
    // move may go (and providerID is set here if a restart came between the Pod's creation and
    // the first patch); the Pod's readiness gate.
    // Unseen (the hosting cluster cannot be used): the Pod's and the Node's conditions stay as
    // last seen.
    let conditions: Vec<DesiredCondition> = match &observed.state {
        MachineState::HostingUnavailable(hosting) => vec![hosting.clone()],
        _ => {
            let mut c = status::pod_conditions(observed.pod.as_ref());
            c.push(status::node_condition(observed.gate.as_ref()));
            c.extend(target.as_ref().map(Target::condition));
            c
        }
    };
    let failure_domain = machine.and_then(|m| m.spec.failure_domain.as_deref());
    // Where the etcd data is, once the Pod is on a node: deletion removes it from there, even
    // when the Pod is gone by then.
    let etcd = observed.pod.as_ref().and_then(EtcdHostDir::of_pod);
    write_status(
        api,
        &current,
        &observed.state,
        &conditions,
        failure_domain,
        etcd.as_ref(),
    )
    .await?;
    if let (Some(pod), Some(gate), Some(there)) = (&observed.pod, &observed.gate, &target) {
        patch_machine(api, &current, false, etcd.as_ref()).await?;
        if let Err(e) = set_gate(&there.api(), pod, gate).await {
            warn!(error = %e, "cannot set the machine Pod's readiness gate");
        }
    }
    if matches!(observed.state, MachineState::HostingUnavailable(_)) {
        // Recovery wakes this machine; this is a safety net.
        return Ok(Action::requeue(Duration::from_secs(60)));
    }
    Ok(Action::await_change())
}

/// Publishes a Warning Event for a condition the user must act on, unless the KVMMachine's
/// `Ready` condition already reports it (the Event went out with it).
async fn warn_once(ctx: &Context, km: &KVMMachine, reason: &str, msg: &str) {
    if !has_ready_reason(km, reason, msg) {
        publish(ctx, km, EventType::Warning, reason, msg.to_owned()).await;
    }
}

/// The node the machine Pod runs on, once scheduled, in the cluster `there` (whose topology
/// labels the workload Node gets).
fn pod_node<'a>(pod: &'a Pod, there: &'a Target) -> Option<PodNode<'a>> {
    let name = pod.spec.as_ref()?.node_name.as_deref()?;
    Some(PodNode {
        client: &there.client,
        name,
    })
}

/// Whether the KVMMachine's `Ready` condition already reports `reason` with `detail` in its
/// message (so the Warning Event for it was published).
fn has_ready_reason(km: &KVMMachine, reason: &str, detail: &str) -> bool {
    km.status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .and_then(|cs| crate::conditions::find(cs, "Ready"))
        .is_some_and(|c| c.reason == reason && c.message.contains(detail))
}

/// Whether the KVMMachine already shows condition `c` (same status, reason and message).
fn has_condition(km: &KVMMachine, c: &crate::conditions::DesiredCondition) -> bool {
    let status = if c.status { "True" } else { "False" };
    km.status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .and_then(|cs| crate::conditions::find(cs, c.type_))
        .is_some_and(|cur| {
            cur.status == status && cur.reason == c.reason && cur.message == c.message
        })
}

/// Creates `obj` unless it exists; returns the stored object and whether it was created.
async fn create_if_absent<K>(api: &Api<K>, obj: &K, kind: &'static str) -> Result<(K, bool)>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    match api.create(&PostParams::default(), obj).await {
        Ok(o) => Ok((o, true)),
        Err(kube::Error::Api(s)) if s.code == 409 => {
            let o = api.get(&name).await.map_err(read_err(kind, &name))?;
            Ok((o, false))
        }
        Err(source) => Err(Error::Apply { kind, name, source }),
    }
}

async fn apply_object<K>(api: &Api<K>, obj: &K, kind: &'static str) -> Result<()>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(obj),
    )
    .await
    .map_err(|source| Error::Apply { kind, name, source })?;
    Ok(())
}

/// Deletes the Pod (the launcher shuts the guest down by ACPI), then the Secret and the etcd
/// PVC, wherever they live and only when they are this machine's, then its etcd data on the MC
/// node ([`remove_etcd_data`]); the finalizer goes once the Pod is gone so no VM outlives its
/// KVMMachine. A hosting cluster that cannot be reached holds the finalizer (and says so) until
/// it can.
async fn cleanup(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    kvm_cluster: Option<&KVMCluster>,
    ctx: &Context,
) -> Result<Action> {
    let ns = km.namespace().ok_or(Error::MissingNamespace)?;
    let there = match target_of(ctx, &ns, kvm_cluster).await {
        Ok(t) => t,
        Err(u) => {
            let state = MachineState::HostingUnavailable(u.condition());
            write_status(api, km, &state, &[u.condition()], None, None).await?;
            return Err(Error::HostingUnavailable(u.message));
        }
    };
    let owner = Owner::machine(km);
    let pods: Api<Pod> = there.api();
    let name = names::pod_name(km);
    let pod = pods.get_opt(&name).await.map_err(read_err("Pod", &name))?;
    match pod {
        Some(pod) if owner.owns(&pod.metadata) => {
            // Where its etcd data is, recorded before the Pod goes (if apply has not yet). A
            // record made is left as it is: the annotation is no longer set back, so an edit of
            // it during the deletion stops the cleanup ([`remove_etcd_data`]).
            if let Some(etcd) = EtcdHostDir::of_pod(&pod)
                && EtcdHostDir::recorded(km).is_none()
            {
                record_etcd_dir(api, km, &etcd).await?;
            }
            if pod.metadata.deletion_timestamp.is_none() {
                pods.delete(&name, &DeleteParams::default())
                    .await
                    .map_err(|source| Error::Delete {
                        kind: "Pod",
                        name: name.clone(),
                        source,
                    })?;
            }
            // The Pod's deletion event wakes us; the requeue is a safety net.
            return Err(Error::PodStillTerminating(name));
        }
        Some(_) => {
            warn!(pod = %name, place = %there.describe(), "not deleting a Pod that belongs to someone else")
        }
        None => {}
    }
    let secrets: Api<Secret> = there.api();
    delete_if_owned(&secrets, "Secret", &names::ignition_secret_name(km), &owner).await?;
    let pvcs: Api<PersistentVolumeClaim> = there.api();
    delete_if_owned(
        &pvcs,
        "PersistentVolumeClaim",
        &names::etcd_claim_name(km),
        &owner,
    )
    .await?;
    remove_etcd_data(api, km, &there, ctx).await
}

/// Condition reason and Event reason: the cleanup Pod removes the etcd data.
pub const REASON_REMOVING_ETCD_DATA: &str = "RemovingEtcdData";
/// Warning Event and condition reason: a cleanup Pod failed; another follows after a back-off.
pub const REASON_ETCD_CLEANUP_FAILED: &str = "EtcdCleanupFailed";
/// Normal Event: the etcd data is gone from the MC node.
pub const REASON_ETCD_DATA_REMOVED: &str = "EtcdDataRemoved";
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
        .map_err(read_err("KVMMachine", &km.name_any()))?
    else {
        return done;
    };
    let km = &fresh;
    let annotated = EtcdHostDir::annotated(km);
    let Some(recorded) = EtcdHostDir::recorded(km) else {
        // Only the annotation, which the KVMMachine's author can write, names a directory:
        // nothing is removed on its word.
        if let Some(a) = annotated {
            forget_etcd_dir(api, km).await?;
            let why = format!(
                "only the annotation {} names it, not status.etcdHostDir (recorded by the \
                 controller from the machine Pod), so nothing is removed",
                etcd_cleanup::ETCD_HOST_DIR_ANNOTATION
            );
            give_up(ctx, km, &a.node, &a.dir, &why).await;
        }
        return done;
    };
    if let Some(a) = annotated.filter(|a| *a != recorded) {
        forget_etcd_dir(api, km).await?;
        let why = format!(
            "the annotation {} was changed to {:?} after the controller recorded the directory, \
             so nothing is removed",
            etcd_cleanup::ETCD_HOST_DIR_ANNOTATION,
            a.annotation()
        );
        give_up(ctx, km, &recorded.node, &recorded.dir, &why).await;
        return done;
    }
    let allowed = &ctx.settings.tenant_policy.etcd_host_path_prefixes;
    let dir = match recorded.removable(km, allowed) {
        Ok(d) => d,
        Err(why) => {
            forget_etcd_dir(api, km).await?;
            give_up(ctx, km, &recorded.node, &recorded.dir, &why).await;
            return done;
        }
    };
    let pods: Api<Pod> = there.api();
    let name = etcd_cleanup::pod_name_of(km);
    let existing = pods.get_opt(&name).await.map_err(read_err("Pod", &name))?;
    if let Some(p) = &existing
        && !Owner::machine(km).owns(&p.metadata)
    {
        return Err(Error::Foreign {
            kind: "Pod",
            name,
            place: there.describe(),
        });
    }
    let phase = existing
        .as_ref()
        .and_then(|p| p.status.as_ref()?.phase.clone())
        .unwrap_or_else(|| "Pending".into());
    if existing.is_some() && phase == "Succeeded" {
        report::delete_if_present(&pods, "Pod", &name).await?;
        forget_etcd_dir(api, km).await?;
        let note = format!("removed {} on node {}", dir.path(), dir.node);
        info!(node = %dir.node, dir = %dir.path(), "etcd data removed");
        publish(ctx, km, EventType::Normal, REASON_ETCD_DATA_REMOVED, note).await;
        return done;
    }
    let now = Timestamp::now();
    let attempt = existing.as_ref().and_then(Attempt::of);
    let why_not = if attempt.as_ref().is_some_and(|a| a.expired(now)) {
        Some(format!(
            "the cleanup Pod {name} did not succeed within {} minutes (phase {phase})",
            etcd_cleanup::GIVE_UP_AFTER.as_secs() / 60
        ))
    } else if node_gone(&there.client, &dir.node).await {
        Some(format!("node {} no longer exists", dir.node))
    } else {
        None
    };
    if let Some(why) = why_not {
        report::delete_if_present(&pods, "Pod", &name).await?;
        forget_etcd_dir(api, km).await?;
        give_up(ctx, km, &dir.node, &dir.path(), &why).await;
        return done;
    }
    let waiting = |message: String, retry: Duration| Error::EtcdCleanupPending { message, retry };
    let next = match (&existing, attempt) {
        (None, _) => Attempt::first(now),
        (Some(p), attempt) if phase == "Failed" => {
            let attempt = attempt.unwrap_or_else(|| Attempt::first(now));
            let label = format!("attempt {}", attempt.number);
            let msg = format!(
                "{label} to remove {} on node {} failed: {}",
                dir.path(),
                dir.node,
                etcd_cleanup::failure(p)
            );
            if !has_ready_reason(km, REASON_ETCD_CLEANUP_FAILED, &label) {
                let reason = REASON_ETCD_CLEANUP_FAILED;
                let note = format!("{msg}; retrying in {}s", attempt.backoff().as_secs());
                publish(ctx, km, EventType::Warning, reason, note).await;
                let state = MachineState::Deleting {
                    reason,
                    message: msg.clone(),
                };
                write_status(api, km, &state, &[], None, None).await?;
            }
            let due = etcd_cleanup::finished_at(p).unwrap_or(now)
                + k8s_openapi::jiff::SignedDuration::try_from(attempt.backoff())
                    .unwrap_or_default();
            if now < due {
                let wait = now.duration_until(due).unsigned_abs();
                return Err(waiting(msg, wait));
            }
            // A terminated Pod is deleted at once: its name is free again.
            report::delete_if_present(&pods, "Pod", &name).await?;
            let next = attempt.next();
            return create_cleanup_pod(api, km, there, ctx, &dir, &next, Some(&msg)).await;
        }
        (Some(_), _) => {
            let msg = format!(
                "cleanup Pod {name} removes {} on node {} (phase {phase})",
                dir.path(),
                dir.node
            );
            // Its changes wake us; the requeue is a safety net.
            return Err(waiting(msg, Duration::from_secs(10)));
        }
    };
    create_cleanup_pod(api, km, there, ctx, &dir, &next, None).await
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
    let cluster = km
        .labels()
        .get(CLUSTER_NAME_LABEL)
        .cloned()
        .unwrap_or_default();
    let image = &ctx.settings.machine_defaults.launcher_image;
    let pod = etcd_cleanup::cleanup_pod(km, &cluster, &there.home, dir, image, attempt);
    let name = etcd_cleanup::pod_name_of(km);
    let pods: Api<Pod> = there.api();
    match pods.create(&PostParams::default(), &pod).await {
        Ok(_) => {}
        // Made meanwhile (a second reconcile): it is looked at next time.
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        // Refused for good (the namespace is being deleted, admission, quota, RBAC): retrying
        // would hold the deletion forever.
        Err(kube::Error::Api(s)) if etcd_cleanup::refusal(&s, &there.home.namespace).is_some() => {
            let why = etcd_cleanup::refusal(&s, &there.home.namespace).unwrap_or_default();
            forget_etcd_dir(api, km).await?;
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
    write_status(api, km, &state, &[], None, None).await?;
    Err(Error::EtcdCleanupPending {
        message,
        retry: Duration::from_secs(10),
    })
}

/// Removes the record of the etcd data's directory from the KVMMachine: the cleanup is over
/// (done or given up), and a reconcile that comes after it (from a cache that still shows the
/// finalizer) finds nothing to do.
async fn forget_etcd_dir(api: &Api<KVMMachine>, km: &KVMMachine) -> Result<()> {
    if EtcdHostDir::recorded(km).is_some() {
        report::write_status(
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
        report::merge_patch(api, km, "KVMMachine", &patch).await?;
    }
    Ok(())
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
    publish(ctx, km, EventType::Warning, REASON_ETCD_DATA_LEFT, note).await;
}

/// Deletes `name` when `owner` owns it.
async fn delete_if_owned<K>(
    api: &Api<K>,
    kind: &'static str,
    name: &str,
    owner: &Owner,
) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let meta = api
        .get_metadata_opt(name)
        .await
        .map_err(read_err(kind, name))?;
    if meta.is_some_and(|m| owner.owns(&m.metadata)) {
        report::delete_if_present(api, kind, name).await?;
    }
    Ok(())
}

/// The one status write: `state` with the Pod's conditions, and where the machine Pod keeps
/// its etcd data when `etcd` says (otherwise what status recorded stays).
async fn write_status(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    state: &MachineState,
    pod: &[crate::conditions::DesiredCondition],
    failure_domain: Option<&str>,
    etcd: Option<&EtcdHostDir>,
) -> Result<()> {
    report::write_status(
        api,
        km,
        |k| k.status.as_ref(),
        |k| {
            let mut s = status::status(k, state, pod, failure_domain, Timestamp::now());
            if let Some(etcd) = etcd {
                s.etcd_host_dir = Some(etcd.to_status());
            }
            s
        },
    )
    .await
}

/// Records where the machine Pod keeps its etcd data in the KVMMachine's status (the record
/// the cleanup trusts) and, for people and `clusterctl move`, in its annotation.
async fn record_etcd_dir(api: &Api<KVMMachine>, km: &KVMMachine, etcd: &EtcdHostDir) -> Result<()> {
    if EtcdHostDir::recorded(km).as_ref() != Some(etcd) {
        report::write_status(
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
    if EtcdHostDir::annotated(km).as_ref() != Some(etcd) {
        let patch = json!({"metadata": {"annotations": {
            etcd_cleanup::ETCD_HOST_DIR_ANNOTATION: etcd.annotation()}}});
        report::merge_patch(api, km, "KVMMachine", &patch).await?;
    }
    Ok(())
}

/// Requeue after a failure: when the step says (a Pod still terminating, an etcd cleanup), else
/// after the machine's back-off, which grows while it keeps failing.
pub fn error_policy(km: Arc<KVMMachine>, error: &Error, ctx: Arc<Context>) -> Action {
    report::requeue_after(&ctx, "KVMMachine", &*km, error)
}

#[cfg(test)]
pub(crate) mod testing {
    use capk_api::v1alpha1::KVMMachine;
    use serde_json::json;

    /// A KVMMachine `name` in namespace `team-a` with `spec`, as the apiserver would return it.
    pub fn kvm_machine(name: &str, spec: serde_json::Value) -> KVMMachine {
        let mut km: KVMMachine = serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
            "kind": "KVMMachine",
            "metadata": {"name": name, "namespace": "team-a", "uid": "uid-1"},
            "spec": spec,
        }))
        .unwrap();
        km.metadata.generation = Some(1);
        km
    }

    /// The management cluster, namespace `team-a`: where objects were always made.
    pub fn management() -> crate::ownership::Home {
        crate::ownership::Home {
            namespace: "team-a".into(),
            management: true,
        }
    }
}
