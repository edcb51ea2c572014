//! KVMMachineTemplate: `status.capacity` and `status.nodeInfo` for the cluster autoscaler's
//! scale from zero (the Cluster API InfraMachineTemplate contract, "support cluster autoscaling
//! from zero"): what a Node made from the template will have, known before any exists.
//!
//! The status is a pure function of the spec ([`status`]); the reconcile writes it when it
//! differs. Templates are immutable, so each is written once (and again after `clusterctl move`,
//! which does not copy status). A template paused by `cluster.x-k8s.io/paused` is left alone.

use std::{collections::BTreeMap, sync::Arc};

use capk_api::{
    constants::PAUSED_ANNOTATION,
    v1alpha1::{KVMMachineSpec, KVMMachineTemplate, KVMMachineTemplateStatus, NodeInfo},
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::{
    Api, ResourceExt,
    runtime::{
        Controller,
        controller::{Action, Config},
        watcher,
    },
};
use tracing::instrument;

use crate::{
    k8s::caches::{api, cached, strip_kvm_machine_template},
    k8s::objects,
    runtime::context::Context,
    runtime::error::{Error, Result},
    runtime::outcome,
};

/// The CPU architecture of every VM: the launcher runs `qemu-system-x86_64`.
pub const ARCHITECTURE: &str = "amd64";
/// The operating system of every node image.
pub const OPERATING_SYSTEM: &str = "linux";

/// What a Node of a KVMMachine with `spec` reports as its capacity: the vCPUs, the VM's memory
/// and, as `ephemeral-storage`, the disk that holds the kubelet's directory (its own disk when
/// `kubeletVolumeSize` is set, else the root disk).
pub fn capacity(spec: &KVMMachineSpec) -> BTreeMap<String, Quantity> {
    let r = &spec.resources;
    let ephemeral = r.kubelet_volume_size.as_ref().unwrap_or(&r.disk);
    BTreeMap::from([
        ("cpu".to_owned(), Quantity(r.cpu.to_string())),
        ("memory".to_owned(), Quantity(r.memory.0.clone())),
        (
            "ephemeral-storage".to_owned(),
            Quantity(ephemeral.0.clone()),
        ),
    ])
}

/// The status a template with this spec has.
pub fn status(template: &KVMMachineTemplate) -> KVMMachineTemplateStatus {
    KVMMachineTemplateStatus {
        capacity: Some(capacity(&template.spec.template.spec)),
        node_info: Some(NodeInfo {
            architecture: Some(ARCHITECTURE.to_owned()),
            operating_system: Some(OPERATING_SYSTEM.to_owned()),
        }),
    }
}

/// Writes the template's status when it differs from [`status`].
#[instrument(skip_all, fields(kvmmachinetemplate = %template.name_any(), namespace = template.namespace().unwrap_or_default()))]
pub async fn reconcile(template: Arc<KVMMachineTemplate>, ctx: Arc<Context>) -> Result<Action> {
    if template.annotations().contains_key(PAUSED_ANNOTATION) {
        return Ok(Action::await_change());
    }
    let ns = template.namespace().ok_or(Error::MissingNamespace)?;
    let api: Api<KVMMachineTemplate> = Api::namespaced(ctx.client.clone(), &ns);
    objects::write_status(&api, &*template, |t| t.status.as_ref(), status).await?;
    Ok(Action::await_change())
}

/// Requeue after a failed status write, with the template's back-off.
pub fn error_policy(template: Arc<KVMMachineTemplate>, error: &Error, ctx: Arc<Context>) -> Action {
    outcome::requeue_after(&ctx, "KVMMachineTemplate", &*template, error)
}

/// Runs the KVMMachineTemplate controller until `stopped`: only a template's own spec matters
/// (the autoscaler's capacity).
pub async fn run(
    ctx: Arc<Context>,
    config: Config,
    stopped: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let ns = ctx.settings.namespace.clone();
    let (templates, changes) = cached(
        api::<KVMMachineTemplate>(&ctx.client, ns.as_deref()),
        watcher::Config::default(),
        strip_kvm_machine_template,
    );
    let results = Controller::for_stream(changes, templates)
        .with_config(config)
        .graceful_shutdown_on(stopped)
        .run(reconcile, error_policy, ctx.clone());
    outcome::finish_each(results, &ctx, "KVMMachineTemplate").await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(resources: serde_json::Value) -> KVMMachineTemplate {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMMachineTemplate",
            "metadata": {"name": "workers", "namespace": "ns"},
            "spec": {"template": {"spec": {"resources": resources}}},
        }))
        .unwrap()
    }

    #[test]
    fn capacity_is_the_vms_cpus_memory_and_the_kubelets_disk() {
        let s = status(&template(
            serde_json::json!({"cpu": 2, "memory": "4Gi", "disk": "20Gi"}),
        ));
        let c = s.capacity.unwrap();
        assert_eq!(c["cpu"].0, "2");
        assert_eq!(c["memory"].0, "4Gi");
        assert_eq!(c["ephemeral-storage"].0, "20Gi");
        let info = s.node_info.unwrap();
        assert_eq!(info.architecture.as_deref(), Some("amd64"));
        assert_eq!(info.operating_system.as_deref(), Some("linux"));

        let own_disk = status(&template(serde_json::json!(
            {"cpu": 1, "memory": "1Gi", "disk": "20Gi", "kubeletVolumeSize": "50Gi"}
        )));
        assert_eq!(own_disk.capacity.unwrap()["ephemeral-storage"].0, "50Gi");
    }
}
