//! Every bootstrap fixture converts, passes upstream `ignition-validate` (alone and with the
//! machine overlay), and matches its snapshot.

mod support;

use capk_bootstrap::{BootstrapFormat, render_ignition, to_json};
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
