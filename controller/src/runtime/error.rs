//! The controller's errors. Each variant names the step that failed; [`Error::category`] is the
//! label used in metrics and as the reason of Warning Events.

/// A reconcile step that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading an object from the apiserver failed.
    #[error("read {kind} {name}: {source}")]
    Read {
        /// Kind read.
        kind: &'static str,
        /// Name read.
        name: String,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// Applying a desired object (server-side apply) failed.
    #[error("apply {kind} {name}: {source}")]
    Apply {
        /// Kind applied.
        kind: &'static str,
        /// Name applied.
        name: String,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// Deleting an object failed.
    #[error("delete {kind} {name}: {source}")]
    Delete {
        /// Kind deleted.
        kind: &'static str,
        /// Name deleted.
        name: String,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// Writing the object's status failed.
    #[error("update status: {0}")]
    UpdateStatus(#[source] kube::Error),
    /// Adding or removing the finalizer failed.
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    /// Deletion waits for the machine Pod (and its VM) to be gone.
    #[error("machine Pod {0} is still terminating")]
    PodStillTerminating(String),
    /// Deletion waits for the machine's etcd data to be removed from its MC node (a cleanup
    /// Pod runs, or the next one is due after a failure).
    #[error("{message}")]
    EtcdCleanupPending {
        /// What is being waited for.
        message: String,
        /// When to look again (the watch of the cleanup Pod usually wakes it sooner).
        retry: std::time::Duration,
    },
    /// The object lacks a namespace (our kinds are namespaced; this is a bug).
    #[error("object has no namespace")]
    MissingNamespace,
    /// An object of the name the controller would make exists and belongs to someone else.
    #[error(
        "{kind} {name} in {place} belongs to someone else (its labels name another owner); \
         it is left alone: rename or remove it"
    )]
    Foreign {
        /// Kind found.
        kind: &'static str,
        /// Its name.
        name: String,
        /// Where it is.
        place: String,
    },
    /// The cluster where the objects live cannot be used now (the condition says why).
    #[error("hosting cluster unavailable: {0}")]
    HostingUnavailable(String),
    /// The machine's workload cluster failed: its Node watch, or syncing its Node (the
    /// `NodeReady` condition and the Pod's readiness gate say why).
    #[error("workload cluster: {0}")]
    WorkloadUnavailable(String),
    /// The reconcile took longer than its deadline (the back-off module's): a cluster it
    /// talks to answers too slowly.
    #[error(
        "the reconcile did not finish within {0:?} (a cluster it talks to answers too slowly); \
         retrying with back-off"
    )]
    Deadline(std::time::Duration),
    /// A KVMCluster with a hosting cluster waits for its KVMMachines to be deleted: each needs
    /// it to find the hosting cluster its machine Pod is in.
    #[error("{0} KVMMachines of the cluster still exist; they are deleted first")]
    MachinesRemain(usize),
}

impl Error {
    /// Short category for metrics and Event reasons.
    pub fn category(&self) -> &'static str {
        match self {
            Error::Read { .. } => "ReadFailed",
            Error::Apply { .. } => "ApplyFailed",
            Error::Delete { .. } => "DeleteFailed",
            Error::UpdateStatus(_) => "StatusUpdateFailed",
            // A step that failed inside the finalizer's apply or cleanup is that step's failure.
            Error::Finalizer(f) => match f.as_ref() {
                kube::runtime::finalizer::Error::ApplyFailed(e)
                | kube::runtime::finalizer::Error::CleanupFailed(e) => e.category(),
                _ => "FinalizerFailed",
            },
            Error::PodStillTerminating(_) => "WaitingForPodDeletion",
            Error::EtcdCleanupPending { .. } => "WaitingForEtcdCleanup",
            Error::MissingNamespace => "InvalidObject",
            Error::Foreign { .. } => "ForeignObject",
            Error::HostingUnavailable(_) => "HostingClusterUnavailable",
            Error::WorkloadUnavailable(_) => "WorkloadClusterUnavailable",
            Error::MachinesRemain(_) => "WaitingForMachines",
            Error::Deadline(_) => "DeadlineExceeded",
        }
    }

    /// Waiting for something else to happen, which a condition already shows: retried, logged,
    /// no Warning Event each time.
    pub fn is_waiting(&self) -> bool {
        match self {
            Error::HostingUnavailable(_)
            | Error::WorkloadUnavailable(_)
            | Error::MachinesRemain(_)
            | Error::EtcdCleanupPending { .. } => true,
            Error::Finalizer(f) => matches!(
                f.as_ref(),
                kube::runtime::finalizer::Error::CleanupFailed(e) | kube::runtime::finalizer::Error::ApplyFailed(e) if e.is_waiting()
            ),
            _ => false,
        }
    }

    /// Whether the message holds only names and the controller's own words, nothing a server,
    /// a kubeconfig or bootstrap data said: an Event shows it as it is, names the user must act
    /// on included (redaction would take a name with digits for a secret).
    pub fn is_own_words(&self) -> bool {
        match self {
            Error::Foreign { .. } | Error::MachinesRemain(_) => true,
            Error::Finalizer(f) => matches!(
                f.as_ref(),
                kube::runtime::finalizer::Error::CleanupFailed(e) | kube::runtime::finalizer::Error::ApplyFailed(e) if e.is_own_words()
            ),
            _ => false,
        }
    }
}

impl Error {
    /// When a step that waits wants to be looked at again, if it says.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        use kube::runtime::finalizer::Error as F;
        match self {
            Error::EtcdCleanupPending { retry, .. } => Some(*retry),
            Error::Finalizer(f) => match f.as_ref() {
                F::ApplyFailed(e) | F::CleanupFailed(e) => e.retry_after(),
                _ => None,
            },
            _ => None,
        }
    }

    /// Lost an optimistic-concurrency race (the object changed between read and write): the
    /// reconcile is simply retried, nothing for a user to see. A 409 Conflict, or the 422 of
    /// kube-runtime's finalizer JSON patch whose `test` of `/metadata/finalizers` failed.
    pub fn is_conflict(&self) -> bool {
        use kube::runtime::finalizer::Error as F;
        let api_code = |e: &kube::Error| match e {
            kube::Error::Api(s) => Some(s.code),
            _ => None,
        };
        match self {
            Error::Apply { source, .. }
            | Error::Delete { source, .. }
            | Error::UpdateStatus(source) => api_code(source) == Some(409),
            Error::Finalizer(f) => match f.as_ref() {
                F::AddFinalizer(e) | F::RemoveFinalizer(e) => match e {
                    kube::Error::Api(s) if s.code == 409 => true,
                    // A failed JSON patch `test` has no causes; a validation error names them.
                    kube::Error::Api(s) if s.code == 422 => {
                        s.details.as_ref().is_none_or(|d| d.causes.is_empty())
                    }
                    _ => false,
                },
                F::ApplyFailed(e) | F::CleanupFailed(e) => e.is_conflict(),
                _ => false,
            },
            _ => false,
        }
    }
}

impl Error {
    /// The reconciled object itself is gone (404 on its status or its finalizer): it was deleted
    /// while the reconcile ran, as `clusterctl move` does to the source's copies right after
    /// pausing them. Nothing is left to report on: no Warning Event about an object that no
    /// longer exists.
    pub fn is_object_gone(&self) -> bool {
        use kube::runtime::finalizer::Error as F;
        let not_found = |e: &kube::Error| matches!(e, kube::Error::Api(s) if s.code == 404);
        match self {
            Error::UpdateStatus(e) => not_found(e),
            Error::Finalizer(f) => match f.as_ref() {
                F::AddFinalizer(e) | F::RemoveFinalizer(e) => not_found(e),
                F::ApplyFailed(e) | F::CleanupFailed(e) => e.is_object_gone(),
                _ => false,
            },
            _ => false,
        }
    }
}

/// Result of a reconcile step.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Whether the apiserver refused a create for good: a 4xx that admission, a quota, RBAC or a
/// terminating namespace answers, which a retry at once would only repeat; not a conflict (409)
/// or throttling (429), which pass by themselves.
pub fn refused_for_good(status: &kube::core::Status) -> bool {
    (400..500).contains(&status.code) && ![409, 429].contains(&status.code)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::finalizer::Error as F;
    use serde_json::json;

    /// An apiserver error as it arrives on the wire.
    fn api(code: u16, causes: serde_json::Value) -> kube::Error {
        let status = json!({"status": "Failure", "code": code, "reason": "Invalid",
                            "message": "rejected", "details": {"causes": causes}});
        kube::Error::Api(Box::new(serde_json::from_value(status).unwrap()))
    }

    #[test]
    fn a_lost_write_race_is_a_conflict_and_a_real_rejection_is_not() {
        let add = |e| Error::Finalizer(Box::new(F::AddFinalizer(e)));
        assert!(
            add(api(422, json!([]))).is_conflict(),
            "failed JSON patch test"
        );
        assert!(add(api(409, json!([]))).is_conflict());
        let invalid = json!([{"field": "metadata.finalizers", "message": "too many",
                              "reason": "FieldValueInvalid"}]);
        assert!(!add(api(422, invalid)).is_conflict(), "validation error");
        assert!(!add(api(500, json!([]))).is_conflict());
        assert!(Error::UpdateStatus(api(409, json!([]))).is_conflict());
        assert!(!Error::MissingNamespace.is_conflict());
    }

    #[test]
    fn only_a_404_on_the_object_itself_means_it_is_gone() {
        assert!(Error::UpdateStatus(api(404, json!([]))).is_object_gone());
        let apply_failed = |e| Error::Finalizer(Box::new(F::ApplyFailed(e)));
        assert!(apply_failed(Error::UpdateStatus(api(404, json!([])))).is_object_gone());
        assert!(
            Error::Finalizer(Box::new(F::RemoveFinalizer(api(404, json!([]))))).is_object_gone()
        );
        assert!(!Error::UpdateStatus(api(409, json!([]))).is_object_gone());
        // A missing object the reconcile reads or deletes is another object: a real failure.
        let read = Error::Read {
            kind: "Cluster",
            name: "demo".into(),
            source: api(404, json!([])),
        };
        assert!(!read.is_object_gone());
    }
}
