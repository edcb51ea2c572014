//! A whole bootstrap Secret as the controller reads it (`{"format": …, "value": …}`, the layout
//! of tests/fixtures/cabpk/*.secret.json), rendered with a machine overlay that uses every
//! feature: conversion and merge return Ok or an error, never panic, and what renders is JSON.
#![no_main]

use capk_bootstrap::overlay::{DataDisk, Dns, EtcdDisk, FsFormat, Heartbeat, HostVolume};
use capk_bootstrap::{BootstrapFormat, MachineFacts, MachineOverlay, render_ignition};
use libfuzzer_sys::fuzz_target;

fn overlay() -> MachineOverlay {
    MachineOverlay {
        hostname: "fuzz-node".into(),
        dns: Some(Dns {
            servers: vec!["10.96.0.10".parse().unwrap()],
            search: vec!["cluster.local".into()],
        }),
        ntp_servers: vec!["169.254.169.123".into()],
        iscsi_initiator_name: Some("iqn.2016-04.com.coreos.iscsi:fuzz".into()),
        data_disks: vec![DataDisk {
            serial: "containerd".into(),
            format: FsFormat::Xfs,
            mount_path: "/var/lib/containerd".into(),
            label: Some("containerd".into()),
            wipe: true,
        }],
        etcd_disk: Some(EtcdDisk {
            serial: "etcd".into(),
            format: FsFormat::Ext4,
        }),
        host_volumes: vec![HostVolume {
            tag: "shared".into(),
            mount_path: None,
            read_only: true,
        }],
        heartbeat: Some(Heartbeat {
            port_name: "org.capk.heartbeat".into(),
            interval_seconds: 10,
        }),
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(secret) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let Ok(format) = BootstrapFormat::from_secret(secret["format"].as_str()) else {
        return;
    };
    let Some(value) = secret["value"].as_str() else {
        return;
    };
    let facts = MachineFacts {
        hostname: "fuzz-node".into(),
        instance_id: "i-fuzz".into(),
    };
    if let Ok(r) = render_ignition(format, value.as_bytes(), &facts, Some(&overlay())) {
        serde_json::from_slice::<serde_json::Value>(&r.json).expect("rendered config is JSON");
    }
});
