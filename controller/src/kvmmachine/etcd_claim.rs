//! Pure: the etcd PVC of a control-plane machine whose etcd storage is a persistent volume.

use std::collections::BTreeMap;

use capk_api::v1alpha1::{EtcdStorageType, KVMMachine};
use k8s_openapi::{
    api::core::v1::{PersistentVolumeClaim, PersistentVolumeClaimSpec, VolumeResourceRequirements},
    apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::ObjectMeta},
};

use super::{
    names::{self, MachineNames},
    placement::MachinePlacement,
};
use crate::k8s::ownership::{Home, Owner};

/// The etcd PVC of a control-plane machine with `etcdStorage.type: persistentVolume`, made in
/// `home` under `names` (next to the machine Pod that mounts it).
pub fn desired(
    km: &KVMMachine,
    placement: &MachinePlacement,
    home: &Home,
    names: &MachineNames,
) -> Option<PersistentVolumeClaim> {
    let storage = km.spec.etcd_storage.as_ref()?;
    if !placement.control_plane || storage.type_ != EtcdStorageType::PersistentVolume {
        return None;
    }
    let size = storage.size.as_ref()?.0.clone();
    Some(PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(names.etcd_claim.clone()),
            namespace: Some(home.namespace.clone()),
            labels: Some(names::labels(km, placement)),
            owner_references: Owner::machine(km).owner_references(home),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            storage_class_name: storage.storage_class_name.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([("storage".to_owned(), Quantity(size))])),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvmmachine::testing::{kvm_machine, management};
    use serde_json::json;

    fn names(km: &KVMMachine) -> MachineNames {
        MachineNames::in_home(km, &management())
    }

    #[test]
    fn only_a_control_plane_with_a_persistent_volume_gets_a_claim() {
        let km = kvm_machine(
            "demo-cp-0",
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi"},
                   "etcdStorage": {"type": "persistentVolume", "size": "8Gi",
                                   "storageClassName": "fast"}}),
        );
        let cp = MachinePlacement {
            cluster: "demo".into(),
            control_plane: true,
            failure_domain: None,
        };
        let pvc = desired(&km, &cp, &management(), &names(&km)).unwrap();
        assert_eq!(pvc.metadata.name.as_deref(), Some("demo-cp-0-etcd"));
        let spec = pvc.spec.unwrap();
        assert_eq!(spec.storage_class_name.as_deref(), Some("fast"));
        assert_eq!(
            spec.resources.unwrap().requests.unwrap()["storage"].0,
            "8Gi"
        );
        assert_eq!(pvc.metadata.owner_references.unwrap()[0].kind, "KVMMachine");
        let worker = MachinePlacement {
            control_plane: false,
            ..cp.clone()
        };
        assert!(desired(&km, &worker, &management(), &names(&km)).is_none());
        let host = kvm_machine(
            "demo-cp-1",
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi"},
                   "etcdStorage": {"type": "hostPath", "hostPath": "/srv/etcd"}}),
        );
        assert!(desired(&host, &cp, &management(), &names(&host)).is_none());
    }
}
