//! KVMMachine reconciler, a pipeline read top to bottom in [`apply`]: fetch (Machine, Cluster,
//! bootstrap data) → validate the spec ([`validate`], pure) → build the desired objects (pure,
//! one module each: [`ignition_secret`], [`etcd_claim`], [`pod`] with [`node_image`]) → apply
//! them → one status write ([`status`]).

pub mod etcd_claim;
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
        BLOCK_MOVE_ANNOTATION, KVMMACHINE_FINALIZER, PAUSED_ANNOTATION, RENDERED_FROM_ANNOTATION,
        provider_id,
    },
    v1alpha1::KVMMachine,
};
use k8s_openapi::{
    api::core::v1::{PersistentVolumeClaim, Pod, Secret},
    jiff::Timestamp,
};
use kube::{
    Api, Resource, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
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
use self::status::MachineState;
use crate::{
    context::{Context, FIELD_MANAGER},
    error::{Error, Result},
    report,
    workload::{
        Gate, REASON_KUBECONFIG_INVALID, REASON_KUBECONFIG_REFUSED, kubeconfig_secret_name,
        set_gate,
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
    let result = reconcile_inner(km.clone(), &ctx).await;
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
        write_status(&api, &km, &MachineState::Paused, &[], None).await?;
        return Ok(Action::await_change());
    }
    finalizer(&api, KVMMACHINE_FINALIZER, km, |event| async {
        match event {
            Finalizer::Apply(km) => {
                apply(&api, &km, machine.as_deref(), cluster.as_deref(), ctx).await
            }
            Finalizer::Cleanup(km) => cleanup(&km, ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

/// One merge patch of the KVMMachine: clusterctl's block-move annotation set or removed (while
/// a Pod is being created), and `spec.providerID` when it has none. Nothing to change, no
/// request. Returns the patched object, if patched.
async fn patch_machine(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    block: bool,
) -> Result<Option<KVMMachine>> {
    let ns = km.namespace().ok_or(Error::MissingNamespace)?;
    let mut patch = json!({});
    if km.annotations().contains_key(BLOCK_MOVE_ANNOTATION) != block {
        patch["metadata"] =
            json!({"annotations": {BLOCK_MOVE_ANNOTATION: block.then_some("true")}});
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

/// Fetches the bootstrap data Secret `name`, unless the Ignition Secret was rendered from its
/// current version. `None` while it does not exist.
async fn fetch_bootstrap(km: &KVMMachine, name: &str, ctx: &Context) -> Result<Option<Bootstrap>> {
    let ns = km.namespace().ok_or(Error::MissingNamespace)?;
    let Some(meta) = ctx.caches.secret(&ns, name) else {
        return Ok(None);
    };
    let source = ignition_secret::rendered_from(name, &meta.resource_version().unwrap_or_default());
    let current = ctx.caches.secret(&ns, &names::ignition_secret_name(km));
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
    machine: Option<&Machine>,
    cluster: Option<&Cluster>,
    ctx: &Context,
) -> Result<Action> {
    let ns = km.namespace().ok_or(Error::MissingNamespace)?;
    let defaults = &ctx.settings.machine_defaults;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    // The KVMMachine as last written by this reconcile.
    let mut current = km.clone();
    let observed = 'pipeline: {
        // 1. Fetch the owner Machine: where it puts this machine.
        let Some(machine) = machine else {
            break 'pipeline Observed::waiting(MachineState::WaitingForMachineOwner);
        };
        let placement = MachinePlacement::of(machine);

        // 2. Validate the spec: one the launcher or the apiserver would refuse is the user's to
        // fix (a condition, a Warning Event), at once, and nothing is applied for it.
        let valid = match validate::validate(km, &placement, defaults) {
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
        let Some(secret_name) = machine.spec.bootstrap.data_secret_name.as_deref() else {
            break 'pipeline Observed::waiting(MachineState::WaitingForBootstrapData);
        };
        let Some(bootstrap) = fetch_bootstrap(km, secret_name, ctx).await? else {
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
                Ok(json) => Some(ignition_secret::desired(km, &placement, json, &source)),
                Err(msg) => {
                    warn_once(ctx, km, status::REASON_BOOTSTRAP_DATA_INVALID, &msg).await;
                    break 'pipeline Observed::waiting(MachineState::BootstrapDataInvalid(msg));
                }
            },
        };
        let claim = etcd_claim::desired(km, &placement);
        let desired_pod = pod::machine_pod(km, &placement, &valid, defaults);

        // 5. Apply: the Ignition Secret, the etcd PVC, then the machine Pod.
        if let Some(secret) = ignition {
            apply_object(&Api::namespaced(ctx.client.clone(), &ns), &secret, "Secret").await?;
        }
        if let Some(pvc) = claim {
            let cached = ctx
                .caches
                .claims
                .get(&ObjectRef::new(&pvc.name_any()).within(&ns));
            if cached.is_none() {
                let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
                create_if_absent(&pvcs, &pvc, "PersistentVolumeClaim").await?;
            }
        }
        let pod_name = names::pod_name(km);
        let was_provisioned = km
            .status
            .as_ref()
            .and_then(|s| s.initialization.as_ref())
            .and_then(|i| i.provisioned)
            .unwrap_or(false);
        // The cache can lag: a provisioned machine whose Pod the cache does not show is checked
        // with the apiserver before it is declared lost.
        let existing = match ctx.caches.pods.get(&ObjectRef::new(&pod_name).within(&ns)) {
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
            Some(p) => p,
            None => {
                // clusterctl move waits while a Pod is being created: a moved KVMMachine whose
                // Pod creation was cut short would otherwise look unprovisioned forever.
                if let Some(patched) = patch_machine(api, km, true).await? {
                    current = patched;
                }
                info!(pod = %pod_name, "creating machine Pod");
                let (created, new) = create_if_absent(&pods, &desired_pod, "Pod").await?;
                if new {
                    let note = format!("created machine Pod {pod_name}");
                    publish(ctx, km, EventType::Normal, "MachinePodCreated", note).await;
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
                &provider_id(&ns, &km.name_any()),
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
        Observed {
            state: status::pod_state(&existing),
            pod: Some(existing),
            gate: Some(gate),
        }
    };

    // 6. Status: one write. Then what may only follow it: with the Pod recorded, clusterctl
    // move may go (and providerID is set here if a restart came between the Pod's creation and
    // the first patch); the Pod's readiness gate.
    let mut conditions = status::pod_conditions(observed.pod.as_ref());
    conditions.push(status::node_condition(observed.gate.as_ref()));
    let failure_domain = machine.and_then(|m| m.spec.failure_domain.as_deref());
    write_status(api, &current, &observed.state, &conditions, failure_domain).await?;
    if let (Some(pod), Some(gate)) = (&observed.pod, &observed.gate) {
        patch_machine(api, &current, false).await?;
        if let Err(e) = set_gate(&pods, pod, gate).await {
            warn!(error = %e, "cannot set the machine Pod's readiness gate");
        }
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
/// PVC; the finalizer goes once the Pod is gone so no VM outlives its KVMMachine.
async fn cleanup(km: &KVMMachine, ctx: &Context) -> Result<Action> {
    let ns = km.namespace().ok_or(Error::MissingNamespace)?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let name = names::pod_name(km);
    if let Some(pod) = pods.get_opt(&name).await.map_err(read_err("Pod", &name))? {
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
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    report::delete_if_present(&secrets, "Secret", &names::ignition_secret_name(km)).await?;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    report::delete_if_present(&pvcs, "PersistentVolumeClaim", &names::etcd_claim_name(km)).await?;
    Ok(Action::await_change())
}

async fn write_status(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    state: &MachineState,
    pod: &[crate::conditions::DesiredCondition],
    failure_domain: Option<&str>,
) -> Result<()> {
    report::write_status(
        api,
        km,
        |k| k.status.as_ref(),
        |k| status::status(k, state, pod, failure_domain, Timestamp::now()),
    )
    .await
}

/// Requeue after a failure; a Pod still terminating is checked again soon.
pub fn error_policy(_km: Arc<KVMMachine>, error: &Error, _ctx: Arc<Context>) -> Action {
    match error {
        Error::Finalizer(_) => Action::requeue(Duration::from_secs(2)),
        _ => Action::requeue(Duration::from_secs(10)),
    }
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
}
