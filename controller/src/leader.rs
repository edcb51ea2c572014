//! Leader election on a Lease, so that several replicas can run and one reconciles.

use kube::Client;
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder};

/// Name of the leader-election Lease.
pub const LEASE_NAME: &str = "capkvm-controller-leader";

/// The Lease manager for `identity` in `namespace`: a 15 s lease renewed 5 s before it ends.
/// Needs get, create and patch on `coordination.k8s.io` leases there.
pub async fn lease_manager(
    client: Client,
    namespace: &str,
    identity: &str,
) -> Result<LeaseManager, kube_lease_manager::LeaseManagerError> {
    LeaseManagerBuilder::new(client, LEASE_NAME)
        .with_namespace(namespace)
        .with_identity(identity)
        .with_duration(15)
        .with_grace(5)
        .with_field_manager(crate::objects::FIELD_MANAGER)
        .build()
        .await
}
