//! Converts Cluster API bootstrap data (CABPK `cloud-config` or Ignition 2.3) into the Ignition v3
//! config a Flatcar guest boots from. Pure functions over bytes and values; no Kubernetes client.
#![forbid(unsafe_code)]
