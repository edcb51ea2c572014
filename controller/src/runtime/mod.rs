//! The reconcile runtime both reconcilers share: what every reconcile gets ([`context`]), how a
//! step fails ([`error`]), when a failed reconcile runs again ([`backoff`]) and what is done with
//! its outcome ([`outcome`]: metrics, log lines, Events, the wait before the next one).

pub mod backoff;
pub mod context;
pub mod error;
pub mod outcome;
