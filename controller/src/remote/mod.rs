//! A link to another cluster's API, reached through a kubeconfig Secret in the management
//! cluster: a hosting cluster where machine Pods live, or a workload cluster whose Nodes the
//! machines follow. One [`Link`] holds the client built from one version of the Secret, the
//! caches its watches fill, and what those watches found ([`LinkState`]: in sync once every
//! watch has listed, the failure while one fails). Its watches run in background tasks that end
//! when the link is dropped. [`Links`] keeps the links of one kind by key.
//!
//! The kubeconfig is data, never instructions: [`KubeconfigSecret::client`] refuses one that
//! would run a command or read a file of the controller before any client exists, and the client
//! is held to the operator's limits on what it reads and how long it waits
//! ([`limits`]).
//!
//! Its submodules are the links themselves and what keeps them safe: [`hosting`] and
//! [`workload`] clusters, the probe of workload apiservers ([`apiserver_health`]), the operator's
//! [`limits`], kubeconfigs read as data ([`kubeconfig`]) and untrusted text made safe to show
//! ([`redact`]).

pub mod apiserver_health;
pub mod hosting;
pub mod kubeconfig;
pub mod limits;
pub mod redact;
pub mod workload;

use std::{
    collections::HashMap,
    hash::{Hash, Hasher},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client, ResourceExt};

use crate::{
    k8s::conditions::DesiredCondition,
    remote::kubeconfig::{InlineKubeconfig, KubeconfigError},
    remote::limits::RemoteLimits,
};

/// Why a remote cluster cannot be used now. The message never quotes the kubeconfig.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unavailable {
    /// CamelCase reason.
    pub reason: &'static str,
    /// What is wrong, and what to do about it where that is the user's.
    pub message: String,
}

impl Unavailable {
    /// Condition `type_` saying so (status False).
    pub fn condition(&self, type_: &'static str) -> DesiredCondition {
        DesiredCondition::falsy(type_, self.reason, self.message.clone())
    }
}

/// A kubeconfig Secret as read from the management cluster.
pub struct KubeconfigSecret {
    /// The Secret's resourceVersion.
    pub version: String,
    /// A digest of the kubeconfig: a Secret whose metadata alone changed holds the same one.
    pub digest: u64,
    value: Vec<u8>,
}

impl KubeconfigSecret {
    /// Reads key `key` of Secret `name` in namespace `ns`; `None` when the Secret does not
    /// exist.
    pub async fn read(
        mc: &Client,
        ns: &str,
        name: &str,
        key: &str,
    ) -> Result<Option<Self>, kube::Error> {
        let Some(secret) = Api::<Secret>::namespaced(mc.clone(), ns)
            .get_opt(name)
            .await?
        else {
            return Ok(None);
        };
        let value = secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .map(|v| v.0.clone())
            .unwrap_or_default();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        value.hash(&mut h);
        Ok(Some(Self {
            version: secret.resource_version().unwrap_or_default(),
            digest: h.finish(),
            value,
        }))
    }

    /// A client of the cluster the kubeconfig names. It is checked as data first
    /// ([`InlineKubeconfig`]): one that would run a command or read a file of the controller is
    /// refused before any client exists. The client is held to `limits`.
    pub async fn client(&self, limits: &RemoteLimits) -> Result<Client, KubeconfigError> {
        InlineKubeconfig::parse(&self.value)?.client(limits).await
    }
}

/// What a link's watches tell the reconcilers.
#[derive(Default)]
pub struct LinkState {
    /// Why the cluster cannot be used, while it cannot.
    failure: Mutex<Option<Unavailable>>,
    /// Every watch has listed once.
    synced: AtomicBool,
    /// A watch failed.
    failed: tokio::sync::Notify,
}

impl LinkState {
    /// Records a failure; returns the one recorded before, if any.
    pub fn fail(&self, u: Unavailable) -> Option<Unavailable> {
        self.failure.lock().expect("failure lock").replace(u)
    }

    /// Clears the failure; true when there was one.
    pub fn recover(&self) -> bool {
        self.failure.lock().expect("failure lock").take().is_some()
    }

    /// Why the cluster cannot be used, while it cannot.
    pub fn failure(&self) -> Option<Unavailable> {
        self.failure.lock().expect("failure lock").clone()
    }

    /// Records that every watch has listed once: the caches mean something from now on.
    pub fn set_synced(&self) {
        self.synced.store(true, Ordering::SeqCst);
    }

    /// Whether every watch has listed once.
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::SeqCst)
    }

    /// Wakes one task waiting in [`LinkState::wait_failed`].
    pub fn notify_failed(&self) {
        self.failed.notify_one();
    }

    /// Waits until a watch reports a failure ([`LinkState::notify_failed`]).
    pub async fn wait_failed(&self) {
        self.failed.notified().await;
    }
}

/// A link to one remote cluster: its client, built from one version of the kubeconfig Secret,
/// the caches `C` its watches fill, and their state. Dropping it stops its watches.
pub struct Link<C> {
    /// The kubeconfig Secret's resourceVersion the link was last found current for.
    version: Mutex<String>,
    /// The digest of the kubeconfig it was built from.
    digest: u64,
    client: Client,
    caches: C,
    state: Arc<LinkState>,
    tasks: Vec<tokio::task::AbortHandle>,
}

impl<C> Drop for Link<C> {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl<C> Link<C> {
    /// A link through `client`, built from version `version` of a kubeconfig Secret whose
    /// kubeconfig has digest `digest`, whose watches fill `caches`. No task runs yet
    /// ([`Link::spawn`]).
    pub fn new(version: String, digest: u64, client: Client, caches: C) -> Self {
        Self {
            version: Mutex::new(version),
            digest,
            client,
            caches,
            state: Arc::default(),
            tasks: Vec::new(),
        }
    }

    /// Runs `task` (a watch, a probe) for as long as the link lives.
    pub fn spawn(&mut self, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks.push(tokio::spawn(task).abort_handle());
    }

    /// The client of the remote cluster.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The caches the link's watches fill.
    pub fn caches(&self) -> &C {
        &self.caches
    }

    /// What the link's watches found.
    pub fn state(&self) -> &Arc<LinkState> {
        &self.state
    }

    /// Whether the link was built from (or found current for) version `version` of the Secret.
    pub fn is_current(&self, version: &str) -> bool {
        *self.version.lock().expect("version lock") == version
    }

    /// Whether the link was built from the same kubeconfig as `secret` holds.
    pub fn has_kubeconfig_of(&self, secret: &KubeconfigSecret) -> bool {
        self.digest == secret.digest
    }

    /// Records that `version` of the Secret holds the kubeconfig the link was built from (its
    /// metadata alone changed).
    pub fn renew(&self, version: &str) {
        *self.version.lock().expect("version lock") = version.to_owned();
    }
}

/// The links to the remote clusters of one kind, by key.
pub struct Links<K, C> {
    links: Mutex<HashMap<K, Arc<Link<C>>>>,
}

impl<K, C> Default for Links<K, C> {
    fn default() -> Self {
        Self {
            links: Mutex::default(),
        }
    }
}

impl<K: Clone + Eq + Hash, C> Links<K, C> {
    /// The link of `key`, whatever its version.
    pub fn get(&self, key: &K) -> Option<Arc<Link<C>>> {
        self.links.lock().expect("links lock").get(key).cloned()
    }

    /// The link of `key` if it is current for version `version` of its Secret.
    pub fn current(&self, key: &K, version: &str) -> Option<Arc<Link<C>>> {
        self.get(key).filter(|l| l.is_current(version))
    }

    /// Keeps `link` as the link of `key` (the one before, if any, is dropped).
    pub fn insert(&self, key: K, link: Link<C>) -> Arc<Link<C>> {
        let link = Arc::new(link);
        self.links
            .lock()
            .expect("links lock")
            .insert(key, link.clone());
        link
    }

    /// Drops the link of `key`; true when there was one.
    pub fn remove(&self, key: &K) -> bool {
        self.links.lock().expect("links lock").remove(key).is_some()
    }

    /// Drops the links whose key `keep` does not keep; returns their keys.
    pub fn retain(&self, keep: impl Fn(&K) -> bool) -> Vec<K> {
        let mut links = self.links.lock().expect("links lock");
        let gone: Vec<K> = links.keys().filter(|k| !keep(k)).cloned().collect();
        links.retain(|k, _| keep(k));
        gone
    }

    /// How many clusters are linked.
    pub fn len(&self) -> usize {
        self.links.lock().expect("links lock").len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client() -> Client {
        let config = kube::Config::new("https://127.0.0.1:1".parse().unwrap());
        Client::try_from(config).unwrap()
    }

    #[tokio::test]
    async fn a_dropped_link_stops_its_watches_and_a_renewed_one_is_current_again() {
        let links: Links<&str, ()> = Links::default();
        let mut link = Link::new("1".into(), 7, client(), ());
        let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
        link.spawn(async move {
            let _held = tx;
            std::future::pending::<()>().await
        });
        links.insert("a", link);
        assert!(links.current(&"a", "1").is_some());
        assert!(links.current(&"a", "2").is_none());
        links.get(&"a").unwrap().renew("2");
        assert!(links.current(&"a", "2").is_some());
        assert_eq!(links.retain(|k| *k != "a"), ["a"]);
        assert!(links.is_empty());
        // The task was aborted: its end of the channel is gone.
        assert_eq!(rx.recv().await, None);
    }

    #[test]
    fn a_failure_is_recorded_until_recovery() {
        let state = LinkState::default();
        let down = Unavailable {
            reason: "Unreachable",
            message: "no answer".into(),
        };
        assert_eq!(state.fail(down.clone()), None);
        assert_eq!(state.fail(down.clone()), Some(down.clone()));
        assert_eq!(state.failure(), Some(down));
        assert!(state.recover());
        assert!(!state.recover());
        assert!(!state.synced());
        state.set_synced();
        assert!(state.synced());
    }
}
