//! Pure: the machine's Ignition Secret, rendered from its bootstrap data. The Ignition carries
//! join tokens: it is only ever a Secret, mounted as a file (mode 0400) in the machine Pod,
//! never an argument or an environment variable.

use std::collections::BTreeMap;

use capk_api::v1alpha1::KVMMachine;
use k8s_openapi::{
    ByteString, api::core::v1::Secret, apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{Resource, ResourceExt};

use super::{
    names::{self, MachineNames, hostname},
    placement::MachinePlacement,
};
use crate::k8s::ownership::{Home, Owner};

/// Key of the Ignition config in the machine's Ignition Secret.
pub const IGNITION_KEY: &str = "config.ign";

/// What an Ignition Secret is rendered from: the bootstrap data Secret's name and
/// resourceVersion, and this controller's version (a new converter renders again).
pub fn rendered_from(bootstrap_secret: &str, resource_version: &str) -> String {
    format!(
        "{bootstrap_secret}@{resource_version}/capk-controller-{}",
        env!("CARGO_PKG_VERSION")
    )
}

/// The Secret holding the machine's Ignition config, annotated with what it was rendered from
/// ([`rendered_from`]), made in `home` under `names` (next to the machine Pod that mounts it).
pub fn desired(
    km: &KVMMachine,
    placement: &MachinePlacement,
    home: &Home,
    names: &MachineNames,
    ignition: Vec<u8>,
    rendered_from: &str,
) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(names.ignition_secret.clone()),
            namespace: Some(home.namespace.clone()),
            labels: Some(names::labels(km, placement)),
            annotations: Some(BTreeMap::from([(
                capk_api::constants::RENDERED_FROM_ANNOTATION.to_owned(),
                rendered_from.to_owned(),
            )])),
            owner_references: Owner::machine(km).owner_references(home),
            ..Default::default()
        },
        type_: Some("infrastructure.cluster.x-k8s.io/ignition".into()),
        data: Some(BTreeMap::from([(
            IGNITION_KEY.to_owned(),
            ByteString(ignition),
        )])),
        ..Default::default()
    }
}

/// The machine's Ignition config (compact JSON) from its bootstrap data and the Secret's
/// `format`. The error is in words safe to show in a condition and an Event: the converter
/// quotes the values it rejects, and bootstrap data holds join tokens and keys, so quoted values
/// and token-shaped words are replaced and the message is bounded ([`crate::remote::redact`]).
pub fn render(km: &KVMMachine, format: Option<&str>, data: &[u8]) -> Result<Vec<u8>, String> {
    let facts = capk_bootstrap::MachineFacts {
        hostname: hostname(km),
        instance_id: capk_api::constants::provider_id(
            km.meta().namespace.as_deref().unwrap_or_default(),
            &km.name_any(),
        ),
    };
    capk_bootstrap::BootstrapFormat::from_secret(format)
        .and_then(|f| capk_bootstrap::render_ignition(f, data, &facts, None))
        .map(|r| r.json)
        .map_err(|e| crate::remote::redact::untrusted_message(&e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvmmachine::testing::kvm_machine;
    use serde_json::json;

    #[test]
    fn bootstrap_errors_never_quote_the_bootstrap_data() {
        let token = "abcdef.0123456789abcdef";
        let key = "c2VjcmV0LWtleS1tYXRlcmlhbC0xMjM0NTY3ODkw";
        let km = kvm_machine(
            "m",
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "2Gi"}}),
        );
        let cloud = |body: String| (None, format!("#cloud-config\n{body}"));
        let cases = [
            cloud(format!(
                "write_files:\n- path: /etc/x\n  content: a\n  encoding: {token}\n"
            )),
            cloud(format!(
                "write_files:\n- path: /etc/x\n  content: a\n  permissions: {token}\n"
            )),
            cloud(format!("{token}: 1\n")),
            cloud(format!(
                "write_files:\n- path: /etc/x\n  content: a\n  encoding: {key}\n"
            )),
            (
                None,
                format!("## template: jinja\n#cloud-config\nruncmd:\n- echo {{{{ {token} }}}}\n"),
            ),
            (
                Some("ignition"),
                format!(
                    r#"{{"ignition":{{"version":"2.3.0"}},"storage":{{"files":[{{"path":"/x","filesystem":"root","mode":"{token}"}}]}}}}"#
                ),
            ),
            (
                Some("ignition"),
                format!(r#"{{"ignition":{{"version":"{token}"}}}}"#),
            ),
            (Some(token), "#cloud-config\n".to_owned()),
            // Many bad entries: a long message, still bounded.
            cloud(format!("runcmd:\n{}", "- [a, {b: c}]\n".repeat(5000))),
        ];
        for (format, data) in cases {
            let msg = render(&km, format, data.as_bytes()).unwrap_err();
            assert!(!msg.contains(token) && !msg.contains(key), "{msg}");
            assert!(
                msg.len() <= crate::remote::redact::MAX_MESSAGE_BYTES,
                "{}",
                msg.len()
            );
        }
        // What is wrong is still said: the key path of the bad value.
        let (_, data) = cloud(format!(
            "write_files:\n- path: /etc/x\n  content: a\n  encoding: {token}\n"
        ));
        let msg = render(&km, None, data.as_bytes()).unwrap_err();
        assert!(msg.contains("`write_files[0].encoding`"), "{msg}");
    }
}
