//! `capk-controller render-ignition`: bootstrap data on stdin, Ignition v3 on stdout.

use std::{
    io::Write,
    process::{Command, Stdio},
};

fn render(args: &[&str], input: &[u8]) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_capk-controller"))
        .arg("render-ignition")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start capk-controller");
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn renders_cloud_config_with_the_hostname_substituted() {
    let input = b"## template: jinja\n#cloud-config\nwrite_files:\n- path: /etc/node-name\n  content: \"{{ ds.meta_data.hostname }}\"\nruncmd:\n- echo hello\n";
    let (ok, stdout, stderr) = render(&["--hostname", "demo-cp-0"], input);
    assert!(ok, "render-ignition failed: {stderr}");
    let config: serde_json::Value = serde_json::from_str(&stdout).expect("JSON on stdout");
    assert_eq!(config["ignition"]["version"], "3.4.0");
    let files = config["storage"]["files"].as_array().expect("files");
    let node_name = files
        .iter()
        .find(|f| f["path"] == "/etc/node-name")
        .expect("/etc/node-name written");
    let source = node_name["contents"]["source"].as_str().unwrap();
    assert!(
        source.contains("demo-cp-0"),
        "hostname not substituted: {source}"
    );
}

#[test]
fn unsupported_input_fails_with_the_key_named() {
    let (ok, _, stderr) = render(&["--hostname", "n"], b"#cloud-config\nfrobnicate: true\n");
    assert!(!ok);
    assert!(
        stderr.contains("bootcmd"),
        "error does not name the key: {stderr}"
    );
}
