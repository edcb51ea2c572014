//! The flavors as a node boots them: the objects clusterctl renders, the bootstrap data CABPK
//! makes from them (`cabpk-render`: CABPK's own code, see hack/cabpk-render/main.go), the
//! controller's conversion to Ignition v3 and the launcher's per-boot overlay, checked by
//! upstream `ignition-validate`.

use std::{collections::BTreeMap, process::Command};

use anyhow::{Context, Result, anyhow, bail};
use capk_bootstrap::BootstrapFormat;
use serde_json::Value;

use super::release::*;

pub const CLUSTER: &str = "demo";
pub const FLAVOR_NS: &str = "flavors";
/// A node image reference for the node-image flavor (any concrete tag will do: nothing pulls it).
pub const NODE_IMAGE: &str = "localhost/capk/node:v1.35.4";
/// Where the upstream Flatcar CAPI templates download the Kubernetes sysext from.
pub const UPSTREAM_SYSEXT: &str = "https://extensions.flatcar.org/extensions";
/// An air-gapped mirror of it.
pub const MIRROR_SYSEXT: &str = "https://sysext-mirror.example.internal/flatcar";

pub fn kubernetes_version() -> String {
    capk_tests::pinned_version("KUBERNETES_VERSION")
}

/// `clusterctl generate cluster demo --from <flavor>` with the pinned Kubernetes version, one
/// control-plane machine and one worker.
pub fn generate_flavor(flavor: &str, env: &[(&str, &str)]) -> Result<String> {
    let path = release_dir()?.join(flavor);
    clusterctl(
        &[
            "generate",
            "cluster",
            CLUSTER,
            "--from",
            &path.to_string_lossy(),
            "--kubernetes-version",
            &kubernetes_version(),
            "--target-namespace",
            FLAVOR_NS,
            "--control-plane-machine-count",
            "1",
            "--worker-machine-count",
            "1",
        ],
        env,
    )
}

/// The machine a bootstrap Secret is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The first control-plane machine (`kubeadm init`).
    Init,
    /// Another control-plane machine (`kubeadm join --control-plane`).
    Join,
    /// A MachineDeployment's machine (`kubeadm join`).
    Worker,
}

pub const ROLES: [Role; 3] = [Role::Init, Role::Join, Role::Worker];

impl Role {
    pub fn arg(self) -> &'static str {
        match self {
            Role::Init => "init",
            Role::Join => "join",
            Role::Worker => "worker",
        }
    }

    /// The KVMMachine's name, which the launcher gives the VM as its hostname.
    pub fn hostname(self) -> &'static str {
        match self {
            Role::Init => "demo-control-plane-x7k2p",
            Role::Join => "demo-control-plane-q9w4m",
            Role::Worker => "demo-md-0-zt5vb-r8d2c",
        }
    }
}

/// Runs `bin args` with `input` on stdin; fails with its stderr.
pub fn run_with_input(bin: &std::path::Path, args: &[&str], input: &[u8]) -> Result<Vec<u8>> {
    use std::io::Write;
    let mut child = Command::new(bin)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("run {}", bin.display()))?;
    child.stdin.take().context("stdin")?.write_all(input)?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "{} {}: {}{}",
            bin.display(),
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out.stdout)
}

/// The bootstrap Secret (`format`, `value`) CABPK would write for `role` from the rendered
/// objects, made by CABPK's own code (`cabpk-render`; the KVMCluster's endpoint is the
/// control-plane Service's name).
pub fn cabpk_bootstrap(objects: &str, role: Role) -> Result<(BootstrapFormat, String)> {
    cabpk_bootstrap_at(
        objects,
        role,
        &format!("{CLUSTER}-apiserver.{FLAVOR_NS}.svc:6443"),
    )
}

/// [`cabpk_bootstrap`] with the Cluster's control-plane endpoint `endpoint` (HOST:PORT).
pub fn cabpk_bootstrap_at(
    objects: &str,
    role: Role,
    endpoint: &str,
) -> Result<(BootstrapFormat, String)> {
    let bin = capk_tests::component("cabpk-render", "make test-deps")?;
    let out = run_with_input(
        &bin,
        &["bootstrap", "--role", role.arg(), "--endpoint", endpoint],
        objects.as_bytes(),
    )?;
    let secret: Value = serde_json::from_slice(&out)?;
    let format = BootstrapFormat::from_secret(secret["format"].as_str())?;
    Ok((
        format,
        secret["value"].as_str().context("value")?.to_owned(),
    ))
}

/// Upstream `ignition-validate` on `json`: errors and warnings both fail.
pub fn ignition_validate(json: &[u8]) -> Result<()> {
    let bin = capk_tests::component("ignition-validate", "make test-deps")?;
    let out = Command::new(&bin)
        .arg("-")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().expect("stdin").write_all(json)?;
            child.wait_with_output()
        })
        .context("run ignition-validate")?;
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() || !report.trim().is_empty() {
        bail!("ignition-validate: {report}");
    }
    Ok(())
}

/// The Ignition the guest boots: the controller's conversion of the bootstrap data (the
/// KVMMachine's Ignition Secret), then the launcher's per-boot overlay (hostname, data disks,
/// heartbeat), validated by upstream `ignition-validate`.
pub fn boot_ignition(format: BootstrapFormat, data: &str, role: Role) -> Result<Value> {
    use capk_launcher::{
        disk,
        ignition::{BootInputs, overlay, prepare},
        qemu::argv::{DiskAttachment, DiskFormat},
    };
    let hostname = role.hostname();
    let facts = capk_bootstrap::MachineFacts {
        hostname: hostname.into(),
        instance_id: format!("kvm://{FLAVOR_NS}/{hostname}"),
    };
    let stored = capk_bootstrap::render_ignition(format, data.as_bytes(), &facts, None)
        .context("the controller's conversion")?;
    let dir = tempfile::tempdir()?;
    let src = dir.path().join("ignition-secret.json");
    std::fs::write(&src, &stored.json)?;
    let attach = |serial: &str| DiskAttachment {
        serial: serial.into(),
        path: "/dev/null".into(),
        format: DiskFormat::Raw,
        base: None,
    };
    let mut disks = vec![
        attach(disk::ROOT_SERIAL),
        attach(disk::DOCKER_SERIAL),
        attach(disk::KUBELET_SERIAL),
    ];
    if role != Role::Worker {
        disks.push(attach(disk::ETCD_SERIAL));
    }
    let boot = overlay(&BootInputs {
        hostname: hostname.into(),
        disks,
        ..Default::default()
    });
    let dest = dir.path().join("fw_cfg.json");
    prepare(&src, &dest, &boot).context("the launcher's overlay")?;
    let json = std::fs::read(&dest)?;
    ignition_validate(&json)?;
    Ok(serde_json::from_slice(&json)?)
}

pub fn entry<'a>(config: &'a Value, list: &str, key: &str, name: &str) -> Option<&'a Value> {
    let (section, field) = list.split_once('.').expect("section.field");
    config[section][field]
        .as_array()?
        .iter()
        .find(|e| e[key] == name)
}

pub fn file<'a>(config: &'a Value, path: &str) -> Option<&'a Value> {
    entry(config, "storage.files", "path", path)
}

pub fn unit<'a>(config: &'a Value, name: &str) -> Option<&'a Value> {
    entry(config, "systemd.units", "name", name)
}

/// The text of an inline (`data:` URL) file.
pub fn inline_text(file: &Value) -> Result<String> {
    let source = file["contents"]["source"].as_str().context("no source")?;
    if !file["contents"]["compression"].is_null() {
        bail!("{} is compressed", file["path"]);
    }
    let url = data_url::DataUrl::process(source).map_err(|e| anyhow!("{source}: {e:?}"))?;
    let (bytes, _) = url
        .decode_to_vec()
        .map_err(|e| anyhow!("{source}: {e:?}"))?;
    Ok(String::from_utf8(bytes)?)
}

/// The values of `key=` in a unit and its drop-ins, each space-separated word once.
pub fn unit_values(unit: &Value, key: &str) -> Vec<String> {
    let mut texts = vec![unit["contents"].as_str().unwrap_or_default().to_owned()];
    for d in unit["dropins"].as_array().into_iter().flatten() {
        texts.push(d["contents"].as_str().unwrap_or_default().to_owned());
    }
    let prefix = format!("{key}=");
    texts
        .iter()
        .flat_map(|t| t.lines())
        .filter_map(|l| l.trim().strip_prefix(&prefix))
        .flat_map(|v| v.split_whitespace().map(str::to_owned))
        .collect()
}

/// Every file's remote (http, https) source.
pub fn remote_sources(config: &Value) -> Vec<String> {
    config["storage"]["files"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f["contents"]["source"].as_str())
        .filter(|s| s.starts_with("http://") || s.starts_with("https://"))
        .map(str::to_owned)
        .collect()
}

/// What a stock Flatcar node needs to run kubeadm: the Kubernetes sysext of `version`
/// downloaded from `base` by Ignition, linked into /etc/extensions (merged by
/// systemd-sysext.service at boot), and kubeadm.service ordered after the merge, Flatcar's
/// unit reload and containerd. Nothing else is downloaded; Flatcar's own updates stay off.
pub fn assert_kubernetes_sysext(config: &Value, base: &str, version: &str, what: &str) {
    let raw = format!("/opt/extensions/kubernetes/kubernetes-{version}-x86-64.raw");
    let sysext = file(config, &raw).unwrap_or_else(|| panic!("{what}: Ignition writes no {raw}"));
    let url = format!("{base}/kubernetes-{version}-x86-64.raw");
    assert_eq!(sysext["contents"]["source"], url, "{what}: {sysext}");
    assert_eq!(remote_sources(config), [url], "{what}: other downloads");
    let link = entry(
        config,
        "storage.links",
        "path",
        "/etc/extensions/kubernetes.raw",
    )
    .unwrap_or_else(|| panic!("{what}: no /etc/extensions/kubernetes.raw"));
    assert_eq!(link["target"], raw, "{what}: {link}");
    assert_ne!(link["hard"], true, "{what}: {link}");

    let kubeadm =
        unit(config, "kubeadm.service").unwrap_or_else(|| panic!("{what}: no kubeadm.service"));
    assert_eq!(kubeadm["enabled"], true, "{what}: {kubeadm}");
    let after = unit_values(kubeadm, "After");
    for dep in [
        "systemd-sysext.service",
        "ensure-sysext.service",
        "containerd.service",
    ] {
        assert!(
            after.iter().any(|a| a == dep),
            "{what}: kubeadm.service is not After={dep}: {after:?}"
        );
    }
    let requires = unit_values(kubeadm, "Requires");
    assert!(
        requires.iter().any(|r| r == "systemd-sysext.service"),
        "{what}: kubeadm.service does not require the sysext merge: {requires:?}"
    );
    for masked in ["update-engine.service", "locksmithd.service"] {
        let u = unit(config, masked).unwrap_or_else(|| panic!("{what}: no {masked}"));
        assert_eq!(u["mask"], true, "{what}: {u}");
    }
}

/// The kubeadm configuration documents CABPK's Ignition writes (`/etc/kubeadm.yml`), by kind.
pub fn kubeadm_documents(config: &Value) -> Result<BTreeMap<String, Value>> {
    let text = inline_text(file(config, "/etc/kubeadm.yml").context("no /etc/kubeadm.yml")?)?;
    Ok(docs(&text)?
        .into_iter()
        .map(|d| (d["kind"].as_str().unwrap_or_default().to_owned(), d))
        .collect())
}

/// The kubeadm configuration documents of a cloud-config node as capk-bootstrap converts them:
/// CABPK's `/run/kubeadm/kubeadm.yaml` (init) or `kubeadm-join-config.yaml` (join), by kind.
pub fn cloud_config_kubeadm_documents(config: &Value) -> Result<BTreeMap<String, Value>> {
    let kubeadm_yaml = config["storage"]["files"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|f| {
            f["path"]
                .as_str()
                .is_some_and(|p| p.contains("/run/kubeadm/kubeadm"))
        })
        .context("no /run/kubeadm/kubeadm*.yaml")?;
    Ok(docs(&inline_text(kubeadm_yaml)?)?
        .into_iter()
        .map(|d| (d["kind"].as_str().unwrap_or_default().to_owned(), d))
        .collect())
}

/// The kubeadm documents the node of `role` gets from `objects`, whichever format CABPK wrote.
pub fn node_kubeadm_documents(objects: &str, role: Role) -> Result<BTreeMap<String, Value>> {
    let (format, data) = cabpk_bootstrap(objects, role)?;
    let config = boot_ignition(format, &data, role)?;
    match format {
        BootstrapFormat::CloudConfig => cloud_config_kubeadm_documents(&config),
        BootstrapFormat::Ignition => kubeadm_documents(&config),
    }
}

/// The leader-election flags kubeadm gives the controller-manager and the scheduler, in order
/// (lease duration, renew deadline, retry period).
pub fn assert_leader_election(kubeadm: &BTreeMap<String, Value>, want: [&str; 3], what: &str) {
    let cluster = &kubeadm["ClusterConfiguration"];
    for component in ["controllerManager", "scheduler"] {
        let args = &cluster[component]["extraArgs"];
        let got: BTreeMap<&str, &str> = args
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| Some((a["name"].as_str()?, a["value"].as_str()?)))
            .collect();
        for (flag, value) in [
            "leader-elect-lease-duration",
            "leader-elect-renew-deadline",
            "leader-elect-retry-period",
        ]
        .into_iter()
        .zip(want)
        {
            assert_eq!(
                got.get(flag).copied(),
                Some(value),
                "{what}: {component} --{flag}: {args}"
            );
        }
    }
}

/// kubeadm's timeouts as the flavors set them, in kubeadm's own notation.
pub fn assert_timeouts(kubeadm: &BTreeMap<String, Value>, role: Role, want: &[(&str, &str)]) {
    let kind = match role {
        Role::Init => "InitConfiguration",
        Role::Join | Role::Worker => "JoinConfiguration",
    };
    let timeouts = &kubeadm[kind]["timeouts"];
    for (field, value) in want {
        assert_eq!(
            timeouts[field], *value,
            "{role:?}: {kind}.timeouts.{field}: {timeouts}"
        );
    }
}

/// The timeouts a joining worker uses (the control-plane ones do not apply to it).
pub const WORKER_TIMEOUTS: [&str; 4] = [
    "kubeletHealthCheck",
    "kubernetesAPICall",
    "tlsBootstrap",
    "discovery",
];

pub fn default_timeouts(role: Role) -> Vec<(&'static str, &'static str)> {
    let all = [
        ("controlPlaneComponentHealthCheck", "10m0s"),
        ("kubeletHealthCheck", "10m0s"),
        ("kubernetesAPICall", "3m0s"),
        ("etcdAPICall", "6m0s"),
        ("tlsBootstrap", "10m0s"),
        ("discovery", "10m0s"),
    ];
    all.into_iter()
        .filter(|(f, _)| role != Role::Worker || WORKER_TIMEOUTS.contains(f))
        .collect()
}
