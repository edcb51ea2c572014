//! The management cluster's objects as the reconcilers see them: the watch caches they read
//! ([`caches`]), the verbs they write with ([`objects`]), conditions ([`conditions`]), whose an
//! object is and which Cluster it belongs to ([`ownership`]), and how one watch wakes another
//! kind's reconciles ([`wake`]).

pub mod caches;
pub mod conditions;
pub mod objects;
pub mod ownership;
pub mod wake;
