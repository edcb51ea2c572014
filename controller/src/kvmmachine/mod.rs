//! KVMMachine reconciler. [`reconcile`] finds what the machine hangs on (its Machine, Cluster
//! and KVMCluster, from the caches), leaves a paused machine alone and hands over to the
//! finalizer: [`apply`] below, or [`delete`] once the KVMMachine is being deleted.
//!
//! [`apply`] is the pipeline, read top to bottom: fetch the owner Machine → validate the spec
//! ([`validate`], pure) → fetch the Cluster's infrastructure, where the objects live
//! ([`crate::remote::hosting`]) and the bootstrap data → build the desired objects (pure, one module
//! each: [`ignition_secret`], [`etcd_claim`], [`pod`] with [`node_image`]) → ensure them
//! ([`crate::k8s::objects`]: the rendered Secret applied, the PVC and Pod made once or adopted) →
//! the workload Node's gate
//! ([`crate::remote::workload`]) → one status write ([`status`] builds it, [`writes`] writes it).
//! [`delete`] stops the machine Pod, deletes what was made for it and removes its etcd data
//! from the MC node ([`etcd_cleanup`]). What wakes a reconcile, and the controller: [`watches`].

pub mod delete;
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
pub mod watches;
pub mod writes;

use std::{ops::ControlFlow, sync::Arc, time::Duration};

use capk_api::{
    capi::{Cluster, Machine},
    constants::{
        CLUSTER_NAME_LABEL, CONDITION_HOSTING_CLUSTER_AVAILABLE, KVMMACHINE_FINALIZER,
        PAUSED_ANNOTATION, RENDERED_FROM_ANNOTATION, provider_id,
    },
    v1alpha1::{KVMCluster, KVMMachine},
};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret};
use kube::{
    Api, ResourceExt,
    runtime::{
        controller::Action,
        events::EventType,
        finalizer::{Event as Finalizer, finalizer},
        reflector::ObjectRef,
    },
};
use tracing::{info, instrument, warn};

pub use self::placement::MachinePlacement;
use self::{etcd_cleanup::EtcdHostDir, names::MachineNames, status::MachineState};
use crate::{
    k8s::conditions::DesiredCondition,
    k8s::objects::{self, Ensured, read_error},
    k8s::ownership::{self, Claim, Owner},
    remote::hosting::{HostingKey, Target, Unavailable, machine_namespace},
    remote::workload::{
        Gate, NodeFacts, PodNode, REASON_KUBECONFIG_INVALID, REASON_KUBECONFIG_MISSING,
        REASON_KUBECONFIG_REFUSED, kubeconfig_secret_name, set_gate,
    },
    runtime::context::Context,
    runtime::error::{Error, Result},
    runtime::outcome,
};

/// Reconciles one KVMMachine; publishes a Warning Event when a step fails.
#[instrument(skip_all, fields(kvmmachine = %km.name_any(), namespace = km.namespace().unwrap_or_default()))]
pub async fn reconcile(km: Arc<KVMMachine>, ctx: Arc<Context>) -> Result<Action> {
    outcome::reconciled(&ctx, "KVMMachine", &*km, reconcile_inner(km.clone(), &ctx)).await
}

async fn reconcile_inner(km: Arc<KVMMachine>, ctx: &Context) -> Result<Action> {
    let ns = km.namespace().ok_or(Error::MissingNamespace)?;
    ctx.caches.ready().await;
    let api: Api<KVMMachine> = Api::namespaced(ctx.client.clone(), &ns);
    let machine = ownership::capi_owner(&*km, "Machine")
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
        writes::status(&api, &km, &MachineState::Paused, &[], None, None, None).await?;
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
            Finalizer::Cleanup(km) => {
                let there = target_of(ctx, &km, kvm_cluster.as_deref(), true).await;
                delete::delete(&api, &km, there, ctx).await
            }
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
            .map_err(read_error("KVMCluster", &infra.name))?;
        return Ok(read.map(Arc::new));
    }
    let Some(name) = machine
        .map(|m| m.spec.cluster_name.clone())
        .filter(|n| !n.is_empty())
        .or_else(|| ownership::cluster_of(km))
    else {
        return Ok(None);
    };
    Ok(ctx.caches.kvm_clusters.state().into_iter().find(|kc| {
        kc.namespace().as_deref() == Some(ns)
            && ownership::cluster_of(&**kc).as_ref() == Some(&name)
    }))
}

/// Where the machine's objects live: as its KVMCluster says once it has chosen. Without a
/// KVMCluster, or (`deleting`) one that never chose, the management cluster: where the
/// machine's Pod was recorded, else the operator's machine namespace.
async fn target_of(
    ctx: &Context,
    km: &KVMMachine,
    kvm_cluster: Option<&KVMCluster>,
    deleting: bool,
) -> std::result::Result<Target, Unavailable> {
    let ns = km.namespace().unwrap_or_default();
    match kvm_cluster {
        Some(kc)
            if !deleting || HostingKey::of(kc).is_some() || machine_namespace(kc).is_some() =>
        {
            let kubeconfig = crate::kvmcluster::hosting_kubeconfig(ctx, kc).await?;
            ctx.hosting
                .target(&ctx.client, &ctx.caches.objects(), kc, kubeconfig)
                .await
        }
        _ => {
            let chosen = ctx.settings.machine_namespace.of(&ns);
            let there = km
                .status
                .as_ref()
                .and_then(|s| s.pod_namespace.clone())
                .unwrap_or(chosen);
            Ok(Target::management(
                &ctx.client,
                ctx.caches.objects(),
                &ns,
                &there,
            ))
        }
    }
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

/// Fetches the bootstrap data Secret `name` of cluster `cluster` (next to the KVMMachine),
/// unless the Ignition Secret `ignition` (in `target`) was rendered from its current version.
/// `None` while it does not exist. The cache holds it by its cluster-name label, which Cluster
/// API's bootstrap contract asks for and the controller adds when it is missing.
async fn fetch_bootstrap(
    km: &KVMMachine,
    (name, cluster): (&str, &str),
    target: &Target,
    ignition: &str,
    ctx: &Context,
) -> Result<Option<Bootstrap>> {
    let ns = km.namespace().ok_or(Error::MissingNamespace)?;
    let label = (CLUSTER_NAME_LABEL, cluster);
    let Some(meta) =
        objects::labelled_secret(&ctx.client, &ctx.caches.secrets, &ns, name, label).await?
    else {
        return Ok(None);
    };
    let source = ignition_secret::rendered_from(name, &meta.resource_version().unwrap_or_default());
    let current = target.secret(ignition);
    if current.is_some_and(|s| s.annotations().get(RENDERED_FROM_ANNOTATION) == Some(&source)) {
        return Ok(Some(Bootstrap::Rendered));
    }
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(secret) = secrets
        .get_opt(name)
        .await
        .map_err(read_error("Secret", name))?
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

/// A step of the pipeline: go on with its result, or stop with what was observed so far.
type Step<T> = ControlFlow<Observed, T>;

/// Stops the pipeline with `Observed::waiting(state)`.
fn wait<T>(state: MachineState) -> Step<T> {
    ControlFlow::Break(Observed::waiting(state))
}

/// The value of a step that went on; a step that stopped ends the pipeline with its observation.
macro_rules! step {
    ($e:expr) => {
        match $e {
            ControlFlow::Continue(value) => value,
            ControlFlow::Break(observed) => return Ok(observed),
        }
    };
}

/// What the pipeline changed as it went, for the status write after it.
struct Progress {
    /// The KVMMachine as last written by this reconcile.
    current: KVMMachine,
    /// Where the objects live, once known.
    target: Option<Target>,
}

/// The KVMMachine pipeline: [`pipeline`] (fetch → validate → locate → bootstrap → build → ensure
/// → gate), then [`record`] (the status, once, and what follows it). A step that cannot go on
/// says why in the status; nothing after it runs.
async fn apply(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    found: (Option<&Machine>, Option<&Cluster>, Option<&KVMCluster>),
    ctx: &Context,
) -> Result<Action> {
    let mut progress = Progress {
        current: km.clone(),
        target: None,
    };
    let observed = pipeline(api, km, found, ctx, &mut progress).await?;
    record(api, found.0, progress, observed).await
}

/// fetch the owner Machine → validate the spec → locate where the objects live → fetch the
/// bootstrap data → build the desired objects (pure) → ensure them (the Ignition Secret, the etcd
/// PVC, the machine Pod) → the workload Node behind the Pod's readiness gate.
async fn pipeline(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    (machine, cluster, kvm_cluster): (Option<&Machine>, Option<&Cluster>, Option<&KVMCluster>),
    ctx: &Context,
    progress: &mut Progress,
) -> Result<Observed> {
    let Some(machine) = machine else {
        return Ok(Observed::waiting(MachineState::WaitingForMachineOwner));
    };
    let placement = MachinePlacement::of(machine);
    let valid = step!(validate_spec(ctx, km, &placement).await);
    let there = step!(locate(ctx, km, cluster, kvm_cluster, &mut progress.target).await);
    let names = MachineNames::in_home(km, &there.home);
    let bootstrap = step!(bootstrap(ctx, km, machine, &placement, there, &names).await?);
    let desired = step!(build(ctx, km, &placement, there, &names, &valid, bootstrap).await);
    ensure_ignition_secret(km, there, &names, desired.ignition).await?;
    ensure_claim(km, there, desired.claim).await?;
    let pod = step!(
        ensure_pod(
            api,
            ctx,
            km,
            there,
            &names,
            &desired.pod,
            &mut progress.current
        )
        .await?
    );
    observe_node(ctx, km, &placement, there, pod).await
}

/// Validates the spec: one the launcher or the apiserver would refuse is the user's to fix (a
/// condition, a Warning Event), at once, and nothing is applied for it.
async fn validate_spec(
    ctx: &Context,
    km: &KVMMachine,
    placement: &MachinePlacement,
) -> Step<validate::ValidSpec> {
    let defaults = &ctx.settings.machine_defaults;
    match validate::validate(km, placement, defaults, &ctx.settings.tenant_policy) {
        Ok(v) => ControlFlow::Continue(v),
        Err(e) => {
            let msg = e.to_string();
            warn_once(ctx, km, status::REASON_SPEC_INVALID, &msg).await;
            wait(MachineState::SpecInvalid(msg))
        }
    }
}

/// Where the machine's objects live, once its Cluster's infrastructure is provisioned: its
/// KVMCluster says. A hosting cluster that cannot be used now is a condition, and nothing there is
/// touched meanwhile: a Pod not seen is not a Pod lost.
async fn locate<'t>(
    ctx: &Context,
    km: &KVMMachine,
    cluster: Option<&Cluster>,
    kvm_cluster: Option<&KVMCluster>,
    target: &'t mut Option<Target>,
) -> Step<&'t Target> {
    if !cluster.is_some_and(Cluster::infrastructure_provisioned) {
        return wait(MachineState::WaitingForClusterInfrastructure);
    }
    match target_of(ctx, km, kvm_cluster, false).await {
        Ok(t) => ControlFlow::Continue(target.insert(t)),
        Err(u) => wait(MachineState::HostingUnavailable(
            u.condition(CONDITION_HOSTING_CLUSTER_AVAILABLE),
        )),
    }
}

/// The bootstrap data the Machine names, once it names one and it exists.
async fn bootstrap(
    ctx: &Context,
    km: &KVMMachine,
    machine: &Machine,
    placement: &MachinePlacement,
    there: &Target,
    names: &MachineNames,
) -> Result<Step<Bootstrap>> {
    let Some(secret_name) = machine.spec.bootstrap.data_secret_name.as_deref() else {
        return Ok(wait(MachineState::WaitingForBootstrapData));
    };
    let bootstrap_secret = (secret_name, placement.cluster.as_str());
    Ok(
        match fetch_bootstrap(km, bootstrap_secret, there, &names.ignition_secret, ctx).await? {
            Some(b) => ControlFlow::Continue(b),
            None => wait(MachineState::WaitingForBootstrapSecret(
                secret_name.to_owned(),
            )),
        },
    )
}

/// The objects a machine is made of, as they should be.
struct Desired {
    /// The Ignition Secret, when the bootstrap data was (re)rendered.
    ignition: Option<Secret>,
    /// The etcd PVC, when the machine keeps etcd on a persistent volume.
    claim: Option<PersistentVolumeClaim>,
    /// The machine Pod.
    pod: Pod,
}

/// Builds every desired object (pure). Bootstrap data that does not convert is the user's (or
/// the bootstrap provider's) to fix, like a bad spec.
async fn build(
    ctx: &Context,
    km: &KVMMachine,
    placement: &MachinePlacement,
    there: &Target,
    names: &MachineNames,
    valid: &validate::ValidSpec,
    bootstrap: Bootstrap,
) -> Step<Desired> {
    let ignition = match bootstrap {
        Bootstrap::Rendered => None,
        Bootstrap::Read {
            value,
            format,
            source,
        } => match ignition_secret::render(km, format.as_deref(), &value) {
            Ok(json) => Some(ignition_secret::desired(
                km,
                placement,
                &there.home,
                names,
                json,
                &source,
            )),
            Err(msg) => {
                warn_once(ctx, km, status::REASON_BOOTSTRAP_DATA_INVALID, &msg).await;
                return wait(MachineState::BootstrapDataInvalid(msg));
            }
        },
    };
    let defaults = &ctx.settings.machine_defaults;
    ControlFlow::Continue(Desired {
        ignition,
        claim: etcd_claim::desired(km, placement, &there.home, names),
        pod: pod::machine_pod(km, placement, &there.home, names, valid, defaults),
    })
}

/// The Ignition Secret: applied when (re)rendered; what exists under its name is adopted when
/// its labels name this machine and refused when they name someone else.
async fn ensure_ignition_secret(
    km: &KVMMachine,
    there: &Target,
    names: &MachineNames,
    ignition: Option<Secret>,
) -> Result<()> {
    let owner = Owner::machine(km);
    let secrets: Api<Secret> = there.api();
    let name = &names.ignition_secret;
    let existing = match there.secret(name) {
        Some(meta) => Some(meta.metadata.clone()),
        // A cache holds only labelled Secrets (ours in a hosting cluster, Cluster API's in the
        // management cluster): before an apply (which would overwrite whatever has the name),
        // ask whether another one exists.
        None if ignition.is_some() => secrets
            .get_metadata_opt(name)
            .await
            .map_err(read_error("Secret", name))?
            .map(|m| m.metadata),
        None => None,
    };
    if let Some(meta) = existing {
        // A new rendering's apply sets labels and owner references itself; only a foreign
        // Secret must stop it.
        let foreign = ownership::claim(&meta, &owner, &there.home) == Claim::Foreign;
        if ignition.is_none() || foreign {
            objects::adopt(&secrets, "Secret", &meta, &owner, there).await?;
        }
    }
    if let Some(secret) = ignition {
        objects::apply(&secrets, &secret, "Secret").await?;
    }
    Ok(())
}

/// The etcd PVC, made once ([`objects::ensure`]).
async fn ensure_claim(
    km: &KVMMachine,
    there: &Target,
    claim: Option<PersistentVolumeClaim>,
) -> Result<()> {
    let Some(pvc) = claim else {
        return Ok(());
    };
    let existing = there.claim(&pvc.name_any());
    let kind = "PersistentVolumeClaim";
    let existing = existing.as_ref().map(|m| &m.metadata);
    objects::ensure(
        &there.api(),
        kind,
        existing,
        &pvc,
        &Owner::machine(km),
        there,
    )
    .await?;
    Ok(())
}

/// The machine Pod, made once ([`objects::ensure`]: a Pod's spec is immutable, and drift is
/// not patched). A provisioned machine whose Pod is gone (or failed for good) lost its VM and
/// ephemeral disks: that is reported, and a MachineHealthCheck replaces the Machine, rather than
/// a fresh VM silently booting under the same Machine.
async fn ensure_pod(
    api: &Api<KVMMachine>,
    ctx: &Context,
    km: &KVMMachine,
    there: &Target,
    names: &MachineNames,
    desired: &Pod,
    current: &mut KVMMachine,
) -> Result<Step<Pod>> {
    let pods: Api<Pod> = there.api();
    let pod_name = &names.pod;
    let was_provisioned = km
        .status
        .as_ref()
        .is_some_and(|s| s.contract.is_provisioned());
    // The cache can lag: a provisioned machine whose Pod the cache does not show is checked with
    // the apiserver before it is declared lost.
    let existing = match there.pod(pod_name) {
        Some(p) => Some((*p).clone()),
        None if was_provisioned => pods
            .get_opt(pod_name)
            .await
            .map_err(read_error("Pod", pod_name))?,
        None => None,
    };
    let lost = was_provisioned
        && existing
            .as_ref()
            .is_none_or(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed"));
    if lost {
        let msg = format!(
            "machine Pod {pod_name} is gone or failed; the VM is lost and the Machine needs replacing"
        );
        if !status::has_ready_reason(km, status::REASON_MACHINE_POD_MISSING, "") {
            let reason = status::REASON_MACHINE_POD_MISSING;
            outcome::publish(ctx, km, EventType::Warning, reason, msg).await;
        }
        return Ok(ControlFlow::Break(Observed {
            state: MachineState::PodMissing,
            pod: existing,
            gate: None,
        }));
    }
    let owner = Owner::machine(km);
    let (pod, ensured) = match existing {
        Some(p) => {
            let meta = Some(&p.metadata);
            let ensured = objects::ensure(&pods, "Pod", meta, desired, &owner, there).await?;
            (p, ensured)
        }
        None => {
            // clusterctl move waits while a Pod is being created: a moved KVMMachine whose Pod
            // creation was cut short would otherwise look unprovisioned forever.
            if let Some(patched) = writes::patch_machine(api, km, true, None).await? {
                *current = patched;
            }
            info!(pod = %pod_name, "creating machine Pod");
            match objects::create_or_adopt(&pods, "Pod", desired, &owner, there).await {
                Err(Error::Apply {
                    source: kube::Error::Api(s),
                    ..
                }) if let Some(why) = status::pod_refusal(&s, pod_name, &there.describe()) => {
                    return refused(ctx, current, why).await;
                }
                created => created?,
            }
        }
    };
    let event = match ensured {
        Ensured::Created => Some(("MachinePodCreated", "created")),
        Ensured::Adopted => Some(("MachinePodAdopted", "adopted")),
        Ensured::Kept => None,
    };
    if let Some((reason, verb)) = event {
        let note = format!("{verb} machine Pod {pod_name} in {}", there.describe());
        outcome::publish(ctx, km, EventType::Normal, reason, note).await;
    }
    Ok(ControlFlow::Continue(pod))
}

/// The apiserver refused the machine Pod for good: the `Ready` condition and a Warning Event
/// say why (once). The Pod is tried again ([`POD_REFUSED_RETRY`]), so clusterctl's block-move
/// annotation, set before each try, stays.
async fn refused(ctx: &Context, current: &KVMMachine, why: String) -> Result<Step<Pod>> {
    warn_once(ctx, current, status::REASON_MACHINE_POD_REFUSED, &why).await;
    Ok(ControlFlow::Break(Observed {
        state: MachineState::PodRefused(why),
        pod: None,
        gate: None,
    }))
}

/// The Node in the workload cluster: the Pod's readiness gate follows it (the Node watch wakes
/// this machine when it changes). A kubeconfig that is refused or unusable, a node image that
/// cannot be fetched or verified: the user's to fix, a Warning Event, once.
async fn observe_node(
    ctx: &Context,
    km: &KVMMachine,
    placement: &MachinePlacement,
    there: &Target,
    pod: Pod,
) -> Result<Observed> {
    let ns = km.namespace().ok_or(Error::MissingNamespace)?;
    let kubeconfig = objects::labelled_secret(
        &ctx.client,
        &ctx.caches.secrets,
        &ns,
        &kubeconfig_secret_name(&placement.cluster),
        (CLUSTER_NAME_LABEL, &placement.cluster),
    )
    .await?
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
                pod_node: pod_node(&pod, there),
            },
        )
        .await;
    if [REASON_KUBECONFIG_REFUSED, REASON_KUBECONFIG_INVALID].contains(&gate.reason)
        && !status::has_condition(km, &status::node_condition(Some(&gate)))
    {
        let msg = gate.message.clone();
        outcome::publish(ctx, km, EventType::Warning, gate.reason, msg).await;
    }
    let state = status::pod_state(&pod);
    if let MachineState::NodeImageFailed {
        reason, message, ..
    } = &state
    {
        warn_once(ctx, km, reason, message).await;
    }
    Ok(Observed {
        state,
        pod: Some(pod),
        gate: Some(gate),
    })
}

/// The status, one write; then what may only follow it: with the Pod recorded, clusterctl move
/// may go (and providerID is set here if a restart came between the Pod's creation and the first
/// patch); the Pod's readiness gate. Returns when to look again ([`next_action`]).
async fn record(
    api: &Api<KVMMachine>,
    machine: Option<&Machine>,
    progress: Progress,
    observed: Observed,
) -> Result<Action> {
    let Progress { current, target } = progress;
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
    let pod_namespace = observed
        .pod
        .as_ref()
        .and_then(|p| p.metadata.namespace.as_deref());
    let state = &observed.state;
    writes::status(
        api,
        &current,
        state,
        &conditions,
        failure_domain,
        etcd.as_ref(),
        pod_namespace,
    )
    .await?;
    if let (Some(pod), Some(gate), Some(there)) = (&observed.pod, &observed.gate, &target) {
        // Blocked for clusterctl move while the Pod lives in the management cluster (a move
        // would delete it with this KVMMachine); with a hosting cluster, once it is adopted.
        let blocked = there.key().is_none();
        writes::patch_machine(api, &current, blocked, etcd.as_ref()).await?;
        if let Err(e) = set_gate(&there.api(), pod, gate).await {
            warn!(error = %e, "cannot set the machine Pod's readiness gate");
        }
    }
    next_action(&observed)
}

/// When to look at the machine again, from what the pipeline observed (pure).
fn next_action(observed: &Observed) -> Result<Action> {
    if matches!(observed.state, MachineState::HostingUnavailable(_)) {
        // Recovery wakes this machine; this is a safety net.
        return Ok(Action::requeue(Duration::from_secs(60)));
    }
    if matches!(observed.state, MachineState::PodRefused(_)) {
        // What lifts a refusal (a namespace label, a quota, a priority class) wakes nothing.
        return Ok(Action::requeue(POD_REFUSED_RETRY));
    }
    // The watch sees Secrets by their cluster label: one made without it (by hand) appears
    // unseen, and is looked for (and labelled) again at this pace.
    let waiting_for_secret = matches!(observed.state, MachineState::WaitingForBootstrapSecret(_))
        || observed
            .gate
            .as_ref()
            .is_some_and(|g| g.reason == REASON_KUBECONFIG_MISSING);
    if waiting_for_secret {
        return Ok(Action::requeue(UNLABELLED_SECRET_RECHECK));
    }
    // A workload cluster that failed is tried again after the machine's back-off, not at once
    // at the next change of anything.
    if let Some(gate) = observed.gate.as_ref().filter(|g| g.failed) {
        return Err(Error::WorkloadUnavailable(gate.message.clone()));
    }
    Ok(Action::await_change())
}

/// How often a machine whose Pod the apiserver refused tries again.
pub const POD_REFUSED_RETRY: Duration = Duration::from_secs(60);

/// How often a machine waiting for its bootstrap data or kubeconfig Secret looks for it while
/// the watch has not shown it (it may exist without the cluster label the watch selects).
pub const UNLABELLED_SECRET_RECHECK: Duration = Duration::from_secs(60);

/// Publishes a Warning Event for a condition the user must act on, unless the KVMMachine's
/// `Ready` condition already reports it (the Event went out with it).
async fn warn_once(ctx: &Context, km: &KVMMachine, reason: &str, msg: &str) {
    if !status::has_ready_reason(km, reason, msg) {
        outcome::publish(ctx, km, EventType::Warning, reason, msg.to_owned()).await;
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

/// Requeue after a failure: when the step says (a Pod still terminating, an etcd cleanup), else
/// after the machine's back-off, which grows while it keeps failing.
pub fn error_policy(km: Arc<KVMMachine>, error: &Error, ctx: Arc<Context>) -> Action {
    outcome::requeue_after(&ctx, "KVMMachine", &*km, error)
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
    pub fn management() -> crate::k8s::ownership::Home {
        crate::k8s::ownership::Home {
            namespace: "team-a".into(),
            management: true,
        }
    }
}
