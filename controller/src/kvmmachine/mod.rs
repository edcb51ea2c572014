//! KVMMachine: the machine Pod and its Ignition Secret. The pure builders are in [`build`].

pub mod build;
