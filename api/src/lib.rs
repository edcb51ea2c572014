//! The API of cluster-api-provider-kvm: the KVM kinds (`infrastructure.cluster.x-k8s.io/v1alpha1`),
//! the minimal Cluster API types the provider reads, and the names (labels, annotations,
//! finalizers, conditions), the machine limits and the launch contract between the controller and
//! the launcher. No I/O.
#![forbid(unsafe_code)]

pub mod byte_size;
#[cfg(feature = "kube")]
pub mod capi;
pub mod constants;
#[cfg(feature = "kube")]
pub mod crd;
pub mod dns;
pub mod etcd_owner;
pub mod file_error;
pub mod launch;
pub mod limits;
pub mod mount_tag;
pub mod quantity;
#[cfg(feature = "kube")]
pub mod v1alpha1;
