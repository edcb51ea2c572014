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
    /// The object lacks a namespace (our kinds are namespaced; this is a bug).
    #[error("object has no namespace")]
    MissingNamespace,
}

impl Error {
    /// Short category for metrics and Event reasons.
    pub fn category(&self) -> &'static str {
        match self {
            Error::Read { .. } => "ReadFailed",
            Error::Apply { .. } => "ApplyFailed",
            Error::Delete { .. } => "DeleteFailed",
            Error::UpdateStatus(_) => "StatusUpdateFailed",
            Error::Finalizer(_) => "FinalizerFailed",
            Error::PodStillTerminating(_) => "WaitingForPodDeletion",
            Error::MissingNamespace => "InvalidObject",
        }
    }
}

impl Error {
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

/// Result of a reconcile step.
pub type Result<T, E = Error> = std::result::Result<T, E>;

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
}
