//! End to end on the local management cluster (`make e2e`).
//!
//! The user's journey with real components: Cluster API's core, kubeadm bootstrap and control-plane
//! controllers and this provider, installed by the real `clusterctl init` (`make dev-up`), a real
//! kubelet and containerd running the machine Pods, and in each Pod capk-launcher booting the test
//! guest's bootable disk under QEMU (TCG) from the node image container. What is not real, said
//! plainly: the guest's `kubeadm` only records its arguments and its "apiserver" answers `/readyz`
//! only (images/test-guest/README.md), so no workload Node ever registers. Hence the workers get a
//! bootstrap data Secret of their own (CABPK writes join data only after a real control plane
//! initialised), and their MachineDeployment skips the MachineSet preflight checks (which wait for
//! a stable control plane) and rolls with maxUnavailable 1 (a new Machine never becomes Available).
//!
//! The machines live where the shipped controller puts them, in the management cluster's machine
//! namespace ([`MACHINE_NS`]), not in the cluster's namespace: that one is created as a tenant's,
//! Pod Security `baseline` enforced, and holds no Pod.
//!
//! Every step asserts with a timeout; on failure everything useful goes to `_output/e2e/`
//! ([`harness`]: the local management cluster, `generate_cluster`, waits). [`stub`] is the
//! journey on the stub guest, [`workload`] the one with real nodes, [`bench`] the machine
//! benchmark.
//!
//! [`operating`]: the controller's metrics as a real Prometheus scrapes them, and the shipped
//! VerticalPodAutoscaler object under the real VPA.
//!
//! [`topology`]: a Cluster of the ClusterClass `kvm` with a NodePort control-plane Service: its
//! kubeconfig works from the host, and a changed variable rotates a template and rolls the
//! Machines.
//!
//! `make e2e-move` adds a second local management cluster and moves a cluster to it with the
//! real `clusterctl move` ([`pivot`]).

use std::{
    collections::BTreeMap,
    path::PathBuf,
    process::{Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail};
use capk_api::constants::{
    CLUSTER_NAME_LABEL, KVMCLUSTER_LABEL, KVMMACHINE_LABEL, OWNER_NAMESPACE_LABEL,
};
use serde_json::{Value, json};

#[path = "e2e/bench.rs"]
mod bench;
#[path = "e2e/harness.rs"]
mod harness;
#[path = "e2e/operating.rs"]
mod operating;
#[path = "e2e/pivot.rs"]
mod pivot;
#[path = "e2e/stub.rs"]
mod stub;
#[path = "e2e/topology.rs"]
mod topology;
#[path = "e2e/workload.rs"]
mod workload;

use bench::*;
use harness::*;
use stub::*;

#[test]
#[ignore = "end to end on the local management cluster: `make e2e`"]
fn cluster_journey_on_the_local_management_cluster() {
    run_scenario("capk-e2e", the_journey);
}

#[test]
#[ignore = "a real workload cluster on the local management cluster, minutes under TCG: `make e2e`"]
fn workload_cluster_journey_on_the_local_management_cluster() {
    run_scenario("capk-e2e-workload", workload::workload_journey);
}

#[test]
#[ignore = "metrics scraped by Prometheus and the controller under the VPA, on the local management cluster: `make e2e`"]
fn operating_the_controller_on_the_local_management_cluster() {
    run_scenario("capk-e2e-operating", operating::operating_journey);
}

#[test]
#[ignore = "a ClusterClass cluster reached through a NodePort, a variable changed, on the local management cluster: `make e2e`"]
fn cluster_class_journey_on_the_local_management_cluster() {
    run_scenario("capk-e2e-topology", topology::topology_journey);
}

#[test]
#[ignore = "clusterctl move between two local management clusters: `make e2e-move`"]
fn cluster_move_between_management_clusters() {
    run_scenario("capk-e2e-move", pivot::move_journey);
}

#[test]
#[ignore = "benchmark on the local management cluster: `make bench-e2e`"]
fn bench_e2e_machine_boot_and_pod_overhead() {
    run_scenario("capk-bench", bench);
}

#[test]
#[ignore = "benchmark of real nodes on the local management cluster: `make bench-e2e-workload`"]
fn bench_e2e_workload_nodes() {
    run_scenario("capk-bench-workload", workload::workload_bench);
}

#[test]
#[ignore = "benchmark of an idle real cluster on the local management cluster: `make bench-idle-nodes`"]
fn bench_idle_nodes() {
    run_scenario("capk-bench-idle", workload::idle_nodes_bench);
}
