//! The KVM provider API.
#![forbid(unsafe_code)]
