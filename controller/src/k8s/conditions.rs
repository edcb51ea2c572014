//! `metav1.Condition` bookkeeping: set a condition, keeping its transition time when the status
//! does not change, so that an unchanged world produces an unchanged status (and no write).

use std::borrow::Cow;

use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};

/// A condition's desired value, without timestamps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredCondition {
    /// Condition type, e.g. `Ready`.
    pub type_: &'static str,
    /// `True`, `False` or `Unknown`.
    pub status: bool,
    /// CamelCase reason.
    pub reason: Cow<'static, str>,
    /// Human-readable message.
    pub message: String,
}

impl DesiredCondition {
    /// A condition that holds.
    pub fn truthy(
        type_: &'static str,
        reason: impl Into<Cow<'static, str>>,
        message: impl Into<String>,
    ) -> Self {
        Self::with_status(type_, true, reason, message)
    }

    /// A condition that does not hold.
    pub fn falsy(
        type_: &'static str,
        reason: impl Into<Cow<'static, str>>,
        message: impl Into<String>,
    ) -> Self {
        Self::with_status(type_, false, reason, message)
    }

    /// A condition with the given status.
    fn with_status(
        type_: &'static str,
        status: bool,
        reason: impl Into<Cow<'static, str>>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            type_,
            status,
            reason: reason.into(),
            message: message.into(),
        }
    }
}

/// Merges desired conditions into the current ones. Conditions not mentioned are kept.
pub fn merge(
    current: &[Condition],
    desired: &[DesiredCondition],
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    let mut out: Vec<Condition> = current.to_vec();
    for d in desired {
        let status = if d.status { "True" } else { "False" }.to_owned();
        let existing = out.iter_mut().find(|c| c.type_ == d.type_);
        match existing {
            Some(c) => {
                if c.status != status {
                    c.last_transition_time = Time(now);
                }
                c.status = status;
                c.reason = d.reason.to_string();
                c.message = d.message.clone();
                c.observed_generation = generation;
            }
            None => out.push(Condition {
                type_: d.type_.to_owned(),
                status,
                reason: d.reason.to_string(),
                message: d.message.clone(),
                observed_generation: generation,
                last_transition_time: Time(now),
            }),
        }
    }
    out.sort_by(|a, b| a.type_.cmp(&b.type_));
    out
}

/// Looks up a condition by type.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_transition_time_while_status_holds() {
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let t1: Timestamp = "2026-01-01T00:05:00Z".parse().unwrap();
        let first = merge(
            &[],
            &[DesiredCondition::falsy("Ready", "Waiting", "a")],
            Some(1),
            t0,
        );
        let same = merge(
            &first,
            &[DesiredCondition::falsy("Ready", "StillWaiting", "b")],
            Some(1),
            t1,
        );
        assert_eq!(same[0].last_transition_time, Time(t0));
        assert_eq!(same[0].reason, "StillWaiting");
        let flipped = merge(
            &same,
            &[DesiredCondition::truthy("Ready", "Provisioned", "")],
            Some(2),
            t1,
        );
        assert_eq!(flipped[0].last_transition_time, Time(t1));
        assert_eq!(flipped[0].status, "True");
        assert_eq!(flipped[0].observed_generation, Some(2));
    }
}
