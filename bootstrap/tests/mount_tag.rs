//! The overlay admits exactly the mount tags the CRD and the launcher admit (capk-api's rule):
//! before, `a.b` passed here and in the CRD, and the launcher refused it.

use capk_bootstrap::MachineOverlay;
use capk_bootstrap::overlay::HostVolume;

#[test]
fn overlay_takes_exactly_the_shared_mount_tag_rule() {
    for tag in capk_api::mount_tag::EXAMPLES {
        let overlay = MachineOverlay {
            hostname: "node-1".into(),
            host_volumes: vec![HostVolume {
                tag: (*tag).into(),
                mount_path: None,
                read_only: false,
            }],
            ..Default::default()
        };
        let got = overlay.fragment();
        match capk_api::mount_tag::check(tag) {
            Ok(()) => assert!(got.is_ok(), "{tag:?}: {:?}", got.err()),
            Err(_) => {
                let e = got.expect_err(tag).to_string();
                assert_eq!(
                    e,
                    format!(
                        "invalid machine 9p mount tag `{tag}`: must be {}",
                        capk_api::mount_tag::RULE
                    )
                );
            }
        }
    }
}
