//! The workload kubeconfig (`<cluster>-kubeconfig`) is data: a kubeconfig that would make the
//! controller run a command or read one of its files is refused before any client is built, and
//! the KVMMachine that needs it says so in its `NodeReady` condition and a Warning Event.

mod support;

use anyhow::Result;
use capk_api::v1alpha1::KVMMachine;
use capk_tests::env::TestEnv;
use k8s_openapi::api::{
    core::v1::{Pod, Secret},
    events::v1::Event,
};
use kube::{
    Api,
    api::{ListParams, Patch, PatchParams, PostParams},
};
use serde_json::json;
use support::{control_plane_machine, create_namespace, eventually, start_controller};

const GATE: &str = "infrastructure.cluster.x-k8s.io/node-ready";

/// Cluster API's kubeconfig shape with the given cluster and user entries.
fn kubeconfig(cluster: &str, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: admin@demo\n\
         clusters:\n- name: demo\n  cluster:\n    server: https://127.0.0.1:1\n{cluster}\
         contexts:\n- name: admin@demo\n  context: {{cluster: demo, user: admin}}\n\
         users:\n- name: admin\n  user:\n{user}"
    )
}

fn condition(km: &KVMMachine, type_: &str) -> Option<(String, String, String)> {
    let c = km
        .status
        .as_ref()?
        .contract
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

#[tokio::test]
async fn a_kubeconfig_that_runs_commands_or_reads_files_is_refused() -> Result<()> {
    let ns = "workload-kubeconfig-refused";
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    let _stop = start_controller(client.clone(), ns);
    control_plane_machine(
        &client,
        ns,
        "demo-cp-0",
        "#cloud-config\nruncmd:\n- echo ok\n",
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    eventually(30, "machine Pod", || async {
        Ok(pods.get_opt("demo-cp-0").await?)
    })
    .await?;

    // What each form would do if honoured: the exec plugin and the auth provider's helper touch
    // `ran`; the file fields name files that exist (the controller's own would do).
    let dir = tempfile::tempdir()?;
    let ran = dir.path().join("ran");
    let file = dir.path().join("credential.pem");
    std::fs::write(&file, "not a certificate")?;
    let (ran_s, file_s) = (ran.display().to_string(), file.display().to_string());
    let ca = "    certificate-authority-data: Y2E=\n";
    let forms = [
        (
            "users[0].user.exec",
            kubeconfig(
                ca,
                &format!(
                    "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      \
                     command: /bin/sh\n      args: [-c, 'touch {ran_s}']\n      \
                     interactiveMode: Never\n"
                ),
            ),
        ),
        (
            "users[0].user.auth-provider",
            kubeconfig(
                ca,
                &format!(
                    "    auth-provider:\n      name: gcp\n      config:\n        \
                     cmd-path: /bin/sh\n        cmd-args: -c 'touch {ran_s}'\n"
                ),
            ),
        ),
        (
            "users[0].user.tokenFile",
            kubeconfig(ca, &format!("    tokenFile: {file_s}\n")),
        ),
        (
            "users[0].user.client-certificate",
            kubeconfig(
                ca,
                &format!("    client-certificate: {file_s}\n    client-key-data: a2V5\n"),
            ),
        ),
        (
            "users[0].user.client-key",
            kubeconfig(
                ca,
                &format!("    client-certificate-data: Y2VydA==\n    client-key: {file_s}\n"),
            ),
        ),
        (
            "clusters[0].cluster.certificate-authority",
            kubeconfig(
                &format!("    certificate-authority: {file_s}\n"),
                "    token: abcdef.0123456789abcdef\n",
            ),
        ),
    ];

    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    for (i, (field, value)) in forms.iter().enumerate() {
        if i == 0 {
            let secret: Secret = serde_json::from_value(json!({
                "metadata": {"name": "demo-kubeconfig",
                             "labels": {"cluster.x-k8s.io/cluster-name": "demo"}},
                "type": "cluster.x-k8s.io/secret",
                "stringData": {"value": value},
            }))?;
            secrets.create(&PostParams::default(), &secret).await?;
        } else {
            let patch = json!({"stringData": {"value": value}});
            secrets
                .patch(
                    "demo-kubeconfig",
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await?;
        }
        let quoted = format!("`{field}`");
        let (status, _, message) = eventually(30, &format!("NodeReady refusing {field}"), || {
            let kms = kms.clone();
            let quoted = quoted.clone();
            async move {
                let km = kms.get("demo-cp-0").await?;
                Ok(condition(&km, "NodeReady")
                    .filter(|c| c.1 == "WorkloadKubeconfigRefused" && c.2.contains(&quoted)))
            }
        })
        .await?;
        assert_eq!(status, "False");
        assert!(message.contains("demo-kubeconfig"), "{message}");
        // kube-runtime's recorder folds later Events of the same reason into the first one's
        // series (keeping its note), so the note names the first refused field.
        let quoted = format!("`{}`", forms[0].0);
        eventually(
            30,
            &format!("a Warning Event naming {}", forms[0].0),
            || {
                let events = events.clone();
                let quoted = quoted.clone();
                async move {
                    let list = events.list(&ListParams::default()).await?;
                    Ok(list.items.into_iter().find(|e| {
                        e.reason.as_deref() == Some("WorkloadKubeconfigRefused")
                            && e.type_.as_deref() == Some("Warning")
                            && e.regarding.as_ref().and_then(|r| r.name.as_deref())
                                == Some("demo-cp-0")
                            && e.note.as_deref().is_some_and(|n| n.contains(&quoted))
                    }))
                }
            },
        )
        .await?;
        // The machine Pod's readiness gate says the same.
        let pod = pods.get("demo-cp-0").await?;
        let gate = pod
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == GATE)
            .and_then(|c| c.reason);
        assert_eq!(
            gate.as_deref(),
            Some("WorkloadKubeconfigRefused"),
            "{field}"
        );
    }
    assert!(
        !ran.exists(),
        "a command from the kubeconfig ran as the controller"
    );
    Ok(())
}
