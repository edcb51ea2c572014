//! Every bootstrap fixture converts, passes upstream `ignition-validate` (alone and with the
//! machine overlay), and matches its snapshot.

mod support;

use capk_bootstrap::{BootstrapFormat, RUN_STAGING_DIR, SUCCESS_FILE, render_ignition, to_json};
use support::{facts, fixtures, full_overlay, ignition_validate, readable, validate};

#[test]
fn handmade_fixtures_convert_validate_and_match_snapshots() {
    let all = fixtures("handmade");
    assert!(all.len() >= 7, "handmade fixtures missing: {}", all.len());
    check_and_snapshot(all);
}

/// Output of CABPK's own template functions: a stand-in kept for the launcher's VM tests (see
/// tests/fixtures/cabpk-templates/README.md); the real controller's output is tested below.
#[test]
fn cabpk_template_fixtures_convert_validate_and_match_snapshots() {
    let all = fixtures("cabpk-templates");
    assert_eq!(all.len(), 6, "cabpk-templates fixtures missing");
    check_and_snapshot(all);
}

fn check_and_snapshot(all: Vec<support::Fixture>) {
    let validator = ignition_validate();
    for f in all {
        let plain = render_ignition(f.format, &f.data, &facts(), None)
            .unwrap_or_else(|e| panic!("{}: {e}", f.name));
        let with_overlay = render_ignition(f.format, &f.data, &facts(), Some(&full_overlay()))
            .unwrap_or_else(|e| panic!("{} with overlay: {e}", f.name));
        if let Some(bin) = &validator {
            let inherited = f.format == BootstrapFormat::Ignition;
            validate(bin, &f.name, &plain.json, inherited);
            validate(
                bin,
                &format!("{} with overlay", f.name),
                &with_overlay.json,
                inherited,
            );
        }
        insta::assert_yaml_snapshot!(f.name.clone(), readable(&plain.json));
        // Only the overlay's own entries are replaced, never silently anything else.
        insta::assert_yaml_snapshot!(
            format!("{}__merge_report", f.name),
            format!("{:?}", with_overlay.merge)
        );
    }
}

/// Secrets written by the real CABPK controller of the pinned Cluster API release
/// (tests/fixtures/cabpk/regenerate.sh): cloud-config and ignition, each for control-plane init,
/// control-plane join and worker join.
#[test]
fn cabpk_fixtures_convert_validate_and_match_snapshots() {
    let all = fixtures("cabpk");
    let names: Vec<&str> = all.iter().map(|f| f.name.as_str()).collect();
    for format in ["cloud-config", "ignition"] {
        for role in ["control-plane-init", "control-plane-join", "worker-join"] {
            let want = format!("cabpk__{format}-{role}.secret.json");
            assert!(
                names.contains(&want.as_str()),
                "missing CABPK fixture {want} (have {names:?}); run tests/fixtures/cabpk/regenerate.sh"
            );
        }
    }
    check_and_snapshot(all);
}

/// The real CABPK output with the full machine overlay merged, as the controller stores it.
#[test]
fn cabpk_fixtures_with_overlay_match_snapshots() {
    for f in fixtures("cabpk") {
        let r = render_ignition(f.format, &f.data, &facts(), Some(&full_overlay()))
            .unwrap_or_else(|e| panic!("{}: {e}", f.name));
        insta::assert_yaml_snapshot!(format!("{}__with_overlay", f.name), readable(&r.json));
    }
}

/// What CABPK put in each real Secret survives conversion: every file it writes (files bound for
/// the /run tmpfs via the staging directory; Ignition file contents byte for byte), every user,
/// no Jinja placeholder left in cloud-config, and the kubeadm command line with the success file
/// in the commands that run at boot.
#[test]
fn cabpk_fixtures_keep_every_file_user_and_command() {
    let all = fixtures("cabpk");
    assert!(!all.is_empty(), "no CABPK fixtures");
    for f in all {
        let text = String::from_utf8(f.data.clone()).unwrap();
        let r = render_ignition(f.format, &f.data, &facts(), None)
            .unwrap_or_else(|e| panic!("{}: {e}", f.name));
        let out = readable(&r.json);
        let shown = serde_json::to_string(&out).unwrap();
        if f.format == BootstrapFormat::CloudConfig {
            // cloud-config is a Jinja template (CABPK's header says so): all of it is rendered.
            for placeholder in ["{{ ds.", "{{ v1.", "{{ds.", "{{v1."] {
                assert!(
                    !shown.contains(placeholder),
                    "{}: {placeholder} left",
                    f.name
                );
            }
            assert!(
                shown.contains(&facts().hostname),
                "{}: hostname missing",
                f.name
            );
        } else {
            // Ignition data is not a template: every file's content arrives byte for byte.
            let input = readable(&f.data);
            for file in input["storage"]["files"].as_array().unwrap() {
                let translated = out["storage"]["files"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|o| o["path"] == file["path"])
                    .unwrap_or_else(|| panic!("{}: {} lost", f.name, file["path"]));
                assert_eq!(
                    translated["contents"]["source"], file["contents"]["source"],
                    "{}: content of {}",
                    f.name, file["path"]
                );
            }
        }

        let (paths, users, kubeadm_script) = match f.format {
            BootstrapFormat::CloudConfig => {
                let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
                let paths: Vec<String> = doc["write_files"]
                    .as_sequence()
                    .unwrap()
                    .iter()
                    .map(|w| w["path"].as_str().unwrap().to_owned())
                    .collect();
                let users: Vec<String> = doc["users"]
                    .as_sequence()
                    .map(|u| {
                        u.iter()
                            .map(|u| u["name"].as_str().unwrap().to_owned())
                            .collect()
                    })
                    .unwrap_or_default();
                (paths, users, "/etc/capk/bootstrap/runcmd.sh")
            }
            BootstrapFormat::Ignition => {
                let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
                let paths: Vec<String> = doc["storage"]["files"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|w| w["path"].as_str().unwrap().to_owned())
                    .collect();
                let users: Vec<String> = doc["passwd"]["users"]
                    .as_array()
                    .map(|u| {
                        u.iter()
                            .map(|u| u["name"].as_str().unwrap().to_owned())
                            .collect()
                    })
                    .unwrap_or_default();
                (paths, users, "/etc/kubeadm.sh")
            }
        };
        let files = out["storage"]["files"].as_array().unwrap();
        let has = |p: &str| files.iter().any(|x| x["path"] == p);
        for p in &paths {
            let staged = format!("{RUN_STAGING_DIR}{p}");
            assert!(has(p) || has(&staged), "{}: file {p} lost", f.name);
        }
        let out_users: Vec<&str> = out["passwd"]["users"]
            .as_array()
            .map(|u| u.iter().map(|u| u["name"].as_str().unwrap()).collect())
            .unwrap_or_default();
        for u in &users {
            assert!(out_users.contains(&u.as_str()), "{}: user {u} lost", f.name);
        }
        let script = files
            .iter()
            .find(|x| x["path"] == kubeadm_script)
            .unwrap_or_else(|| panic!("{}: no {kubeadm_script}", f.name))["contents"]["source"]
            .as_str()
            .unwrap();
        let kubeadm = script
            .lines()
            .find(|l| l.contains("kubeadm init") || l.contains("kubeadm join"))
            .unwrap_or_else(|| panic!("{}: no kubeadm command in {script}", f.name));
        let role_cmd = if f.name.contains("-init") {
            "kubeadm init"
        } else {
            "kubeadm join"
        };
        assert!(kubeadm.contains(role_cmd), "{}: {kubeadm}", f.name);
        assert!(script.contains(SUCCESS_FILE), "{}: no success file", f.name);
    }
}

#[test]
fn overlay_fragment_alone_validates() {
    let fragment = full_overlay().fragment().unwrap();
    let json = to_json(&fragment).unwrap();
    if let Some(bin) = ignition_validate() {
        validate(&bin, "overlay fragment", &json, false);
    }
    insta::assert_yaml_snapshot!("overlay_fragment", readable(&json));
}

#[test]
fn every_3x_spec_up_to_3_5_is_reemitted_as_3_4() {
    for v in ["3.0.0", "3.1.0", "3.2.0", "3.3.0", "3.4.0", "3.5.0"] {
        let input = format!(
            r#"{{"ignition":{{"version":"{v}"}},"storage":{{"files":[{{"path":"/etc/x","contents":{{"source":"data:,x"}}}}]}}}}"#
        );
        let r = render_ignition(BootstrapFormat::Ignition, input.as_bytes(), &facts(), None)
            .unwrap_or_else(|e| panic!("{v}: {e}"));
        assert_eq!(
            String::from_utf8(r.json).unwrap(),
            r#"{"ignition":{"version":"3.4.0"},"storage":{"files":[{"contents":{"source":"data:,x"},"path":"/etc/x"}]}}"#,
            "spec {v}"
        );
    }
}
