//! Pure: the KVMMachine's status from where it is on its way to a running VM and what its
//! machine Pod and Node say.

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use kube::{Resource, ResourceExt};

use super::names::hostname;
use capk_api::v1alpha1::KVMMachine;

/// Condition and Event reason of a spec that cannot be run.
pub const REASON_SPEC_INVALID: &str = "SpecInvalid";
/// Condition and Event reason of bootstrap data that does not convert to Ignition.
pub const REASON_BOOTSTRAP_DATA_INVALID: &str = "BootstrapDataInvalid";
/// Condition and Event reason of a node image the machine Pod could not download.
pub const REASON_IMAGE_DOWNLOAD_FAILED: &str = "ImageDownloadFailed";
/// Condition and Event reason of a node image that did not verify (digest, signature).
pub const REASON_IMAGE_VERIFICATION_FAILED: &str = "ImageVerificationFailed";
/// Condition and Event reason of a provisioned machine whose Pod (and VM) is gone.
pub const REASON_MACHINE_POD_MISSING: &str = "MachinePodMissing";
/// Condition and Event reason of a machine Pod the apiserver refuses to create (Pod Security
/// admission, a quota, a missing priority class, a webhook).
pub const REASON_MACHINE_POD_REFUSED: &str = "MachinePodRefused";

/// Where a KVMMachine is on its way to a running VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MachineState {
    /// No Machine owns the KVMMachine yet.
    WaitingForMachineOwner,
    /// Reconciliation is paused.
    Paused,
    /// The Cluster's infrastructure is not provisioned yet.
    WaitingForClusterInfrastructure,
    /// The Machine names no bootstrap data Secret yet.
    WaitingForBootstrapData,
    /// The Machine names a bootstrap data Secret that does not exist (yet).
    WaitingForBootstrapSecret(String),
    /// The bootstrap data cannot be turned into Ignition; the message says why.
    BootstrapDataInvalid(String),
    /// The KVMMachine's spec cannot be run (what the CRD's schema cannot check); the message
    /// names the field and says why.
    SpecInvalid(String),
    /// The Pod exists but the VM is not running yet.
    PodStarting {
        /// Pod name.
        pod: String,
        /// The Pod's phase and reason, for the message.
        detail: String,
    },
    /// The machine Pod's `fetch-image` init container failed (the kubelet retries it with
    /// back-off); the reason and message are its termination message's.
    NodeImageFailed {
        /// Pod name.
        pod: String,
        /// [`REASON_IMAGE_DOWNLOAD_FAILED`] or [`REASON_IMAGE_VERIFICATION_FAILED`].
        reason: &'static str,
        /// What failed: the URL (without credentials) and HTTP status, or both digests.
        message: String,
    },
    /// The machine Pod runs the VM.
    Running {
        /// Pod name.
        pod: String,
        /// Pod (= VM) IP.
        ip: String,
    },
    /// The machine Pod disappeared (or failed) after the VM ran; the Machine must be replaced.
    PodMissing,
    /// The apiserver refuses to create the machine Pod; the message says why and what to do
    /// ([`pod_refusal`]).
    PodRefused(String),
    /// The cluster where the machine's objects live cannot be used now (the
    /// `HostingClusterAvailable` condition says why). What was last seen stands: a provisioned
    /// machine stays provisioned and Ready, its VM runs on untouched.
    HostingUnavailable(crate::k8s::conditions::DesiredCondition),
    /// The KVMMachine is being deleted and waits for what the reason and message say (its etcd
    /// data being removed from the MC node).
    Deleting {
        /// CamelCase reason of `Ready`.
        reason: &'static str,
        /// What it waits for.
        message: String,
    },
}

/// A Kubernetes reason as a condition reason (CamelCase, no spaces), or `fallback`.
fn reason_or(reason: Option<&str>, fallback: &'static str) -> std::borrow::Cow<'static, str> {
    match reason {
        Some(r)
            if r.starts_with(|c: char| c.is_ascii_alphabetic())
                && r.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') =>
        {
            r.to_owned().into()
        }
        _ => fallback.into(),
    }
}

/// The conditions that follow the machine Pod: `PodScheduled` (the management cluster found it
/// a node), `VMRunning` (the launcher container runs; it exits when QEMU dies) and
/// `BootstrapCompleted` (the launcher's readiness probe: the guest reported bootstrap success).
pub fn pod_conditions(pod: Option<&Pod>) -> Vec<crate::k8s::conditions::DesiredCondition> {
    let Some(pod) = pod else {
        return no_pod_conditions();
    };
    let launcher = launcher_status(pod);
    vec![
        scheduled_condition(pod),
        vm_running_condition(launcher),
        bootstrap_condition(launcher),
    ]
}

/// The three Pod conditions, all false, when there is no machine Pod.
fn no_pod_conditions() -> Vec<crate::k8s::conditions::DesiredCondition> {
    use capk_api::constants::{
        CONDITION_BOOTSTRAP_COMPLETED, CONDITION_POD_SCHEDULED, CONDITION_VM_RUNNING,
    };
    [
        CONDITION_POD_SCHEDULED,
        CONDITION_VM_RUNNING,
        CONDITION_BOOTSTRAP_COMPLETED,
    ]
    .into_iter()
    .map(|t| {
        crate::k8s::conditions::DesiredCondition::falsy(
            t,
            "NoMachinePod",
            "there is no machine Pod",
        )
    })
    .collect()
}

/// The status of the machine Pod's `launcher` container, once the kubelet reports one.
fn launcher_status(pod: &Pod) -> Option<&ContainerStatus> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_deref()?
        .iter()
        .find(|c| c.name == "launcher")
}

/// `PodScheduled`: the node the machine Pod is scheduled to, or why it is not.
fn scheduled_condition(pod: &Pod) -> crate::k8s::conditions::DesiredCondition {
    use crate::k8s::conditions::DesiredCondition as C;
    use capk_api::constants::CONDITION_POD_SCHEDULED;
    let scheduled = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default()
        .iter()
        .find(|c| c.type_ == "PodScheduled");
    let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    match (scheduled, node) {
        (Some(c), Some(node)) if c.status == "True" => C::truthy(
            CONDITION_POD_SCHEDULED,
            "Scheduled",
            format!("machine Pod is scheduled to node {node}"),
        ),
        (Some(c), _) if c.status != "True" => C::falsy(
            CONDITION_POD_SCHEDULED,
            reason_or(c.reason.as_deref(), "Unschedulable"),
            c.message.clone().unwrap_or_default(),
        ),
        _ => C::falsy(
            CONDITION_POD_SCHEDULED,
            "WaitingForScheduler",
            "the machine Pod waits for the scheduler",
        ),
    }
}

/// `VMRunning`: whether the launcher container runs, with its restarts and last exit.
fn vm_running_condition(
    launcher: Option<&ContainerStatus>,
) -> crate::k8s::conditions::DesiredCondition {
    use crate::k8s::conditions::DesiredCondition as C;
    use capk_api::constants::CONDITION_VM_RUNNING;
    let restarts = launcher.map(|c| c.restart_count).unwrap_or(0);
    let history = format!("restarts: {restarts}{}", last_exit(launcher));
    let state = launcher.and_then(|c| c.state.as_ref());
    if state.is_some_and(|s| s.running.is_some()) {
        C::truthy(
            CONDITION_VM_RUNNING,
            "LauncherRunning",
            format!("the launcher runs the VM ({history})"),
        )
    } else if let Some(w) = state.and_then(|s| s.waiting.as_ref()) {
        C::falsy(
            CONDITION_VM_RUNNING,
            reason_or(w.reason.as_deref(), "LauncherWaiting"),
            format!(
                "{} ({history})",
                w.message
                    .as_deref()
                    .unwrap_or("the launcher container waits to start")
            ),
        )
    } else if let Some(t) = state.and_then(|s| s.terminated.as_ref()) {
        C::falsy(
            CONDITION_VM_RUNNING,
            "LauncherExited",
            format!(
                "the launcher exited with code {}: {}",
                t.exit_code,
                t.message.as_deref().unwrap_or("no message").trim()
            ),
        )
    } else {
        C::falsy(
            CONDITION_VM_RUNNING,
            "LauncherPending",
            "the launcher container has not started",
        )
    }
}

/// `; last exit: code N, message` of the launcher's previous run, or nothing.
fn last_exit(launcher: Option<&ContainerStatus>) -> String {
    launcher
        .and_then(|c| c.last_state.as_ref())
        .and_then(|s| s.terminated.as_ref())
        .map(|t| {
            format!(
                "; last exit: code {}{}",
                t.exit_code,
                t.message
                    .as_deref()
                    .map(|m| format!(", {}", m.trim()))
                    .unwrap_or_default()
            )
        })
        .unwrap_or_default()
}

/// `BootstrapCompleted`: the launcher's readiness (or, sooner, its startup probe) says the guest
/// reported bootstrap success.
///
/// The startup probe runs the readiness check every second until it first passes, and the
/// kubelet marks the container `started` at once; `ready` follows only at the readiness probe's
/// next period (up to 10 s later).
fn bootstrap_condition(
    launcher: Option<&ContainerStatus>,
) -> crate::k8s::conditions::DesiredCondition {
    use crate::k8s::conditions::DesiredCondition as C;
    use capk_api::constants::CONDITION_BOOTSTRAP_COMPLETED;
    let started = launcher
        .and_then(|c| c.state.as_ref())
        .is_some_and(|s| s.running.is_some())
        && launcher.is_some_and(|c| c.started == Some(true));
    if launcher.is_some_and(|c| c.ready) {
        C::truthy(
            CONDITION_BOOTSTRAP_COMPLETED,
            "BootstrapSucceeded",
            "the guest reported bootstrap success and sends heartbeats",
        )
    } else if started {
        C::truthy(
            CONDITION_BOOTSTRAP_COMPLETED,
            "BootstrapSucceeded",
            "the guest reported bootstrap success (capk-launcher's startup probe passed)",
        )
    } else {
        C::falsy(
            CONDITION_BOOTSTRAP_COMPLETED,
            "WaitingForBootstrap",
            "waiting for the guest to report bootstrap success (capk-launcher probe readiness)",
        )
    }
}

/// The `NodeReady` condition: what the machine Pod's readiness gate says about the workload
/// cluster's Node, or that there is no machine Pod to gate.
pub fn node_condition(
    gate: Option<&crate::remote::workload::Gate>,
) -> crate::k8s::conditions::DesiredCondition {
    use crate::k8s::conditions::DesiredCondition as C;
    use capk_api::constants::CONDITION_NODE_READY;
    match gate {
        Some(g) if g.ready => C::truthy(CONDITION_NODE_READY, g.reason, g.message.clone()),
        Some(g) => C::falsy(CONDITION_NODE_READY, g.reason, g.message.clone()),
        None => C::falsy(
            CONDITION_NODE_READY,
            "NoMachinePod",
            "there is no running machine Pod, so no Node",
        ),
    }
}

/// The failure of the Pod's `fetch-image` init container, from its termination message
/// (`<Reason>: <message>`): as it ended now, or last time while the kubelet backs off.
fn node_image_failure(pod: &Pod) -> Option<(&'static str, String)> {
    use super::node_image::FETCH_IMAGE_CONTAINER;
    let status = pod
        .status
        .as_ref()?
        .init_container_statuses
        .as_deref()?
        .iter()
        .find(|c| c.name == FETCH_IMAGE_CONTAINER)?;
    if status.state.as_ref().is_some_and(|s| s.running.is_some()) {
        return None;
    }
    let terminated = status
        .state
        .as_ref()
        .and_then(|s| s.terminated.as_ref())
        .or_else(|| status.last_state.as_ref()?.terminated.as_ref())
        .filter(|t| t.exit_code != 0)?;
    let text = terminated.message.as_deref().unwrap_or_default().trim();
    // The fetcher writes one line; with a crash the kubelet falls back to the log's end.
    let line = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default();
    let (reason, message) = match line.split_once(": ") {
        Some((REASON_IMAGE_VERIFICATION_FAILED, m)) => (REASON_IMAGE_VERIFICATION_FAILED, m),
        Some((REASON_IMAGE_DOWNLOAD_FAILED, m)) => (REASON_IMAGE_DOWNLOAD_FAILED, m),
        _ => (REASON_IMAGE_DOWNLOAD_FAILED, line),
    };
    let message = if message.is_empty() {
        format!(
            "the {FETCH_IMAGE_CONTAINER} init container exited with code {}",
            terminated.exit_code
        )
    } else {
        message.to_owned()
    };
    Some((reason, message))
}

/// Reads the machine Pod's state: running with an IP, starting (with why), or stuck on its
/// node image.
pub fn pod_state(pod: &Pod) -> MachineState {
    let name = pod.name_any();
    if let Some((reason, message)) = node_image_failure(pod) {
        return MachineState::NodeImageFailed {
            pod: name,
            reason,
            message,
        };
    }
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

/// The status the KVMMachine should have.
pub fn status(
    km: &KVMMachine,
    state: &MachineState,
    pod: &[crate::k8s::conditions::DesiredCondition],
    failure_domain: Option<&str>,
    now: k8s_openapi::jiff::Timestamp,
) -> capk_api::v1alpha1::KVMMachineStatus {
    let current = km.status.clone().unwrap_or_default();
    let generation = km.meta().generation;
    let mut desired = vec![paused_condition(state)];
    desired.extend(ready_condition(state, current.contract.is_provisioned()));
    if !matches!(state, MachineState::Paused) {
        desired.extend_from_slice(pod);
    }
    let mut out = current.clone();
    record_pod(&mut out, state, km);
    if observes_spec(state) {
        out.failure_domain = failure_domain.map(str::to_owned);
        out.contract.observed_generation = generation;
    }
    out.contract.conditions = Some(crate::k8s::conditions::merge(
        current.contract.conditions.as_deref().unwrap_or_default(),
        &desired,
        generation,
        now,
    ));
    out
}

/// Whether the state comes from a reconcile that looked at the spec, so `observedGeneration` and
/// the failure domain follow it; paused, hosting-unavailable and deleting reconciles leave them.
fn observes_spec(state: &MachineState) -> bool {
    !matches!(
        state,
        MachineState::Paused | MachineState::HostingUnavailable(_) | MachineState::Deleting { .. }
    )
}

/// `Paused`: true while the Cluster or the KVMMachine is paused.
fn paused_condition(state: &MachineState) -> crate::k8s::conditions::DesiredCondition {
    use crate::k8s::conditions::DesiredCondition as C;
    use capk_api::constants::CONDITION_PAUSED;
    match state {
        MachineState::Paused => C::truthy(
            CONDITION_PAUSED,
            "Paused",
            "the Cluster or this object is paused; nothing is changed until it is unpaused",
        ),
        _ => C::falsy(CONDITION_PAUSED, "NotPaused", ""),
    }
}

/// `Ready` for the state, or none where the last one stands: while paused, and while the hosting
/// cluster is unavailable to a machine that is already provisioned.
fn ready_condition(
    state: &MachineState,
    provisioned: bool,
) -> Option<crate::k8s::conditions::DesiredCondition> {
    use crate::k8s::conditions::DesiredCondition as C;
    use capk_api::constants::CONDITION_READY;
    let not_ready =
        |reason: &'static str, message: String| Some(C::falsy(CONDITION_READY, reason, message));
    match state {
        MachineState::Paused => None,
        MachineState::HostingUnavailable(_) if provisioned => None,
        MachineState::HostingUnavailable(hosting) => Some(C::falsy(
            CONDITION_READY,
            hosting.reason.clone(),
            hosting.message.clone(),
        )),
        MachineState::Running { pod, .. } => Some(C::truthy(
            CONDITION_READY,
            "VMRunning",
            format!("the VM runs in machine Pod {pod}"),
        )),
        MachineState::WaitingForMachineOwner => not_ready(
            "WaitingForMachineOwner",
            "waiting for Cluster API to set a Machine as owner of this KVMMachine".into(),
        ),
        MachineState::WaitingForClusterInfrastructure => not_ready(
            "WaitingForClusterInfrastructure",
            "waiting for the Cluster's infrastructure (KVMCluster) to be provisioned".into(),
        ),
        MachineState::WaitingForBootstrapData => not_ready(
            "WaitingForBootstrapData",
            "waiting for the bootstrap provider to set the Machine's spec.bootstrap.dataSecretName"
                .into(),
        ),
        MachineState::WaitingForBootstrapSecret(name) => not_ready(
            "WaitingForBootstrapData",
            format!("waiting for the Machine's bootstrap data Secret {name} to exist"),
        ),
        MachineState::BootstrapDataInvalid(msg) => not_ready(
            REASON_BOOTSTRAP_DATA_INVALID,
            format!("cannot convert the bootstrap data to Ignition: {msg}"),
        ),
        MachineState::SpecInvalid(msg) => not_ready(
            REASON_SPEC_INVALID,
            format!("the spec cannot be run: {msg}"),
        ),
        MachineState::PodStarting { pod, detail } => {
            not_ready("VMStarting", format!("machine Pod {pod}: {detail}"))
        }
        MachineState::NodeImageFailed {
            pod,
            reason,
            message,
        } => not_ready(
            reason,
            format!(
                "machine Pod {pod} cannot get its node image (retried with back-off): {message}"
            ),
        ),
        MachineState::Deleting { reason, message } => not_ready(reason, message.clone()),
        MachineState::PodRefused(why) => not_ready(REASON_MACHINE_POD_REFUSED, why.clone()),
        MachineState::PodMissing => not_ready(
            REASON_MACHINE_POD_MISSING,
            "the machine Pod is gone or failed, and with it the VM and its disks; the Machine \
             needs replacing (a MachineHealthCheck does this)"
                .into(),
        ),
    }
}

/// Why the apiserver refused to create machine Pod `pod` in `place`, if for good (HTTP 4xx but
/// a conflict or throttling): its words, redacted like any server's, and for Pod Security
/// admission what the operator can do. `None` for what passes by itself.
pub fn pod_refusal(status: &kube::core::Status, pod: &str, place: &str) -> Option<String> {
    if !crate::runtime::error::refused_for_good(status) {
        return None;
    }
    let said = crate::remote::redact::untrusted_message(&status.message);
    let hint = if status.message.contains("PodSecurity") {
        "; machine Pods run QEMU privileged: label the namespace \
         pod-security.kubernetes.io/enforce=privileged, or give the controller a machine \
         namespace (CAPK_MACHINE_NAMESPACE, docs/security.md)"
    } else {
        ""
    };
    Some(format!(
        "the apiserver refused machine Pod {pod} in {place} (HTTP {}): {said}{hint}; tried \
         again every minute",
        status.code
    ))
}

/// Records the machine Pod in the status; a running one also gives the machine its addresses
/// (the Pod's IP and the hostname) and makes it provisioned and ready.
fn record_pod(
    out: &mut capk_api::v1alpha1::KVMMachineStatus,
    state: &MachineState,
    km: &KVMMachine,
) {
    use capk_api::v1alpha1::{MachineAddress, MachineAddressType};
    match state {
        MachineState::PodStarting { pod, .. } | MachineState::NodeImageFailed { pod, .. } => {
            out.pod_name = Some(pod.clone());
        }
        MachineState::Running { pod, ip } => {
            out.pod_name = Some(pod.clone());
            out.addresses = Some(vec![
                MachineAddress {
                    type_: MachineAddressType::InternalIP,
                    address: ip.clone(),
                },
                MachineAddress {
                    type_: MachineAddressType::Hostname,
                    address: hostname(km),
                },
            ]);
            out.contract.set_provisioned();
        }
        _ => {}
    }
}

/// Whether the KVMMachine's `Ready` condition already reports `reason` with `detail` in its
/// message (so the Warning Event for it was published).
pub fn has_ready_reason(km: &KVMMachine, reason: &str, detail: &str) -> bool {
    km.status
        .as_ref()
        .and_then(|s| s.contract.conditions.as_deref())
        .and_then(|cs| crate::k8s::conditions::find(cs, "Ready"))
        .is_some_and(|c| c.reason == reason && c.message.contains(detail))
}

/// Whether the KVMMachine already shows condition `c` (same status, reason and message).
pub fn has_condition(km: &KVMMachine, c: &crate::k8s::conditions::DesiredCondition) -> bool {
    let status = if c.status { "True" } else { "False" };
    km.status
        .as_ref()
        .and_then(|s| s.contract.conditions.as_deref())
        .and_then(|cs| crate::k8s::conditions::find(cs, c.type_))
        .is_some_and(|cur| {
            cur.status == status && cur.reason == c.reason && cur.message == c.message
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvmmachine::testing::kvm_machine;
    use serde_json::json;

    #[test]
    fn a_refused_machine_pod_says_what_the_apiserver_said_and_what_to_do() {
        let status = |code: u16, message: &str| -> kube::core::Status {
            serde_json::from_value(json!({"status": "Failure", "code": code, "message": message}))
                .unwrap()
        };
        let psa = "pods \"m\" is forbidden: violates PodSecurity \"baseline:latest\": privileged \
                   (container \"launcher\" must not set securityContext.privileged=true)";
        let why = pod_refusal(&status(403, psa), "m", "namespace team-a").unwrap();
        assert!(
            why.contains("machine Pod m in namespace team-a (HTTP 403)"),
            "{why}"
        );
        assert!(why.contains("violates PodSecurity"), "{why}");
        assert!(
            why.contains("pod-security.kubernetes.io/enforce=privileged"),
            "{why}"
        );
        let quota = "pods \"m\" is forbidden: exceeded quota: q, requested: cpu=3";
        let why = pod_refusal(&status(403, quota), "m", "namespace team-a").unwrap();
        assert!(why.contains("exceeded quota"), "{why}");
        assert!(
            !why.contains("pod-security"),
            "no Pod Security hint for a quota: {why}"
        );
        for passing in [409, 429, 500, 503] {
            assert_eq!(
                pod_refusal(&status(passing, psa), "m", "x"),
                None,
                "{passing}"
            );
        }
    }

    #[test]
    fn a_lost_pod_turns_ready_false_but_keeps_provisioned() {
        let t0: k8s_openapi::jiff::Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let mut km = kvm_machine(
            "m",
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "2Gi"}}),
        );
        let running = MachineState::Running {
            pod: "m".into(),
            ip: "10.0.0.5".into(),
        };
        km.status = Some(status(&km, &running, &[], Some("zone-a"), t0));
        let lost = status(
            &km,
            &MachineState::PodMissing,
            &pod_conditions(None),
            Some("zone-a"),
            t0,
        );
        let ready = lost
            .contract
            .conditions
            .as_ref()
            .unwrap()
            .iter()
            .find(|c| c.type_ == "Ready")
            .unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "MachinePodMissing")
        );
        // The contract: provisioned never goes back to false.
        assert_eq!(
            lost.contract.initialization.unwrap().provisioned,
            Some(true)
        );
        assert_eq!(lost.failure_domain.as_deref(), Some("zone-a"));
    }

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "m"},
            "spec": {"nodeName": "mc-node-1", "containers": [{"name": "launcher"}]},
            "status": status,
        }))
        .unwrap()
    }

    fn summary(cs: &[crate::k8s::conditions::DesiredCondition]) -> Vec<(&str, bool, String)> {
        cs.iter()
            .map(|c| (c.type_, c.status, c.reason.to_string()))
            .collect()
    }

    #[test]
    fn pod_conditions_tell_the_story_of_the_machine_pod() {
        let none = pod_conditions(None);
        assert!(none.iter().all(|c| !c.status && c.reason == "NoMachinePod"));

        let unschedulable = pod(json!({"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient memory."}]}));
        let cs = pod_conditions(Some(&unschedulable));
        assert_eq!(
            summary(&cs)[0],
            ("PodScheduled", false, "Unschedulable".into())
        );
        assert!(cs[0].message.contains("Insufficient memory"));

        let crashing = pod(json!({"phase": "Running",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": "launcher", "ready": false, "restartCount": 3,
                "image": "i", "imageID": "", "state": {"waiting": {"reason": "CrashLoopBackOff",
                "message": "back-off 40s restarting failed container"}},
                "lastState": {"terminated": {"exitCode": 1,
                "message": "qemu exited: guest panicked"}}}]}));
        let cs = pod_conditions(Some(&crashing));
        assert_eq!(
            summary(&cs),
            vec![
                ("PodScheduled", true, "Scheduled".into()),
                ("VMRunning", false, "CrashLoopBackOff".into()),
                ("BootstrapCompleted", false, "WaitingForBootstrap".into()),
            ]
        );
        assert!(
            cs[1].message.contains("guest panicked"),
            "{}",
            cs[1].message
        );
        assert!(cs[1].message.contains("restarts: 3"), "{}", cs[1].message);

        let ready = pod(json!({"phase": "Running",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": "launcher", "ready": true, "restartCount": 0,
                "image": "i", "imageID": "", "state": {"running": {}}}]}));
        assert_eq!(
            summary(&pod_conditions(Some(&ready))),
            vec![
                ("PodScheduled", true, "Scheduled".into()),
                ("VMRunning", true, "LauncherRunning".into()),
                ("BootstrapCompleted", true, "BootstrapSucceeded".into()),
            ]
        );

        // The startup probe passed (started) before the readiness probe's next period: the
        // bootstrap is complete; until then the launcher runs but is not started.
        let started = |started: bool| {
            let p = pod(json!({"phase": "Running",
                "conditions": [{"type": "PodScheduled", "status": "True"}],
                "containerStatuses": [{"name": "launcher", "ready": false, "started": started,
                    "restartCount": 0, "image": "i", "imageID": "", "state": {"running": {}}}]}));
            let c = &pod_conditions(Some(&p))[2];
            (c.type_, c.status, c.reason.to_string())
        };
        assert_eq!(
            started(true),
            ("BootstrapCompleted", true, "BootstrapSucceeded".into())
        );
        assert_eq!(
            started(false),
            ("BootstrapCompleted", false, "WaitingForBootstrap".into())
        );

        // The node image init container failed: its termination message is the Ready reason,
        // also while the kubelet backs off before the next try.
        let fetching = |state: serde_json::Value, last: serde_json::Value| {
            let p = pod(json!({"phase": "Pending",
                "initContainerStatuses": [{"name": "fetch-image", "ready": false,
                    "restartCount": 2, "image": "i", "imageID": "", "state": state,
                    "lastState": last}]}));
            match pod_state(&p) {
                MachineState::NodeImageFailed {
                    reason, message, ..
                } => Some((reason, message)),
                _ => None,
            }
        };
        let mismatch = json!({"terminated": {"exitCode": 1,
            "message": "ImageVerificationFailed: https://x/n.img: sha256 is 11, expected 22; the download was deleted\n"}});
        assert_eq!(
            fetching(mismatch.clone(), json!({})),
            Some((
                REASON_IMAGE_VERIFICATION_FAILED,
                "https://x/n.img: sha256 is 11, expected 22; the download was deleted".into()
            ))
        );
        let backoff = json!({"waiting": {"reason": "CrashLoopBackOff"}});
        assert_eq!(
            fetching(backoff, mismatch).map(|f| f.0),
            Some(REASON_IMAGE_VERIFICATION_FAILED)
        );
        let crashed = json!({"terminated": {"exitCode": 137}});
        assert_eq!(
            fetching(crashed, json!({})),
            Some((
                REASON_IMAGE_DOWNLOAD_FAILED,
                "the fetch-image init container exited with code 137".into()
            ))
        );
        let retrying = json!({"running": {}});
        assert_eq!(
            fetching(retrying, json!({"terminated": {"exitCode": 1}})),
            None
        );

        // A reason that is not a condition reason is replaced, not copied.
        let odd = pod(json!({"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "no good"}]}));
        assert_eq!(pod_conditions(Some(&odd))[0].reason, "Unschedulable");
    }
}
