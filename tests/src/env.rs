//! A real etcd + kube-apiserver on loopback, with our CRDs, the Cluster API CRDs and our
//! admission policies (`manifests/admission`) installed.
//!
//! [`TestEnv::shared`] starts one per test binary; a watchdog process stops it (and removes its
//! directory) as soon as the test binary exits, so no server outlives the tests. `capk-testenv`
//! (`make testenv`) starts the same environment detached for manual use.

use std::{
    fs,
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use base64::{Engine, engine::general_purpose::STANDARD as B64};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{
    Api, Client, Config, ResourceExt,
    api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams},
    config::{KubeConfigOptions, Kubeconfig},
    discovery,
};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::{component, output_dir, repo_root};

/// How long to wait for the apiserver and the CRDs.
const READY_TIMEOUT: Duration = Duration::from_secs(90);

/// Where an environment keeps its files and whether it stops with the current process.
#[derive(Debug, Clone)]
pub struct EnvOptions {
    /// Directory for certificates, kubeconfig, etcd data and logs.
    pub dir: PathBuf,
    /// Stop the servers and delete `dir` when this process exits.
    pub stop_with_current_process: bool,
}

/// A running etcd + kube-apiserver.
#[derive(Debug)]
pub struct TestEnv {
    dir: PathBuf,
    kubeconfig: PathBuf,
    server: String,
    pids: Vec<u32>,
}

impl TestEnv {
    /// The environment of this test binary, started on first use. Panics (failing the test) when
    /// the servers cannot start; the message names the command that provides missing binaries.
    pub fn shared() -> &'static TestEnv {
        static ENV: OnceLock<TestEnv> = OnceLock::new();
        ENV.get_or_init(|| {
            let dir = tempfile::Builder::new()
                .prefix("capk-testenv-")
                .tempdir()
                .expect("create a temporary directory for the test environment")
                .keep();
            let opts = EnvOptions {
                dir,
                stop_with_current_process: true,
            };
            // Start on a runtime of its own: callers are #[tokio::test]s, each with a runtime.
            std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("tokio runtime")
                    .block_on(TestEnv::start(opts))
            })
            .join()
            .expect("test environment thread")
            .unwrap_or_else(|e| panic!("starting etcd + kube-apiserver failed: {e:#}"))
        })
    }

    /// Starts etcd and kube-apiserver, writes a kubeconfig and installs the CRDs and the
    /// admission policies.
    pub async fn start(opts: EnvOptions) -> Result<TestEnv> {
        let etcd = component("etcd", "make test-deps")?;
        let apiserver = component("kube-apiserver", "make test-deps")?;
        let dir = opts.dir;
        fs::create_dir_all(&dir)?;
        let certs = Certs::generate(&dir)?;
        let [etcd_client, etcd_peer, secure] = free_ports()?;
        let server = format!("https://127.0.0.1:{secure}");

        let etcd_child = spawn_logged(
            Command::new(&etcd).args([
                "--name=capk",
                &format!("--data-dir={}", dir.join("etcd").display()),
                &format!("--listen-client-urls=http://127.0.0.1:{etcd_client}"),
                &format!("--advertise-client-urls=http://127.0.0.1:{etcd_client}"),
                &format!("--listen-peer-urls=http://127.0.0.1:{etcd_peer}"),
                &format!("--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}"),
                &format!("--initial-cluster=capk=http://127.0.0.1:{etcd_peer}"),
                "--unsafe-no-fsync",
                "--log-level=warn",
            ]),
            &dir.join("etcd.log"),
        )?;
        let mut pids = vec![etcd_child.id()];
        let apiserver_child = spawn_logged(
            Command::new(&apiserver).args([
                &format!("--etcd-servers=http://127.0.0.1:{etcd_client}"),
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                &format!("--secure-port={secure}"),
                &format!("--cert-dir={}", dir.join("apiserver-certs").display()),
                &format!("--tls-cert-file={}", certs.serving_cert.display()),
                &format!("--tls-private-key-file={}", certs.serving_key.display()),
                &format!("--client-ca-file={}", certs.ca_cert.display()),
                &format!("--service-account-key-file={}", certs.sa_pub.display()),
                &format!(
                    "--service-account-signing-key-file={}",
                    certs.sa_key.display()
                ),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--authorization-mode=RBAC",
                // No controller-manager creates default ServiceAccounts here.
                "--disable-admission-plugins=ServiceAccount",
                "--allow-privileged=true",
                "--v=0",
            ]),
            &dir.join("kube-apiserver.log"),
        )?;
        pids.push(apiserver_child.id());
        // The children are tracked by pid from here on (watchdog or `capk-testenv down`).
        drop((etcd_child, apiserver_child));
        if opts.stop_with_current_process {
            spawn_watchdog(std::process::id(), &pids, &dir)?;
        }
        fs::write(dir.join("pids"), format!("{} {}\n", pids[0], pids[1]))?;

        let kubeconfig = dir.join("kubeconfig");
        fs::write(&kubeconfig, certs.kubeconfig(&server)?)?;
        let env = TestEnv {
            dir,
            kubeconfig,
            server,
            pids,
        };
        let ready = async {
            env.wait_ready().await?;
            env.install_crds().await?;
            env.install_admission_policies().await
        };
        if let Err(e) = ready.await {
            stop_pids(&env.pids);
            return Err(e);
        }
        Ok(env)
    }

    /// Path of a kubeconfig with cluster-admin rights.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The apiserver URL.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The directory holding certificates, logs and data.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Process ids of etcd and kube-apiserver.
    pub fn pids(&self) -> &[u32] {
        &self.pids
    }

    /// A client bound to the caller's tokio runtime.
    pub async fn client(&self) -> Result<Client> {
        let kc = Kubeconfig::read_from(&self.kubeconfig)?;
        let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
        Ok(Client::try_from(config)?)
    }

    async fn wait_ready(&self) -> Result<()> {
        let client = self.client().await?;
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut last = String::new();
        while Instant::now() < deadline {
            for pid in &self.pids {
                if !pid_alive(*pid) {
                    bail!(
                        "a server exited during start-up; see the logs in {}:\n{}",
                        self.dir.display(),
                        tail(&self.dir.join("kube-apiserver.log"), 15)
                    );
                }
            }
            let req = http_get("/readyz");
            match client.request_text(req).await {
                Ok(body) if body.trim() == "ok" => return Ok(()),
                Ok(body) => last = body,
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        bail!(
            "kube-apiserver not ready after {READY_TIMEOUT:?} (last answer: {last}); logs in {}",
            self.dir.display()
        )
    }

    /// Applies the shipped ValidatingAdmissionPolicies and bindings, then waits until the
    /// apiserver enforces them: a policy takes effect a moment after it is created, and a test
    /// that edits a template must meet it.
    async fn install_admission_policies(&self) -> Result<()> {
        let client = self.client().await?;
        for file in admission_files()? {
            let text = fs::read_to_string(&file)?;
            for doc in serde_yaml_ng::Deserializer::from_str(&text) {
                let value: serde_json::Value = serde::Deserialize::deserialize(doc)
                    .with_context(|| format!("parse {}", file.display()))?;
                if value.is_null() {
                    continue;
                }
                let obj: DynamicObject = serde_json::from_value(value)?;
                let gvk =
                    GroupVersionKind::try_from(obj.types.as_ref().context("apiVersion/kind")?)?;
                let (ar, caps) = discovery::pinned_kind(&client, &gvk).await?;
                if caps.scope != discovery::Scope::Cluster {
                    bail!(
                        "{} in {} is namespaced; manifests/admission holds cluster-wide policies",
                        gvk.kind,
                        file.display()
                    );
                }
                let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
                api.patch(
                    &obj.name_any(),
                    &PatchParams::apply("capk-testenv").force(),
                    &Patch::Apply(&obj),
                )
                .await
                .with_context(|| {
                    format!(
                        "install {} {} from {}",
                        gvk.kind,
                        obj.name_any(),
                        file.display()
                    )
                })?;
            }
        }
        self.wait_admission_enforced(&client).await
    }

    /// Waits until a changed KVMClusterTemplate spec is refused (dry run, so nothing changes).
    async fn wait_admission_enforced(&self, client: &Client) -> Result<()> {
        let templates: Api<DynamicObject> = Api::namespaced_with(
            client.clone(),
            "default",
            &ApiResource::from_gvk(&GroupVersionKind::gvk(
                "infrastructure.cluster.x-k8s.io",
                "v1alpha1",
                "KVMClusterTemplate",
            )),
        );
        let name = "capk-testenv-admission-probe";
        let probe = |service: &str| {
            serde_json::json!({
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
                "kind": "KVMClusterTemplate",
                "metadata": {"name": name},
                "spec": {"template": {"spec": {"controlPlaneService": {"type": service}}}},
            })
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut last = String::new();
        while Instant::now() < deadline {
            let created = templates
                .patch(
                    name,
                    &PatchParams::apply("capk-testenv").force(),
                    &Patch::Apply(probe("ClusterIP")),
                )
                .await;
            let changed = match created {
                Ok(_) => {
                    templates
                        .patch(
                            name,
                            &PatchParams::apply("capk-testenv").force().dry_run(),
                            &Patch::Apply(probe("NodePort")),
                        )
                        .await
                }
                Err(e) => Err(e),
            };
            match changed {
                Err(kube::Error::Api(s)) if s.message.contains("immutable") => {
                    templates.delete(name, &Default::default()).await?;
                    return Ok(());
                }
                Err(e) => last = e.to_string(),
                Ok(_) => last = "a changed template spec was accepted".into(),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        bail!(
            "the admission policies of manifests/admission are not enforced after {READY_TIMEOUT:?} ({last}); logs in {}",
            self.dir.display()
        )
    }

    async fn install_crds(&self) -> Result<()> {
        let client = self.client().await?;
        let crds: Api<CustomResourceDefinition> = Api::all(client);
        let mut names = Vec::new();
        for file in crd_files()? {
            for crd in read_crds(&file)? {
                let name = crd.name_any();
                crds.patch(
                    &name,
                    &PatchParams::apply("capk-testenv").force(),
                    &Patch::Apply(&crd),
                )
                .await
                .with_context(|| format!("install CRD {name} from {}", file.display()))?;
                names.push(name);
            }
        }
        let deadline = Instant::now() + READY_TIMEOUT;
        for name in names {
            loop {
                let crd = crds.get(&name).await?;
                let established = crd
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| {
                        cs.iter()
                            .any(|c| c.type_ == "Established" && c.status == "True")
                    });
                if established {
                    break;
                }
                if Instant::now() > deadline {
                    bail!("CRD {name} not established after {READY_TIMEOUT:?}");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }
}

/// The YAML files of a kustomize directory, sorted, without its `kustomization.yaml`.
fn manifest_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .with_context(|| format!("read {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .filter(|p| !p.ends_with("kustomization.yaml"))
        .collect();
    files.sort();
    Ok(files)
}

/// The shipped admission policies (`manifests/admission`, the file release manifests include),
/// applied as they are.
pub fn admission_files() -> Result<Vec<PathBuf>> {
    manifest_files(&repo_root().join("manifests/admission"))
}

/// The CRD files installed: ours (`manifests/crd`) and the pinned Cluster API release's.
pub fn crd_files() -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let ours = repo_root().join("manifests/crd");
    let capi = capi_crd_dir();
    if !capi.join(".complete").exists() {
        bail!(
            "the Cluster API CRDs are missing from {}; run `make test-deps` (hack/prepare.d/20-capi-crds.sh)",
            capi.display()
        );
    }
    for dir in [ours, capi] {
        files.extend(manifest_files(&dir)?);
    }
    Ok(files)
}

/// Directory with the pinned Cluster API release's CRDs (see `hack/prepare.d/20-capi-crds.sh`).
pub fn capi_crd_dir() -> PathBuf {
    output_dir()
        .join("capi")
        .join(crate::pinned_version("CAPI_VERSION"))
        .join("crd")
}

/// Reads every CRD document of a YAML file.
pub fn read_crds(file: &Path) -> Result<Vec<CustomResourceDefinition>> {
    let text = fs::read_to_string(file).with_context(|| format!("read {}", file.display()))?;
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let value: serde_json::Value = serde::Deserialize::deserialize(doc)
            .with_context(|| format!("parse {}", file.display()))?;
        if value.is_null() {
            continue;
        }
        out.push(
            serde_json::from_value(value).with_context(|| format!("CRD in {}", file.display()))?,
        );
    }
    Ok(out)
}

fn http_get(path: &str) -> http::Request<Vec<u8>> {
    http::Request::get(path)
        .body(Vec::new())
        .expect("static request")
}

fn free_ports<const N: usize>() -> Result<[u16; N]> {
    // Hold all listeners until every port is chosen so the ports differ.
    let listeners = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()?;
    let mut ports = [0; N];
    for (p, l) in ports.iter_mut().zip(&listeners) {
        *p = l.local_addr()?.port();
    }
    Ok(ports)
}

fn spawn_logged(cmd: &mut Command, log: &Path) -> Result<Child> {
    let out = fs::File::create(log)?;
    let err = out.try_clone()?;
    // A process group of their own: Ctrl-C on `make testenv` or a test does not reach them.
    use std::os::unix::process::CommandExt;
    cmd.stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .with_context(|| format!("start {:?}", cmd.get_program()))
}

/// A tiny shell process that waits for `owner` to exit, then stops `pids` and removes `dir`.
fn spawn_watchdog(owner: u32, pids: &[u32], dir: &Path) -> Result<()> {
    let pids = pids
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(" ");
    let script = format!(
        "while kill -0 {owner} 2>/dev/null; do sleep 0.3; done; \
         kill -TERM {pids} 2>/dev/null; \
         for i in $(seq 50); do kill -0 {pids} 2>/dev/null || break; sleep 0.1; done; \
         kill -KILL {pids} 2>/dev/null; rm -rf '{dir}'",
        dir = dir.display()
    );
    use std::os::unix::process::CommandExt;
    Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .context("start the test environment's watchdog")?;
    Ok(())
}

/// True while `pid` runs (a zombie counts as exited).
pub fn pid_alive(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
    }
}

/// Stops processes: SIGTERM, up to 5 s of grace, then SIGKILL.
pub fn stop_pids(pids: &[u32]) {
    for signal in ["-TERM", "-KILL"] {
        let live: Vec<String> = pids
            .iter()
            .filter(|p| pid_alive(**p))
            .map(u32::to_string)
            .collect();
        if live.is_empty() {
            return;
        }
        let _ = Command::new("kill").arg(signal).args(&live).status();
        for _ in 0..50 {
            if pids.iter().all(|p| !pid_alive(*p)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

struct Certs {
    ca_cert: PathBuf,
    serving_cert: PathBuf,
    serving_key: PathBuf,
    sa_key: PathBuf,
    sa_pub: PathBuf,
    ca_pem: String,
    admin_cert_pem: String,
    admin_key_pem: String,
}

impl Certs {
    fn generate(dir: &Path) -> Result<Certs> {
        let pki = dir.join("pki");
        fs::create_dir_all(&pki)?;

        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "capk-testenv-ca");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let ca = Issuer::new(ca_params, ca_key);

        let serving_key = KeyPair::generate()?;
        let mut serving = CertificateParams::new(vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
            "kubernetes.default.svc".to_owned(),
        ])?;
        serving
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_cert = serving.signed_by(&serving_key, &ca)?;

        let admin_key = KeyPair::generate()?;
        let mut admin = CertificateParams::new(Vec::<String>::new())?;
        admin
            .distinguished_name
            .push(DnType::CommonName, "capk-admin");
        admin
            .distinguished_name
            .push(DnType::OrganizationName, "system:masters");
        admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let admin_cert = admin.signed_by(&admin_key, &ca)?;

        let sa_key = KeyPair::generate()?;

        let write = |name: &str, body: String| -> Result<PathBuf> {
            let p = pki.join(name);
            fs::write(&p, body)?;
            Ok(p)
        };
        Ok(Certs {
            ca_cert: write("ca.crt", ca_cert.pem())?,
            serving_cert: write("apiserver.crt", serving_cert.pem())?,
            serving_key: write("apiserver.key", serving_key.serialize_pem())?,
            sa_key: write("sa.key", sa_key.serialize_pem())?,
            sa_pub: write("sa.pub", sa_key.public_key_pem())?,
            ca_pem: ca_cert.pem(),
            admin_cert_pem: admin_cert.pem(),
            admin_key_pem: admin_key.serialize_pem(),
        })
    }

    fn kubeconfig(&self, server: &str) -> Result<String> {
        let doc = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "capk-testenv", "cluster": {
                "server": server,
                "certificate-authority-data": B64.encode(&self.ca_pem),
            }}],
            "users": [{"name": "capk-admin", "user": {
                "client-certificate-data": B64.encode(&self.admin_cert_pem),
                "client-key-data": B64.encode(&self.admin_key_pem),
            }}],
            "contexts": [{"name": "capk-testenv", "context": {
                "cluster": "capk-testenv", "user": "capk-admin", "namespace": "default",
            }}],
            "current-context": "capk-testenv",
        });
        Ok(serde_yaml_ng::to_string(&doc)?)
    }
}

/// Reads the pids file of an environment directory (for `capk-testenv down`).
pub fn read_pids(dir: &Path) -> Result<Vec<u32>> {
    let text = fs::read_to_string(dir.join("pids"))?;
    Ok(text
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect())
}
