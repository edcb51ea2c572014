//! Pure: which Cluster API object owns an object ([`capi_owner`], [`cluster_of`]), which KVMMachine
//! or KVMCluster an object the controller made belongs to, and how an object that already exists
//! under the name the controller would give it is adopted.
//!
//! In the management cluster an object carries an owner reference to its KVMMachine or
//! KVMCluster (the garbage collector's safety net) and labels naming it. In a hosting cluster it
//! cannot: an owner reference names an object of the same cluster, and the garbage collector
//! there would delete the object at once. So the labels alone name the owner: its namespace in
//! the management cluster ([`OWNER_NAMESPACE_LABEL`]), its name ([`KVMMACHINE_LABEL`] or
//! [`KVMCLUSTER_LABEL`]) and the UID that last claimed it ([`OWNER_UID_LABEL`]). Cleanup is the
//! owner's finalizer.
//!
//! An existing object is adopted when its labels (or an owner reference) name the same owner,
//! by namespace and name and not by UID: `clusterctl move` recreates the owner with a new UID.
//! Anything else is someone else's and is left alone. Adopting rewrites labels and owner
//! references only, so a running machine Pod keeps running.

use std::collections::BTreeMap;

use capk_api::{
    constants::{
        CLUSTER_NAME_LABEL, GROUP, KVMCLUSTER_LABEL, KVMMACHINE_LABEL, MAX_LABEL_LEN,
        OWNER_NAMESPACE_LABEL, OWNER_UID_LABEL, bounded_name, name_hash,
    },
    v1alpha1::{KVMCluster, KVMMachine},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};

/// The name of the Cluster API object of `kind` (`Cluster`, `Machine`) that owns `obj`.
pub fn capi_owner<K: Resource>(obj: &K, kind: &str) -> Option<String> {
    obj.owner_references()
        .iter()
        .find(|o| o.kind == kind && is_capi(o))
        .map(|o| o.name.clone())
}

/// The Cluster API Cluster that `obj` (a KVMCluster, a KVMMachine, an object the controller made
/// for one) belongs to: the Cluster that owns it, else its `cluster.x-k8s.io/cluster-name` label
/// (which Cluster API sets on the machines it makes, and the controller on what it makes).
pub fn cluster_of<K: Resource>(obj: &K) -> Option<String> {
    capi_owner(obj, "Cluster").or_else(|| obj.labels().get(CLUSTER_NAME_LABEL).cloned())
}

/// Where the controller makes a cluster's objects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Home {
    /// The namespace, in the management cluster or in the hosting cluster.
    pub namespace: String,
    /// The objects live in the management cluster, next to their owner (in its namespace), so
    /// they also carry an owner reference to it. False in a hosting cluster, and in a machine
    /// namespace of the management cluster's operator.
    pub management: bool,
}

impl Home {
    /// The name of an object made here for an owner in `owner_namespace`: `<base><suffix>` in
    /// the owner's own namespace (always so in the management cluster); in another namespace,
    /// which owners of several management namespaces may share, qualified by the owner's:
    /// `<base>-<hash of owner_namespace><suffix>`, so that same-named owners of two namespaces
    /// never want one name. At most `max` bytes, cut and hashed as [`bounded_name`] does: a DNS
    /// label (or subdomain) whenever `base` is one and `suffix` ends in a letter or is empty.
    pub fn name_for(&self, owner_namespace: &str, base: &str, suffix: &str, max: usize) -> String {
        if self.namespace == owner_namespace {
            return bounded_name(base, suffix, max);
        }
        let qualified = format!("-{}{suffix}", name_hash(owner_namespace));
        bounded_name(base, &qualified, max)
    }
}

/// The KVMMachine or KVMCluster that objects belong to.
#[derive(Clone, Debug, PartialEq)]
pub struct Owner {
    /// [`KVMMACHINE_LABEL`] or [`KVMCLUSTER_LABEL`].
    name_label: &'static str,
    namespace: String,
    name: String,
    uid: Option<String>,
    reference: Option<OwnerReference>,
}

impl Owner {
    /// The owner of a machine's objects (machine Pod, Ignition Secret, etcd PVC).
    pub fn machine(km: &KVMMachine) -> Self {
        Self::of(km, KVMMACHINE_LABEL)
    }

    /// The owner of a cluster's objects (control-plane Service, EndpointSlice).
    pub fn cluster(kc: &KVMCluster) -> Self {
        Self::of(kc, KVMCLUSTER_LABEL)
    }

    fn of<K: Resource<DynamicType = ()>>(obj: &K, name_label: &'static str) -> Self {
        Self {
            name_label,
            namespace: obj.namespace().unwrap_or_default(),
            name: obj.name_any(),
            uid: obj.uid(),
            reference: obj.controller_owner_ref(&()),
        }
    }

    /// The labels naming this owner: its namespace, its name (cut and hashed when longer than a
    /// label value may be) and its UID.
    pub fn labels(&self) -> BTreeMap<String, String> {
        let mut labels = BTreeMap::from([
            (OWNER_NAMESPACE_LABEL.to_owned(), self.namespace.clone()),
            (
                self.name_label.to_owned(),
                bounded_name(&self.name, "", MAX_LABEL_LEN),
            ),
        ]);
        if let Some(uid) = &self.uid {
            labels.insert(OWNER_UID_LABEL.to_owned(), uid.clone());
        }
        labels
    }

    /// The owner references of an object made in `home`: the owner's in the management
    /// cluster, none in a hosting cluster.
    pub fn owner_references(&self, home: &Home) -> Option<Vec<OwnerReference>> {
        if !home.management {
            return None;
        }
        self.reference.clone().map(|r| vec![r])
    }

    /// Whether `meta` belongs to this owner: its labels name it (namespace and name), or it has
    /// an owner reference to it by UID (its labels edited away: adopting puts them back).
    pub fn owns(&self, meta: &ObjectMeta) -> bool {
        let labels = meta.labels.as_ref();
        let label = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
        let named = label(OWNER_NAMESPACE_LABEL) == Some(self.namespace.as_str())
            && label(self.name_label) == Some(bounded_name(&self.name, "", MAX_LABEL_LEN).as_str());
        let referenced = self.uid.as_ref().is_some_and(|uid| {
            meta.owner_references
                .iter()
                .flatten()
                .any(|r| &r.uid == uid)
        });
        named || referenced
    }
}

/// What to do with an object that exists under the name the controller would give it.
#[derive(Clone, Debug, PartialEq)]
pub enum Claim {
    /// Ours, labelled and referenced as it should be.
    Current,
    /// Ours, but its labels or owner references are not (yet) what they should be: this JSON
    /// merge patch (metadata only, guarded by the resourceVersion) makes them so.
    Adopt(Value),
    /// Not ours: nothing names this owner. Left alone.
    Foreign,
}

/// An owner reference to one of our kinds (which only the controller sets).
pub fn is_ours(r: &OwnerReference) -> bool {
    r.api_version.starts_with(&format!("{GROUP}/"))
        && matches!(r.kind.as_str(), "KVMMachine" | "KVMCluster")
}

/// An owner reference to a Cluster API object (`cluster.x-k8s.io`): a KVMMachine's Machine, a
/// KVMCluster's Cluster.
pub fn is_capi(r: &OwnerReference) -> bool {
    r.api_version.starts_with("cluster.x-k8s.io/")
}

/// Whether `meta` belongs to `owner`, and what makes its labels and owner references those of
/// an object `owner` makes in `home` (in a hosting cluster: no owner reference to our kinds).
pub fn claim(meta: &ObjectMeta, owner: &Owner, home: &Home) -> Claim {
    if !owner.owns(meta) {
        return Claim::Foreign;
    }
    let labels = meta.labels.clone().unwrap_or_default();
    let stale: BTreeMap<String, String> = owner
        .labels()
        .into_iter()
        .filter(|(k, v)| labels.get(k) != Some(v))
        .collect();
    let current = meta.owner_references.clone().unwrap_or_default();
    let wanted = owner.owner_references(home).unwrap_or_default();
    let uids = |refs: &[OwnerReference]| -> Vec<String> {
        let mut u: Vec<String> = refs
            .iter()
            .filter(|r| is_ours(r))
            .map(|r| r.uid.clone())
            .collect();
        u.sort();
        u
    };
    let references_right = uids(&current) == uids(&wanted);
    if stale.is_empty() && references_right {
        return Claim::Current;
    }
    let mut metadata = json!({});
    if let Some(rv) = &meta.resource_version {
        metadata["resourceVersion"] = json!(rv);
    }
    if !stale.is_empty() {
        metadata["labels"] = json!(stale);
    }
    if !references_right {
        let refs: Vec<OwnerReference> = current
            .into_iter()
            .filter(|r| !is_ours(r))
            .chain(wanted)
            .collect();
        metadata["ownerReferences"] = if refs.is_empty() {
            Value::Null
        } else {
            json!(refs)
        };
    }
    Claim::Adopt(json!({ "metadata": metadata }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvmmachine::testing::kvm_machine;

    fn km() -> KVMMachine {
        kvm_machine(
            "demo-cp-0",
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "2Gi"}}),
        )
    }

    fn meta(labels: Value, owners: Value) -> ObjectMeta {
        serde_json::from_value(json!({
            "name": "demo-cp-0", "namespace": "hosted", "resourceVersion": "42",
            "labels": labels, "ownerReferences": owners,
        }))
        .unwrap()
    }

    fn home(management: bool) -> Home {
        Home {
            namespace: "hosted".into(),
            management,
        }
    }

    fn reference(uid: &str) -> Value {
        json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMMachine",
               "name": "demo-cp-0", "uid": uid, "controller": true, "blockOwnerDeletion": true})
    }

    #[test]
    fn labels_name_the_owner_and_only_the_management_cluster_gets_references() {
        let owner = Owner::machine(&km());
        assert_eq!(
            owner.labels(),
            BTreeMap::from([
                (OWNER_NAMESPACE_LABEL.into(), "team-a".into()),
                (KVMMACHINE_LABEL.into(), "demo-cp-0".into()),
                (OWNER_UID_LABEL.into(), "uid-1".into()),
            ])
        );
        assert_eq!(owner.owner_references(&home(true)).unwrap()[0].uid, "uid-1");
        assert_eq!(owner.owner_references(&home(false)), None);
    }

    #[test]
    fn an_object_made_as_wanted_is_current() {
        let owner = Owner::machine(&km());
        let labels = json!(owner.labels());
        assert_eq!(
            claim(&meta(labels.clone(), json!([])), &owner, &home(false)),
            Claim::Current
        );
        assert_eq!(
            claim(
                &meta(labels, json!([reference("uid-1")])),
                &owner,
                &home(true)
            ),
            Claim::Current
        );
    }

    #[test]
    fn a_moved_owner_adopts_by_namespace_and_name_and_updates_the_uid() {
        // Made for the KVMMachine before `clusterctl move`; the moved one has a new UID.
        let before = json!({OWNER_NAMESPACE_LABEL: "team-a", KVMMACHINE_LABEL: "demo-cp-0",
                            OWNER_UID_LABEL: "uid-0", "app.kubernetes.io/managed-by": "capk-controller"});
        let got = claim(
            &meta(before, json!([])),
            &Owner::machine(&km()),
            &home(false),
        );
        assert_eq!(
            got,
            Claim::Adopt(json!({"metadata": {"resourceVersion": "42",
                                             "labels": {OWNER_UID_LABEL: "uid-1"}}}))
        );
    }

    #[test]
    fn switching_to_a_hosting_cluster_drops_our_owner_reference_and_keeps_others() {
        // A Pod made in the management cluster by a controller that set no owner labels.
        let other = json!({"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "cm-1"});
        let m = meta(
            json!({"cluster.x-k8s.io/cluster-name": "demo"}),
            json!([reference("uid-1"), other.clone()]),
        );
        let Claim::Adopt(patch) = claim(&m, &Owner::machine(&km()), &home(false)) else {
            panic!("not adopted")
        };
        assert_eq!(patch["metadata"]["ownerReferences"], json!([other]));
        assert_eq!(patch["metadata"]["labels"][OWNER_NAMESPACE_LABEL], "team-a");
        assert_eq!(patch["metadata"]["resourceVersion"], "42");
        // Only our reference: the field goes.
        let only = meta(json!({}), json!([reference("uid-1")]));
        let Claim::Adopt(patch) = claim(&only, &Owner::machine(&km()), &home(false)) else {
            panic!("not adopted")
        };
        assert_eq!(patch["metadata"]["ownerReferences"], Value::Null);
        // In the management cluster the same object only gains labels.
        let Claim::Adopt(patch) = claim(&only, &Owner::machine(&km()), &home(true)) else {
            panic!("not adopted")
        };
        assert!(
            patch["metadata"].get("ownerReferences").is_none(),
            "{patch}"
        );
    }

    #[test]
    fn objects_of_another_owner_are_foreign() {
        let owner = Owner::machine(&km());
        let other_ns = json!({OWNER_NAMESPACE_LABEL: "team-b", KVMMACHINE_LABEL: "demo-cp-0"});
        assert_eq!(
            claim(&meta(other_ns, json!([])), &owner, &home(false)),
            Claim::Foreign
        );
        assert_eq!(
            claim(&meta(json!({}), json!([])), &owner, &home(true)),
            Claim::Foreign,
            "unlabelled and unreferenced: someone else's Pod of the same name"
        );
        let cluster_label = json!({OWNER_NAMESPACE_LABEL: "team-a", KVMCLUSTER_LABEL: "demo-cp-0"});
        assert_eq!(
            claim(&meta(cluster_label, json!([])), &owner, &home(false)),
            Claim::Foreign,
            "a KVMCluster of that name is another owner"
        );
    }
}
