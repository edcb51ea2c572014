//! `infrastructure.cluster.x-k8s.io/v1alpha1`: the KVM provider's kinds.

mod cluster;
mod machine;
mod shared;

use std::collections::BTreeMap;

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

pub use cluster::*;
pub use machine::*;
pub use shared::*;

/// Labels and annotations a template puts on the objects it produces.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateMetadata {
    /// Labels for the produced object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    /// Annotations for the produced object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<BTreeMap<String, String>>,
}
