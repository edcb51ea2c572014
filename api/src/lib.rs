//! The API of cluster-api-provider-kvm: the KVM kinds (`infrastructure.cluster.x-k8s.io/v1alpha1`),
//! the minimal Cluster API types the provider reads, and the names (labels, annotations,
//! finalizers, conditions) everything else shares. No I/O.
#![forbid(unsafe_code)]

pub mod capi;
pub mod constants;
pub mod crd;
pub mod quantity;
pub mod v1alpha1;
