//! KVMMachine reconciler: fetch (Machine, Cluster, bootstrap Secret) → build (pure, in
//! [`build`]) → apply (Ignition Secret, etcd PVC, machine Pod) → status.

pub mod build;

use std::{sync::Arc, time::Duration};

use capk_api::{
    capi::{Cluster, Machine},
    constants::{KVMMACHINE_FINALIZER, PAUSED_ANNOTATION, provider_id},
    v1alpha1::KVMMachine,
};
use capk_bootstrap::{BootstrapFormat, MachineFacts as BootFacts};
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
    },
};
use serde_json::json;
use tracing::{info, instrument, warn};

use self::build::{MachineFacts, MachineState};
use crate::{
    context::{Context, FIELD_MANAGER},
    error::{Error, Result},
    report,
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
    let api: Api<KVMMachine> = Api::namespaced(ctx.client.clone(), &ns);
    let machine = match owner_machine_name(&km) {
        Some(name) => Api::<Machine>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&name)
            .await
            .map_err(read_err("Machine", &name))?,
        None => None,
    };
    let cluster = match &machine {
        Some(m) if !m.spec.cluster_name.is_empty() => {
            Api::<Cluster>::namespaced(ctx.client.clone(), &ns)
                .get_opt(&m.spec.cluster_name)
                .await
                .map_err(read_err("Cluster", &m.spec.cluster_name))?
        }
        _ => None,
    };
    let paused = cluster.as_ref().is_some_and(Cluster::is_paused)
        || km.annotations().contains_key(PAUSED_ANNOTATION);
    if paused {
        write_status(&api, &km, &MachineState::Paused, None).await?;
        return Ok(Action::await_change());
    }
    finalizer(&api, KVMMACHINE_FINALIZER, km, |event| async {
        match event {
            Finalizer::Apply(km) => apply(&api, &km, machine.as_ref(), cluster.as_ref(), ctx).await,
            Finalizer::Cleanup(km) => cleanup(&km, ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

async fn apply(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    machine: Option<&Machine>,
    cluster: Option<&Cluster>,
    ctx: &Context,
) -> Result<Action> {
    let ns = km.namespace().ok_or(Error::MissingNamespace)?;
    let Some(machine) = machine else {
        write_status(api, km, &MachineState::WaitingForMachineOwner, None).await?;
        return Ok(Action::await_change());
    };
    let fd = machine.spec.failure_domain.as_deref();
    if !cluster.is_some_and(Cluster::infrastructure_provisioned) {
        write_status(api, km, &MachineState::WaitingForClusterInfrastructure, fd).await?;
        return Ok(Action::await_change());
    }
    let Some(secret_name) = machine.spec.bootstrap.data_secret_name.clone() else {
        write_status(api, km, &MachineState::WaitingForBootstrapData, fd).await?;
        return Ok(Action::await_change());
    };
    let facts = MachineFacts {
        cluster: machine.spec.cluster_name.clone(),
        control_plane: machine.is_control_plane(),
        failure_domain: machine.spec.failure_domain.clone(),
    };

    // Bootstrap data → Ignition Secret. A conversion error is the user's to fix: a condition
    // and an Event say what is wrong, and no Pod is created.
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let bootstrap = secrets
        .get_opt(&secret_name)
        .await
        .map_err(read_err("Secret", &secret_name))?;
    let Some(bootstrap) = bootstrap else {
        write_status(api, km, &MachineState::WaitingForBootstrapData, fd).await?;
        return Ok(Action::await_change());
    };
    let data = bootstrap.data.clone().unwrap_or_default();
    let value = data.get("value").map(|b| b.0.clone()).unwrap_or_default();
    let format = data
        .get("format")
        .map(|b| String::from_utf8_lossy(&b.0).into_owned());
    let boot_facts = BootFacts {
        hostname: build::hostname(km),
        instance_id: provider_id(&ns, &km.name_any()),
    };
    let rendered = BootstrapFormat::from_secret(format.as_deref())
        .and_then(|f| capk_bootstrap::render_ignition(f, &value, &boot_facts, None));
    let ignition = match rendered {
        Ok(r) => r.json,
        Err(e) => {
            let msg = e.to_string();
            if km
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_none_or(|cs| {
                    !cs.iter()
                        .any(|c| c.reason == "BootstrapDataInvalid" && c.message.contains(&msg))
                })
            {
                publish(
                    ctx,
                    km,
                    EventType::Warning,
                    "BootstrapDataInvalid",
                    msg.clone(),
                )
                .await;
            }
            write_status(api, km, &MachineState::BootstrapDataInvalid(msg), fd).await?;
            return Ok(Action::await_change());
        }
    };
    let secret = build::ignition_secret(km, &facts, ignition);
    apply_object(&secrets, &secret, "Secret").await?;

    if let Some(pvc) = build::etcd_claim(km, &facts) {
        let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
        if pvcs
            .get_opt(&pvc.name_any())
            .await
            .map_err(read_err("PersistentVolumeClaim", &pvc.name_any()))?
            .is_none()
        {
            pvcs.create(&PostParams::default(), &pvc)
                .await
                .map_err(|source| Error::Apply {
                    kind: "PersistentVolumeClaim",
                    name: pvc.name_any(),
                    source,
                })?;
        }
    }

    // The machine Pod: created once; a Pod's spec is immutable, so drift is not patched.
    let pod = match build::machine_pod(km, &facts, &ctx.settings.machine_defaults) {
        Ok(p) => p,
        Err(e) => {
            write_status(
                api,
                km,
                &MachineState::BootstrapDataInvalid(e.to_string()),
                fd,
            )
            .await?;
            return Ok(Action::await_change());
        }
    };
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let pod_name = pod.name_any();
    let existing = pods
        .get_opt(&pod_name)
        .await
        .map_err(read_err("Pod", &pod_name))?;
    let was_provisioned = km
        .status
        .as_ref()
        .and_then(|s| s.initialization.as_ref())
        .and_then(|i| i.provisioned)
        .unwrap_or(false);
    // A provisioned machine whose Pod is gone (or failed for good) lost its VM and ephemeral
    // disks: report it and let a MachineHealthCheck replace the Machine, rather than silently
    // booting a fresh VM under the same Machine.
    let lost = match &existing {
        None => was_provisioned,
        Some(p) => {
            was_provisioned && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed")
        }
    };
    if lost {
        let already = km
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.reason == "MachinePodMissing"));
        if !already {
            publish(
                ctx,
                km,
                EventType::Warning,
                "MachinePodMissing",
                format!("machine Pod {pod_name} is gone or failed; the VM is lost and the Machine needs replacing"),
            )
            .await;
        }
        write_status(api, km, &MachineState::PodMissing, fd).await?;
        return Ok(Action::await_change());
    }
    let existing = match existing {
        Some(p) => p,
        None => {
            info!(pod = %pod_name, "creating machine Pod");
            let created = pods
                .create(&PostParams::default(), &pod)
                .await
                .map_err(|source| Error::Apply {
                    kind: "Pod",
                    name: pod_name.clone(),
                    source,
                })?;
            publish(
                ctx,
                km,
                EventType::Normal,
                "MachinePodCreated",
                format!("created machine Pod {pod_name}"),
            )
            .await;
            created
        }
    };

    if km.spec.provider_id.is_none() {
        let patch = json!({"spec": {"providerID": provider_id(&ns, &km.name_any())}});
        api.patch(
            &km.name_any(),
            &PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..Default::default()
            },
            &Patch::Merge(&patch),
        )
        .await
        .map_err(|source| Error::Apply {
            kind: "KVMMachine",
            name: km.name_any(),
            source,
        })?;
    }

    let state = pod_state(&existing);
    write_status(api, km, &state, fd).await?;

    // The readiness gate follows the workload cluster's Node. Until it is Ready, look again
    // periodically: Nodes live in another cluster, whose changes do not reach our watches.
    let gate = match crate::workload::client(&ctx.client, &ns, &facts.cluster).await {
        Ok(wc) => {
            crate::workload::sync_node(&wc, &build::hostname(km), &provider_id(&ns, &km.name_any()))
                .await
        }
        Err(gate) => gate,
    };
    if let Err(e) = crate::workload::set_gate(&pods, &existing, &gate).await {
        warn!(error = %e, "cannot set the machine Pod's readiness gate");
    }
    Ok(Action::requeue(if gate.ready {
        NODE_POLL_READY
    } else {
        NODE_POLL
    }))
}

/// How often a machine whose Node is not Ready (yet) looks at the workload cluster again.
const NODE_POLL: Duration = Duration::from_secs(5);
/// How often a machine with a Ready Node checks that it still is (reads only; no writes when
/// nothing changed).
const NODE_POLL_READY: Duration = Duration::from_secs(30);

/// Reads the machine Pod's state: running with an IP, or starting (with why).
fn pod_state(pod: &Pod) -> MachineState {
    let name = pod.name_any();
    let status = pod.status.clone().unwrap_or_default();
    let running = status
        .container_statuses
        .as_ref()
        .and_then(|cs| cs.iter().find(|c| c.name == "launcher"))
        .and_then(|c| c.state.as_ref())
        .is_some_and(|s| s.running.is_some());
    match (status.phase.as_deref(), status.pod_ip, running) {
        (Some("Running"), Some(ip), true) => MachineState::Running { pod: name, ip },
        (phase, _, _) => MachineState::PodStarting {
            pod: name,
            detail: format!(
                "phase {}{}",
                phase.unwrap_or("Pending"),
                status.reason.map(|r| format!(" ({r})")).unwrap_or_default()
            ),
        },
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
    let name = build::pod_name(km);
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
    delete_if_present(&secrets, &build::ignition_secret_name(km), "Secret").await?;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    delete_if_present(&pvcs, &build::etcd_claim_name(km), "PersistentVolumeClaim").await?;
    Ok(Action::await_change())
}

async fn delete_if_present<K>(api: &Api<K>, name: &str, kind: &'static str) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
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

async fn write_status(
    api: &Api<KVMMachine>,
    km: &KVMMachine,
    state: &MachineState,
    failure_domain: Option<&str>,
) -> Result<()> {
    report::write_status(
        api,
        km,
        |k| k.status.as_ref(),
        |k| build::status(k, state, failure_domain, Timestamp::now()),
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
