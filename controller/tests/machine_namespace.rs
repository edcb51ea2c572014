//! Machine namespaces against a real kube-apiserver: the privileged machine Pods of a tenant's
//! cluster (and its Ignition Secrets, etcd PVCs and control-plane Service) live in a namespace
//! of the operator's, out of reach of whoever may exec into or create Pods in the tenant's
//! namespace; a cluster made before keeps its machines where they are. Each test has an
//! apiserver of its own: the controller watches every namespace, as shipped.

mod support;

use anyhow::Result;
use capk_api::{
    constants::name_hash,
    v1alpha1::{KVMCluster, KVMMachine},
};
use capk_controller::settings::MachineNamespace;
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret, Service};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams},
};
use serde_json::json;
use support::{control_plane_machine, create_namespace, eventually, start_controller_with};

const OWNER_NS_LABEL: &str = "infrastructure.cluster.x-k8s.io/owner-namespace";
const BOOTSTRAP: &str = "#cloud-config\nruncmd:\n- echo ok\n";

/// A kube-apiserver of the test's own, and the controller on it with `machines` as the
/// operator's machine namespace setting, watching all namespaces.
async fn controller(
    prefix: &str,
    machines: &str,
) -> Result<(
    capk_tests::env::TestEnv,
    Client,
    tokio::sync::oneshot::Sender<()>,
)> {
    let env = support::start_env(prefix);
    let client = env.client().await?;
    let stop = start_with(&client, machines)?;
    Ok((env, client, stop))
}

fn start_with(client: &Client, machines: &str) -> Result<tokio::sync::oneshot::Sender<()>> {
    let settings = capk_controller::Settings {
        namespace: None,
        machine_namespace: machines.parse::<MachineNamespace>()?,
        ..Default::default()
    };
    Ok(start_controller_with(client.clone(), settings))
}

/// Cluster `demo` in a new namespace `ns` and its KVMCluster, as a tenant makes them.
async fn tenant_cluster(client: &Client, ns: &str) -> Result<()> {
    create_namespace(client, ns).await?;
    support::kvm_cluster(client, ns, json!({})).await?;
    Ok(())
}

/// What the KVMCluster records as its machine namespace, once it has.
async fn recorded_namespace(client: &Client, ns: &str) -> Result<String> {
    let kcs: Api<KVMCluster> = Api::namespaced(client.clone(), ns);
    eventually(30, "status.machineNamespace", || async {
        Ok(kcs
            .get("demo")
            .await?
            .status
            .and_then(|s| s.machine_namespace))
    })
    .await
}

/// The machine Pod of KVMMachine `name` in `ns`, as its status names it: (namespace, Pod).
async fn machine_pod(client: &Client, ns: &str, name: &str) -> Result<(String, Pod)> {
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let (pod_ns, pod_name) = eventually(60, &format!("{name}'s Pod in its status"), || async {
        let status = kms.get(name).await?.status.unwrap_or_default();
        Ok(status.pod_namespace.zip(status.pod_name))
    })
    .await?;
    let pod = Api::<Pod>::namespaced(client.clone(), &pod_ns)
        .get(&pod_name)
        .await?;
    Ok((pod_ns, pod))
}

/// The Pods in `ns`.
async fn pods_in(client: &Client, ns: &str) -> Result<Vec<String>> {
    Ok(Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect())
}

#[tokio::test]
async fn a_tenants_machines_live_in_the_operators_namespace_and_go_with_them() -> Result<()> {
    let (_env, client, _stop) = controller("capk-machine-ns-", "capk-machines").await?;
    let tenant = "team-a";
    tenant_cluster(&client, tenant).await?;
    control_plane_machine(&client, tenant, "cp-0", BOOTSTRAP).await?;

    // The cluster's choice, and the namespace made for privileged Pods.
    assert_eq!(recorded_namespace(&client, tenant).await?, "capk-machines");
    let made = Api::<Namespace>::all(client.clone())
        .get("capk-machines")
        .await?;
    assert_eq!(
        made.labels()
            .get("pod-security.kubernetes.io/enforce")
            .map(String::as_str),
        Some("privileged")
    );

    // The machine Pod is there, named for its tenant, owned by labels only: no owner
    // reference can cross namespaces, and the tenant's namespace holds no Pod at all.
    let (pod_ns, pod) = machine_pod(&client, tenant, "cp-0").await?;
    assert_eq!(pod_ns, "capk-machines");
    assert_eq!(pod.name_any(), format!("cp-0-{}", name_hash(tenant)));
    assert_eq!(
        pod.labels().get(OWNER_NS_LABEL).map(String::as_str),
        Some(tenant)
    );
    assert!(pod.owner_references().is_empty(), "{:?}", pod.metadata);
    assert!(pods_in(&client, tenant).await?.is_empty());
    let privileged = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.iter().find(|c| c.name == "launcher"))
        .and_then(|c| c.security_context.as_ref())
        .and_then(|s| s.privileged);
    assert_eq!(
        privileged,
        Some(true),
        "the launcher runs QEMU with /dev/kvm"
    );

    // Its Ignition Secret is beside it; the tenant keeps only its bootstrap data.
    let tenant_secrets: Vec<String> = Api::<Secret>::namespaced(client.clone(), tenant)
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    assert_eq!(tenant_secrets, ["cp-0-bootstrap"]);
    let machine_secrets = Api::<Secret>::namespaced(client.clone(), "capk-machines")
        .list(&ListParams::default().labels(&format!("{OWNER_NS_LABEL}={tenant}")))
        .await?;
    assert_eq!(machine_secrets.items.len(), 1, "the Ignition Secret");

    // The control-plane Service too, and the endpoint names it there.
    let service = format!("demo-{}-apiserver", name_hash(tenant));
    let services: Api<Service> = Api::namespaced(client.clone(), "capk-machines");
    services.get(&service).await?;
    let kcs: Api<KVMCluster> = Api::namespaced(client.clone(), tenant);
    let host = eventually(30, "controlPlaneEndpoint", || async {
        Ok(kcs
            .get("demo")
            .await?
            .spec
            .control_plane_endpoint
            .and_then(|e| e.host))
    })
    .await?;
    assert_eq!(host, format!("{service}.capk-machines.svc.cluster.local"));
    let in_tenant = Api::<Service>::namespaced(client.clone(), tenant)
        .list(&ListParams::default())
        .await?;
    assert!(in_tenant.items.is_empty());

    // Deleting the machine and the cluster removes what was made for them there.
    Api::<KVMMachine>::namespaced(client.clone(), tenant)
        .delete("cp-0", &DeleteParams::default())
        .await?;
    eventually(60, "the machine Pod and Secret gone", || async {
        let pods = pods_in(&client, "capk-machines").await?;
        let secrets = Api::<Secret>::namespaced(client.clone(), "capk-machines")
            .list(&ListParams::default().labels(&format!("{OWNER_NS_LABEL}={tenant}")))
            .await?;
        Ok((pods.is_empty() && secrets.items.is_empty()).then_some(()))
    })
    .await?;
    kcs.delete("demo", &DeleteParams::default()).await?;
    eventually(60, "the control-plane Service gone", || async {
        Ok(services.get_opt(&service).await?.is_none().then_some(()))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_cluster_made_before_keeps_its_machines_where_they_run() -> Result<()> {
    // A release that kept machines beside their cluster made this one.
    let (_env, client, stop) = controller("capk-machine-ns-before-", "").await?;
    let tenant = "team-b";
    tenant_cluster(&client, tenant).await?;
    control_plane_machine(&client, tenant, "cp-0", BOOTSTRAP).await?;
    let (pod_ns, before) = machine_pod(&client, tenant, "cp-0").await?;
    assert_eq!(pod_ns, tenant);
    let kcs: Api<KVMCluster> = Api::namespaced(client.clone(), tenant);
    eventually(30, "the KVMCluster provisioned", || async {
        let status = kcs.get("demo").await?.status.unwrap_or_default();
        Ok(status
            .contract
            .initialization
            .and_then(|i| i.provisioned)
            .filter(|p| *p)
            .map(|_| ()))
    })
    .await?;
    drop(stop);
    // That release recorded no machine namespace.
    kcs.patch_status(
        "demo",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"machineNamespace": null}})),
    )
    .await?;

    // The operator now keeps machines apart: the running cluster stays where it is, its next
    // machine joins it there, and nothing is made in the machine namespace.
    let _stop = start_with(&client, "capk-machines")?;
    assert_eq!(recorded_namespace(&client, tenant).await?, tenant);
    support::control_plane_machine(&client, tenant, "cp-1", BOOTSTRAP).await?;
    let (pod_ns, _) = machine_pod(&client, tenant, "cp-1").await?;
    assert_eq!(pod_ns, tenant);
    let (_, after) = machine_pod(&client, tenant, "cp-0").await?;
    assert_eq!(
        after.uid(),
        before.uid(),
        "the running VM's Pod is untouched"
    );
    assert!(
        Api::<Namespace>::all(client.clone())
            .get_opt("capk-machines")
            .await?
            .is_none()
    );
    Ok(())
}

#[tokio::test]
async fn one_machine_namespace_per_tenant_when_the_operator_says_so() -> Result<()> {
    let (_env, client, _stop) = controller("capk-machine-ns-tenant-", "vms-{namespace}").await?;
    for tenant in ["team-c", "team-d"] {
        tenant_cluster(&client, tenant).await?;
        control_plane_machine(&client, tenant, "cp-0", BOOTSTRAP).await?;
    }
    for tenant in ["team-c", "team-d"] {
        let want = format!("vms-{tenant}");
        assert_eq!(recorded_namespace(&client, tenant).await?, want);
        let (pod_ns, pod) = machine_pod(&client, tenant, "cp-0").await?;
        assert_eq!(pod_ns, want);
        assert_eq!(pods_in(&client, &want).await?, [pod.name_any()]);
        assert!(pods_in(&client, tenant).await?.is_empty());
    }
    Ok(())
}

#[tokio::test]
async fn a_machine_namespace_that_is_a_tenants_is_refused() -> Result<()> {
    let (_env, client, _stop) = controller("capk-machine-ns-clash-", "vms-{namespace}").await?;
    // A tenant whose namespace is what the operator's template makes of another's.
    tenant_cluster(&client, "vms-team-e").await?;
    assert_eq!(
        recorded_namespace(&client, "vms-team-e").await?,
        "vms-vms-team-e"
    );
    tenant_cluster(&client, "team-e").await?;
    control_plane_machine(&client, "team-e", "cp-0", BOOTSTRAP).await?;
    let kcs: Api<KVMCluster> = Api::namespaced(client.clone(), "team-e");
    let message = eventually(30, "MachineNamespaceRefused", || async {
        let status = kcs.get("demo").await?.status.unwrap_or_default();
        Ok(status
            .contract
            .conditions
            .unwrap_or_default()
            .into_iter()
            .find(|c| {
                c.type_ == "HostingClusterAvailable"
                    && c.status == "False"
                    && c.reason == "MachineNamespaceRefused"
            })
            .map(|c| c.message))
    })
    .await?;
    assert!(
        message.contains("vms-team-e") && message.contains("CAPK_MACHINE_NAMESPACE"),
        "{message}"
    );
    // Nothing was recorded or made: no Pod of team-e's where vms-team-e's users may exec.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let status = kcs.get("demo").await?.status.unwrap_or_default();
    assert_eq!(status.machine_namespace, None);
    assert!(pods_in(&client, "vms-team-e").await?.is_empty());
    assert!(pods_in(&client, "team-e").await?.is_empty());
    Ok(())
}
