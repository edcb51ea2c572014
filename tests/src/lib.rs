//! Test support for cluster-api-provider-kvm.
