//! A kubeconfig read from a Secret is data, never instructions.
//!
//! Whoever can write a Secret in a namespace must not be able to make the controller run a
//! command or read its own files (its ServiceAccount token, say), so a kubeconfig from a Secret
//! is checked before any client is built: exec plugins, auth providers (they run helpers and
//! refresh through files), `tokenFile` and every file-path field (`client-certificate`,
//! `client-key`, `certificate-authority`) are refused. Only inline credentials are accepted:
//! `*-data` fields, `token`, `username`/`password`. Cluster API's `<cluster>-kubeconfig` is of
//! that kind.
//!
//! Nothing here quotes the kubeconfig's content in an error: it holds credentials, and errors end
//! up in conditions and Events.
//!
//! Its author may also be a tenant pointing the controller at a server of their own: a
//! `proxy-url` (traffic sent through a host of their choosing) and `insecure-skip-tls-verify`
//! (credentials sent to whoever answers) are refused, and the client gives up on a server that
//! accepts connections and never answers ([`CONNECT_TIMEOUT`], [`READ_TIMEOUT`]; watches through
//! it end before the read timeout, [`WATCH_TIMEOUT_SECONDS`]). What the client reads, how many
//! requests it has in flight, how long each may take and how soon it asks again after a failure
//! are bounded by the operator's [`RemoteLimits`] ([`crate::remote::limits`]), so one tenant's
//! cluster can neither exhaust the controller's memory nor hold its work for everyone. The
//! client does not retry by itself either: when a server's `Retry-After` would be obeyed is the
//! controller's decision.

use kube::{
    Client, Config,
    client::ClientBuilder,
    config::{KubeConfigOptions, Kubeconfig},
};

use crate::remote::limits::{LimitsLayer, RemoteLimits};

/// How long connecting to a remote apiserver may take.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// How long a remote apiserver may stay silent on a connection (a request, or a watch between
/// events) before the request fails.
pub const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// How long a watch through a client of this module is held open by the server (the watch's
/// `timeoutSeconds`): below [`READ_TIMEOUT`], so a quiet watch ends and is renewed instead of
/// timing out.
pub const WATCH_TIMEOUT_SECONDS: u32 = 25;

/// The largest kubeconfig accepted (a Secret holds at most 1 MiB; a kubeconfig with a few
/// certificates is a few KiB).
pub const MAX_BYTES: usize = 256 << 10;

/// Why a kubeconfig from a Secret cannot be used. Messages never quote the kubeconfig.
#[derive(Debug, thiserror::Error)]
pub enum KubeconfigError {
    /// The value is larger than [`MAX_BYTES`].
    #[error("is {size} bytes, over the {limit}-byte limit for a kubeconfig")]
    TooLarge {
        /// Size of the value.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The value is missing or empty.
    #[error("has no kubeconfig in key `value`")]
    Empty,
    /// The value is not UTF-8.
    #[error("is not UTF-8 text")]
    NotUtf8,
    /// The value is not kubeconfig YAML (the parser's message is not shown: it quotes the input).
    #[error("is not a valid kubeconfig (YAML of kind Config)")]
    Parse,
    /// A field that would run a command or read a file of the controller.
    #[error(
        "sets `{field}`, which {why}; refused: a kubeconfig in a Secret must carry its \
         credentials inline (certificate-authority-data, client-certificate-data, \
         client-key-data or token)"
    )]
    Refused {
        /// Where, e.g. `users[0].user.exec`.
        field: String,
        /// What the field would make the controller do.
        why: &'static str,
    },
    /// kube-rs cannot make a client configuration of it (no current context, bad base64, ...).
    #[error("cannot be used: {0}")]
    Config(String),
}

impl KubeconfigError {
    /// The condition and Event reason for this error.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Refused { .. } => "KubeconfigRefused",
            _ => "KubeconfigInvalid",
        }
    }
}

/// A kubeconfig whose credentials are all inline data: building a client from it runs no
/// command and reads no file.
#[derive(Clone, Debug)]
pub struct InlineKubeconfig(Kubeconfig);

impl InlineKubeconfig {
    /// Parses and checks the value of a kubeconfig Secret.
    pub fn parse(value: &[u8]) -> Result<Self, KubeconfigError> {
        if value.len() > MAX_BYTES {
            return Err(KubeconfigError::TooLarge {
                size: value.len(),
                limit: MAX_BYTES,
            });
        }
        let text = std::str::from_utf8(value).map_err(|_| KubeconfigError::NotUtf8)?;
        if text.trim().is_empty() {
            return Err(KubeconfigError::Empty);
        }
        let kc = Kubeconfig::from_yaml(text).map_err(|_| KubeconfigError::Parse)?;
        check(&kc)?;
        Ok(Self(kc))
    }

    /// A client for the kubeconfig's current context, held to `limits`.
    pub async fn client(self, limits: &RemoteLimits) -> Result<Client, KubeconfigError> {
        let shown = |e: &dyn std::fmt::Display| {
            KubeconfigError::Config(crate::remote::redact::untrusted_message(&e.to_string()))
        };
        let mut config = Config::from_custom_kubeconfig(self.0, &KubeConfigOptions::default())
            .await
            .map_err(|e| shown(&e))?;
        config.connect_timeout = Some(CONNECT_TIMEOUT);
        config.read_timeout = Some(READ_TIMEOUT);
        config.write_timeout = Some(READ_TIMEOUT);
        // A proxy from the controller's own environment is no business of a tenant's cluster.
        config.proxy_url = None;
        // Retries (and the waits a server's Retry-After asks for) are the controller's: its
        // back-off per cluster, then the reconcile's.
        config.default_retry = false;
        let builder = ClientBuilder::try_from(config).map_err(|e| shown(&e))?;
        Ok(builder.with_layer(&LimitsLayer::new(limits)).build())
    }
}

/// Refuses every field that makes kube-rs run a command or read a file.
fn check(kc: &Kubeconfig) -> Result<(), KubeconfigError> {
    let refused = |field: String, why| Err(KubeconfigError::Refused { field, why });
    for (i, named) in kc.clusters.iter().enumerate() {
        let Some(c) = &named.cluster else { continue };
        if c.certificate_authority.is_some() {
            return refused(
                format!("clusters[{i}].cluster.certificate-authority"),
                "reads a file on the controller's machine",
            );
        }
        if c.proxy_url.as_deref().is_some_and(|p| !p.is_empty()) {
            return refused(
                format!("clusters[{i}].cluster.proxy-url"),
                "sends the controller's traffic through a host the kubeconfig chooses",
            );
        }
        if c.insecure_skip_tls_verify == Some(true) {
            return refused(
                format!("clusters[{i}].cluster.insecure-skip-tls-verify"),
                "sends the credentials to whichever server answers",
            );
        }
    }
    for (i, named) in kc.auth_infos.iter().enumerate() {
        let Some(u) = &named.auth_info else { continue };
        let at = |f: &str| format!("users[{i}].user.{f}");
        if u.exec.is_some() {
            return refused(at("exec"), "runs a command as the controller");
        }
        if u.auth_provider.is_some() {
            return refused(
                at("auth-provider"),
                "runs helper commands and refreshes tokens through files",
            );
        }
        if u.token_file.is_some() {
            return refused(at("tokenFile"), "reads a file on the controller's machine");
        }
        if u.client_certificate.is_some() {
            return refused(
                at("client-certificate"),
                "reads a file on the controller's machine",
            );
        }
        if u.client_key.is_some() {
            return refused(at("client-key"), "reads a file on the controller's machine");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cluster API's kubeconfig shape, with `user` replaced.
    fn kubeconfig(cluster: &str, user: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: admin@demo\n\
             clusters:\n- name: demo\n  cluster:\n    server: https://127.0.0.1:6443\n{cluster}\
             contexts:\n- name: admin@demo\n  context: {{cluster: demo, user: admin}}\n\
             users:\n- name: admin\n  user:\n{user}"
        )
    }

    const CA_DATA: &str = "    certificate-authority-data: Y2E=\n";

    #[test]
    fn inline_credentials_are_accepted() {
        let ok = kubeconfig(
            CA_DATA,
            "    client-certificate-data: Y2VydA==\n    client-key-data: a2V5\n",
        );
        InlineKubeconfig::parse(ok.as_bytes()).unwrap();
        let token = kubeconfig(CA_DATA, "    token: abcdef.0123456789abcdef\n");
        InlineKubeconfig::parse(token.as_bytes()).unwrap();
    }

    #[test]
    fn commands_and_files_are_refused_with_the_field_named() {
        let cases = [
            (
                kubeconfig(
                    CA_DATA,
                    "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: /bin/sh\n      args: [-c, 'touch /tmp/pwned']\n",
                ),
                "users[0].user.exec",
            ),
            (
                kubeconfig(
                    CA_DATA,
                    "    auth-provider:\n      name: gcp\n      config: {cmd-path: /bin/sh}\n",
                ),
                "users[0].user.auth-provider",
            ),
            (
                kubeconfig(
                    CA_DATA,
                    "    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n",
                ),
                "users[0].user.tokenFile",
            ),
            (
                kubeconfig(
                    CA_DATA,
                    "    client-certificate: /etc/cert.pem\n    client-key-data: a2V5\n",
                ),
                "users[0].user.client-certificate",
            ),
            (
                kubeconfig(
                    CA_DATA,
                    "    client-certificate-data: Y2VydA==\n    client-key: /etc/key.pem\n",
                ),
                "users[0].user.client-key",
            ),
            (
                kubeconfig("    certificate-authority: /etc/ca.pem\n", "    token: t\n"),
                "clusters[0].cluster.certificate-authority",
            ),
            (
                kubeconfig(
                    "    certificate-authority-data: Y2E=\n    proxy-url: socks5://10.0.0.1:1080\n",
                    "    token: t\n",
                ),
                "clusters[0].cluster.proxy-url",
            ),
            (
                kubeconfig("    insecure-skip-tls-verify: true\n", "    token: t\n"),
                "clusters[0].cluster.insecure-skip-tls-verify",
            ),
        ];
        for (text, field) in cases {
            let err = InlineKubeconfig::parse(text.as_bytes()).unwrap_err();
            assert_eq!(err.reason(), "KubeconfigRefused", "{field}");
            let msg = err.to_string();
            assert!(msg.contains(&format!("`{field}`")), "{msg}");
            assert!(!msg.contains("/bin/sh") && !msg.contains("/etc/"), "{msg}");
        }
    }

    #[test]
    fn garbage_is_invalid_and_never_quoted() {
        let secret = "abcdef.0123456789abcdef";
        for value in [
            format!("users: {secret}").into_bytes(),
            vec![0xff, 0xfe],
            b"  ".to_vec(),
            vec![b'a'; MAX_BYTES + 1],
        ] {
            let err = InlineKubeconfig::parse(&value).unwrap_err();
            assert_eq!(err.reason(), "KubeconfigInvalid");
            assert!(!err.to_string().contains(secret), "{err}");
        }
    }
}
