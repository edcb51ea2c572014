//! `capk-launcher` library: PID 1 of a machine Pod. Each side-effecting area has a pure plan
//! and a thin apply step: `net`, `disk`, `qemu` (argv + QMP), `health`, `supervise`.
#![deny(unsafe_code)]

pub mod accel;
pub mod apiserver;
pub mod cli;
pub mod console;
pub mod control;
pub mod disk;
pub mod etcd_dir;
pub mod health;
pub mod host_volume;
pub mod ignition;
pub mod image_cache;
pub mod line;
pub mod net;
pub mod qcow2;
pub mod qemu;
pub mod run;
pub mod supervise;

#[cfg(test)]
pub(crate) mod testsupport;
