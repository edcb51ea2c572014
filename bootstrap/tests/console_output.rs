//! The units that run the bootstrap commands (cloud-config `runcmd`/`bootcmd`, CABPK's Ignition
//! `kubeadm.service`) send their output to the journal only: the serial console is the machine
//! Pod's log, and `kubeadm init` prints `kubeadm join … --token …`. The settings are resolved
//! as systemd resolves them (the unit, then its drop-ins in file-name order, the last assignment
//! wins); launcher/tests/vm_netns.rs boots a guest and checks the console itself.

mod support;

use capk_bootstrap::ignition_v3::{Config, Unit};
use capk_bootstrap::{BOOTCMD_UNIT, BootstrapFormat, RUNCMD_UNIT, render_ignition};
use support::{facts, fixtures, full_overlay};

/// `StandardOutput=` and `StandardError=` of `unit` after its drop-ins, `None` when unset.
fn output_settings(unit: &Unit) -> (Option<String>, Option<String>) {
    let mut dropins: Vec<_> = unit.dropins.iter().flatten().collect();
    dropins.sort_by(|a, b| a.name.cmp(&b.name));
    let texts = unit
        .contents
        .iter()
        .chain(dropins.iter().filter_map(|d| d.contents.as_ref()));
    let (mut out, mut err) = (None, None);
    for text in texts {
        let mut service = false;
        for line in text.lines().map(str::trim) {
            if line.starts_with('[') {
                service = line == "[Service]";
                continue;
            }
            let Some((key, value)) = line.split_once('=') else {
                continue;
            };
            let value = (!value.trim().is_empty()).then(|| value.trim().to_owned());
            match key.trim() {
                "StandardOutput" if service => out = value,
                "StandardError" if service => err = value,
                _ => {}
            }
        }
    }
    (out, err)
}

/// Whether systemd would copy output with this setting to the console (or a TTY, which is the
/// console unless `TTYPath=` says otherwise).
fn reaches_console(setting: &str) -> bool {
    setting == "tty" || setting.ends_with("+console")
}

fn unit<'a>(config: &'a Config, name: &str) -> Option<&'a Unit> {
    config
        .systemd
        .iter()
        .flat_map(|s| s.units.iter().flatten())
        .find(|u| u.name == name)
}

fn rendered(format: BootstrapFormat, data: &[u8]) -> Config {
    render_ignition(format, data, &facts(), Some(&full_overlay()))
        .unwrap_or_else(|e| panic!("{e}"))
        .config
}

/// Every fixture, both formats: the units that run the bootstrap commands name the journal
/// explicitly for both streams (not left to the node image's `DefaultStandardOutput=`), and no
/// generated unit sends anything to the console.
#[test]
fn bootstrap_command_output_goes_to_the_journal_only() {
    let mut command_units = 0;
    for f in fixtures("handmade")
        .into_iter()
        .chain(fixtures("cabpk-templates"))
        .chain(fixtures("cabpk"))
    {
        let config = rendered(f.format, &f.data);
        for u in config.systemd.iter().flat_map(|s| s.units.iter().flatten()) {
            let (out, err) = output_settings(u);
            for s in [&out, &err].into_iter().flatten() {
                assert!(
                    !reaches_console(s),
                    "{}: {} sends output to the console ({s})",
                    f.name,
                    u.name
                );
            }
            if [RUNCMD_UNIT, BOOTCMD_UNIT, "kubeadm.service"].contains(&u.name.as_str()) {
                assert_eq!(
                    (out.as_deref(), err.as_deref()),
                    (Some("journal"), Some("journal")),
                    "{}: {}",
                    f.name,
                    u.name
                );
                command_units += 1;
            }
        }
    }
    assert!(
        command_units >= 12,
        "only {command_units} command units seen"
    );
}

/// A drop-in in CABPK's Ignition (the Flatcar templates add theirs to `kubeadm.service` through
/// `additionalConfig`) that sends kubeadm's output to the console is overridden, and a drop-in
/// that already has capk-bootstrap's name is replaced rather than duplicated.
#[test]
fn kubeadm_unit_output_stays_off_the_console_over_bootstrap_dropins() {
    let unit_text = "[Unit]\nDescription=kubeadm\n[Service]\nType=oneshot\nExecStart=/bin/bash /etc/kubeadm.sh\nStandardOutput=tty\n[Install]\nWantedBy=multi-user.target\n";
    let v23 = serde_json::json!({
        "ignition": {"version": "2.3.0"},
        "systemd": {"units": [
            {"name": "kubeadm.service", "enabled": true, "contents": unit_text},
            {"name": "kubeadm.service", "dropins": [
                {"name": "90-debug.conf", "contents": "[Service]\nStandardOutput=journal+console\nStandardError=kmsg+console\n"}
            ]},
        ]},
    });
    let v34 = serde_json::json!({
        "ignition": {"version": "3.4.0"},
        "systemd": {"units": [
            {"name": "kubeadm.service", "enabled": true, "contents": unit_text, "dropins": [
                {"name": "zz-capk-output-journal-only.conf", "contents": "[Service]\nStandardOutput=tty\n"},
                {"name": "99-debug.conf", "contents": "[Service]\nStandardOutput=journal+console\n"}
            ]},
        ]},
    });
    for (spec, input) in [("2.3", v23), ("3.4", v34)] {
        let config = rendered(BootstrapFormat::Ignition, input.to_string().as_bytes());
        let kubeadm = unit(&config, "kubeadm.service").expect("kubeadm.service");
        assert_eq!(
            output_settings(kubeadm),
            (Some("journal".to_owned()), Some("journal".to_owned())),
            "spec {spec}: {kubeadm:?}"
        );
        let ours = kubeadm
            .dropins
            .iter()
            .flatten()
            .filter(|d| d.name == capk_bootstrap::systemd::JOURNAL_ONLY_DROPIN)
            .count();
        assert_eq!(ours, 1, "spec {spec}: {kubeadm:?}");
    }
}

/// A masked `kubeadm.service` stays as it is (a drop-in for a masked unit would be noise).
#[test]
fn a_masked_kubeadm_unit_gets_no_dropin() {
    let input = r#"{"ignition":{"version":"3.4.0"},"systemd":{"units":[{"name":"kubeadm.service","mask":true}]}}"#;
    let config = rendered(BootstrapFormat::Ignition, input.as_bytes());
    let kubeadm = unit(&config, "kubeadm.service").expect("kubeadm.service");
    assert_eq!(kubeadm.dropins, None);
}
