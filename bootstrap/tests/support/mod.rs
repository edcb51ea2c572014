//! Shared test helpers: fixtures, the upstream `ignition-validate` binary, a readable view.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use capk_bootstrap::overlay::{DataDisk, Dns, EtcdDisk, FsFormat, Heartbeat, HostVolume};
use capk_bootstrap::{BootstrapFormat, MachineFacts, MachineOverlay};

pub fn crate_dir() -> PathBuf {
    package_dir()
}

/// A fixture file: bootstrap data plus the format its name declares.
pub struct Fixture {
    pub name: String,
    pub format: BootstrapFormat,
    pub data: Vec<u8>,
}

/// Every fixture under `tests/fixtures/<dir>`: `*.cloud-config` and `*.ignition*.json`, or a
/// CABPK bootstrap Secret dump `*.secret.json` (`{"format": …, "value": …}`).
pub fn fixtures(dir: &str) -> Vec<Fixture> {
    let root = crate_dir().join("tests/fixtures").join(dir);
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(&root) else {
        return out;
    };
    let mut paths: Vec<PathBuf> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    paths.sort();
    for p in paths {
        let file = p.file_name().unwrap().to_string_lossy().into_owned();
        let data = std::fs::read(&p).unwrap();
        let (format, data) = if file.ends_with(".secret.json") {
            let v: serde_json::Value = serde_json::from_slice(&data).unwrap();
            let format = BootstrapFormat::from_secret(v["format"].as_str()).unwrap();
            (format, v["value"].as_str().unwrap().as_bytes().to_vec())
        } else if file.ends_with(".cloud-config") {
            (BootstrapFormat::CloudConfig, data)
        } else if file.contains(".ignition") && file.ends_with(".json") {
            (BootstrapFormat::Ignition, data)
        } else {
            continue;
        };
        out.push(Fixture {
            name: format!("{dir}__{file}"),
            format,
            data,
        });
    }
    out
}

pub fn facts() -> MachineFacts {
    MachineFacts {
        hostname: "capk-md-0-abcde".to_owned(),
        instance_id: "i-0a1b2c3d".to_owned(),
    }
}

/// An overlay using every feature.
pub fn full_overlay() -> MachineOverlay {
    MachineOverlay {
        hostname: "capk-md-0-abcde".to_owned(),
        dns: Some(Dns {
            servers: vec!["10.96.0.10".parse().unwrap(), "fd00::a".parse().unwrap()],
            search: vec!["cluster.local".to_owned()],
        }),
        ntp_servers: vec!["169.254.169.123".to_owned()],
        iscsi_initiator_name: Some("iqn.2016-04.com.coreos.iscsi:capk-abcde-worker-0".to_owned()),
        data_disks: vec![
            DataDisk {
                serial: "containerd".to_owned(),
                format: FsFormat::Xfs,
                mount_path: "/var/lib/containerd".to_owned(),
                label: Some("containerd".to_owned()),
                wipe: true,
            },
            DataDisk {
                serial: "kubelet".to_owned(),
                format: FsFormat::Ext4,
                mount_path: "/var/lib/kubelet".to_owned(),
                label: None,
                wipe: true,
            },
        ],
        etcd_disk: Some(EtcdDisk {
            serial: "etcd".to_owned(),
            format: FsFormat::Ext4,
        }),
        host_volumes: vec![HostVolume {
            tag: "shared".to_owned(),
            mount_path: None,
            read_only: true,
        }],
        heartbeat: Some(Heartbeat {
            port_name: "org.capk.heartbeat".to_owned(),
            interval_seconds: 10,
        }),
    }
}

/// Path of upstream `ignition-validate`, or `None` (outside CI) when it is not built.
/// Under `CI` a missing binary fails the test, naming the command that builds it.
pub fn ignition_validate() -> Option<PathBuf> {
    let path = std::env::var_os("CAPK_IGNITION_VALIDATE")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate_dir().join("../_output/bin/ignition-validate"));
    if path.is_file() {
        return Some(path);
    }
    let msg = format!(
        "upstream ignition-validate not found at {}; build it with `make test-deps` \
         (or `bash hack/build-ignition-validate.sh`)",
        path.display()
    );
    if std::env::var_os("CI").is_some() {
        panic!("{msg}");
    }
    eprintln!("SKIPPING ignition-validate check: {msg}");
    None
}

/// Runs `json` through upstream `ignition-validate`; errors fail, and so do warnings unless
/// `allow_warnings` (for configs translated from inputs that carry the warning themselves).
pub fn validate(bin: &Path, name: &str, json: &[u8], allow_warnings: bool) {
    let mut child = Command::new(bin)
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ignition-validate");
    child.stdin.take().unwrap().write_all(json).unwrap();
    let out = child.wait_with_output().unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if allow_warnings && out.status.success() && !report.trim().is_empty() {
        eprintln!("ignition-validate warnings for {name} (inherited from the input):\n{report}");
    }
    assert!(
        out.status.success() && (allow_warnings || report.trim().is_empty()),
        "ignition-validate rejected {name} ({}):\n{report}\nconfig: {}",
        out.status,
        String::from_utf8_lossy(json)
    );
}

/// The config as a value with every `data:` URL decoded, so snapshots show file contents.
pub fn readable(json: &[u8]) -> serde_json::Value {
    fn walk(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(map) => {
                if let Some(serde_json::Value::String(src)) = map.get("source")
                    && src.starts_with("data:")
                {
                    let url = data_url::DataUrl::process(src).expect("valid data URL");
                    let (body, _) = url.decode_to_vec().expect("decodable data URL");
                    let gz = map.get("compression").and_then(|c| c.as_str()) == Some("gzip");
                    let shown = if gz {
                        let out = capk_bootstrap::content::gunzip(&body).expect("valid gzip");
                        format!("(gzip) {}", String::from_utf8_lossy(&out))
                    } else {
                        match String::from_utf8(body.clone()) {
                            Ok(s) => s,
                            Err(_) => format!("(binary, {} bytes)", body.len()),
                        }
                    };
                    map.insert("source".into(), serde_json::Value::String(shown));
                }
                map.values_mut().for_each(walk);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    let mut v: serde_json::Value = serde_json::from_slice(json).unwrap();
    walk(&mut v);
    v
}

/// This package's directory: Cargo's `CARGO_MANIFEST_DIR` of this test run, falling back to the
/// one it was compiled with. Checkouts share Cargo's build cache (`$CAPK_CACHE/target`), so a
/// binary Cargo finds fresh may have been compiled in another checkout.
fn package_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| env!("CARGO_MANIFEST_DIR").into(), Into::into)
}
