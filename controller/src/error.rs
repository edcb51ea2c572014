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

/// Result of a reconcile step.
pub type Result<T, E = Error> = std::result::Result<T, E>;
