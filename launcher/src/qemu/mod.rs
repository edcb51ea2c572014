//! QEMU: the argv planner and the QMP client.

pub mod argv;
pub mod privilege;
pub mod qmp;
