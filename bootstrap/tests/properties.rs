//! Property tests for the encoders and decoders: what goes in comes out of the guest's side.

use std::io::Write;
use std::process::{Command, Stdio};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use capk_bootstrap::content::{data_url, decode_write_file, gunzip};
use capk_bootstrap::heartbeat::{BootstrapState, HeartbeatLine};
use capk_bootstrap::systemd::{escape_path, shell_quote, unescape_path};
use capk_bootstrap::{BootstrapFormat, MachineFacts, convert, to_json};
use proptest::prelude::*;

fn decode_data_url(url: &str) -> Vec<u8> {
    data_url::DataUrl::process(url)
        .expect("valid data URL")
        .decode_to_vec()
        .expect("decodable")
        .0
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// Base64 wrapped at `width` columns, as YAML block scalars usually carry it.
fn wrapped_base64(bytes: &[u8], width: usize) -> String {
    let b = STANDARD.encode(bytes);
    b.as_bytes()
        .chunks(width.max(4))
        .map(|c| std::str::from_utf8(c).unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

proptest! {
    #[test]
    fn data_urls_decode_to_the_original_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        prop_assert_eq!(decode_data_url(&data_url(&bytes)), bytes);
    }

    #[test]
    fn data_urls_of_text_decode_to_the_text(text in "\\PC*") {
        prop_assert_eq!(decode_data_url(&data_url(text.as_bytes())), text.as_bytes());
    }

    #[test]
    fn base64_content_decodes(bytes in proptest::collection::vec(any::<u8>(), 0..512), width in 4usize..100) {
        for enc in ["b64", "base64"] {
            let got = decode_write_file(Some(enc), wrapped_base64(&bytes, width).as_bytes()).unwrap();
            prop_assert!(!got.gzip);
            prop_assert_eq!(&got.bytes, &bytes);
        }
    }

    #[test]
    fn gzip_base64_content_stays_compressed_and_inflates(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        for enc in ["gz+b64", "gzip+base64", "gz+base64", "gzip+b64"] {
            let got = decode_write_file(Some(enc), wrapped_base64(&gzip(&bytes), 76).as_bytes()).unwrap();
            prop_assert!(got.gzip);
            prop_assert_eq!(gunzip(&got.bytes).unwrap(), bytes.clone());
        }
    }

    #[test]
    fn raw_gzip_content_is_kept(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let gz = gzip(&bytes);
        let got = decode_write_file(Some("gzip"), &gz).unwrap();
        prop_assert_eq!(got.bytes, gz);
    }

    /// End to end: a write_files entry in any encoding arrives in the Ignition config with the
    /// same bytes after the guest decodes the data URL (and gunzips).
    #[test]
    fn write_files_round_trip_through_conversion(
        text in "[ -~\n\t]{0,300}",
        enc in prop::sample::select(vec!["", "b64", "gzip+base64"]),
    ) {
        let content = match enc {
            "" => text.clone(),
            "b64" => STANDARD.encode(text.as_bytes()),
            _ => STANDARD.encode(gzip(text.as_bytes())),
        };
        // A JSON string is a valid YAML double-quoted scalar.
        let yaml = format!(
            "#cloud-config\nwrite_files:\n- path: /etc/x\n  encoding: '{}'\n  content: {}\n",
            if enc.is_empty() { "text/plain" } else { enc },
            serde_json::to_string(&content).unwrap()
        );
        let cfg = convert(BootstrapFormat::CloudConfig, yaml.as_bytes(), &MachineFacts::new("n")).unwrap();
        let json: serde_json::Value = serde_json::from_slice(&to_json(&cfg).unwrap()).unwrap();
        let file = &json["storage"]["files"][0]["contents"];
        let mut bytes = decode_data_url(file["source"].as_str().unwrap());
        if file["compression"] == "gzip" {
            bytes = gunzip(&bytes).unwrap();
        }
        prop_assert_eq!(bytes, text.as_bytes());
    }

    #[test]
    fn systemd_path_escaping_round_trips(parts in proptest::collection::vec("[^/\u{0}]{1,12}", 1..5)) {
        prop_assume!(parts.iter().all(|p| p != "." && p != ".."));
        let path = format!("/{}", parts.join("/"));
        let escaped = escape_path(&path).unwrap();
        prop_assert!(escaped.bytes().all(|b| b.is_ascii_alphanumeric() || b":_.\\-".contains(&b)), "{}", escaped);
        prop_assert!(!escaped.starts_with('.'));
        prop_assert_eq!(unescape_path(&escaped).unwrap(), path);
    }

    #[test]
    fn heartbeat_lines_round_trip(done in any::<bool>(), uptime in 0.0f64..1e9) {
        let line = HeartbeatLine {
            bootstrap: if done { BootstrapState::Done } else { BootstrapState::Pending },
            uptime_seconds: uptime,
        };
        prop_assert_eq!(line.to_string().parse::<HeartbeatLine>().unwrap(), line);
    }

    #[test]
    fn heartbeat_parser_never_panics(s in "\\PC{0,80}") {
        let _ = s.parse::<HeartbeatLine>();
    }

    /// Spec 2.3 → 3.4: a file's bytes (percent-encoded or base64 data URL), decimal mode, owner
    /// and append flag arrive unchanged in the spec-3 config.
    #[test]
    fn ignition_2_3_files_translate_byte_for_byte(
        bytes in proptest::collection::vec(any::<u8>(), 0..400),
        base64_url in any::<bool>(),
        mode in 0u32..=0o7777,
        append in any::<bool>(),
    ) {
        let source = if base64_url {
            format!("data:;base64,{}", STANDARD.encode(&bytes))
        } else {
            data_url(&bytes)
        };
        let file = serde_json::json!({
            "filesystem": "root", "path": "/etc/capk/p", "mode": mode, "append": append,
            "user": {"name": "core"}, "contents": {"source": source, "verification": {}},
        });
        let input = serde_json::json!({"ignition": {"version": "2.3.0"}, "storage": {"files": [file]}});
        let cfg = convert(BootstrapFormat::Ignition, input.to_string().as_bytes(), &MachineFacts::new("n")).unwrap();
        let out: serde_json::Value = serde_json::from_slice(&to_json(&cfg).unwrap()).unwrap();
        let f = &out["storage"]["files"][0];
        prop_assert_eq!(&f["path"], "/etc/capk/p");
        prop_assert_eq!(f["mode"].as_u64(), Some(u64::from(mode)));
        prop_assert_eq!(&f["user"]["name"], "core");
        let src = if append {
            prop_assert!(f["contents"].is_null());
            f["append"][0]["source"].as_str().unwrap()
        } else {
            prop_assert_eq!(&f["overwrite"], true);
            f["contents"]["source"].as_str().unwrap()
        };
        prop_assert_eq!(decode_data_url(src), bytes);
    }

    /// The cloud-init Jinja placeholders CABPK templates use become the machine's values, in
    /// files and commands alike, and nothing else in the text changes.
    #[test]
    fn jinja_placeholders_become_the_machine_facts(
        host in "[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?",
        id in "[a-zA-Z0-9-]{1,20}",
        filler in "[ -z|~]{0,40}",
    ) {
        prop_assume!(!filler.contains("{{") && !filler.contains("{%") && !filler.contains("{#"));
        let yaml = format!(
            "## template: jinja\n#cloud-config\nwrite_files:\n- path: /etc/facts\n  content: {}\nruncmd:\n- echo {{{{ v1.local_hostname }}}}\n",
            serde_json::to_string(&format!(
                "{filler}|{{{{ ds.meta_data.hostname }}}}|{{{{ds.meta_data.local_hostname}}}}|{{{{ v1.local_hostname }}}}|{{{{ ds.meta_data.instance_id }}}}|{{{{ v1.instance_id }}}}"
            )).unwrap()
        );
        let facts = MachineFacts { hostname: host.clone(), instance_id: id.clone() };
        let cfg = convert(BootstrapFormat::CloudConfig, yaml.as_bytes(), &facts).unwrap();
        let out: serde_json::Value = serde_json::from_slice(&to_json(&cfg).unwrap()).unwrap();
        let files = out["storage"]["files"].as_array().unwrap();
        let text = |p: &str| {
            let f = files.iter().find(|f| f["path"] == p).unwrap();
            String::from_utf8(decode_data_url(f["contents"]["source"].as_str().unwrap())).unwrap()
        };
        prop_assert_eq!(text("/etc/facts"), format!("{filler}|{host}|{host}|{host}|{id}|{id}"));
        let echo = format!("\necho {host}\n");
        prop_assert!(text("/etc/capk/bootstrap/runcmd.sh").contains(&echo));
    }

    /// No input makes the converter panic (a cheap stand-in for the fuzz targets in CI).
    #[test]
    fn conversion_never_panics(body in "\\PC{0,200}") {
        let facts = MachineFacts::new("n");
        let _ = convert(BootstrapFormat::CloudConfig, format!("#cloud-config\n{body}").as_bytes(), &facts);
        let _ = convert(BootstrapFormat::Ignition, body.as_bytes(), &facts);
        let _ = convert(BootstrapFormat::Ignition, format!("{{\"ignition\":{{\"version\":\"2.3.0\"}},{body}").as_bytes(), &facts);
    }
}

/// The quoting is checked by a real shell: each argument comes back unchanged.
#[test]
fn shell_quoting_survives_a_real_shell() {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 64,
        ..ProptestConfig::default()
    });
    runner
        .run(&proptest::collection::vec("[^\u{0}]{0,20}", 1..4), |args| {
            let line = std::iter::once("printf '%s\\0'".to_owned())
                .chain(args.iter().map(|a| shell_quote(a)))
                .collect::<Vec<_>>()
                .join(" ");
            let mut child = Command::new("bash")
                .arg("-s")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .expect("bash");
            child
                .stdin
                .take()
                .unwrap()
                .write_all(line.as_bytes())
                .unwrap();
            let out = child.wait_with_output().unwrap();
            let got: Vec<String> = String::from_utf8(out.stdout)
                .unwrap()
                .split_terminator('\0')
                .map(str::to_owned)
                .collect();
            prop_assert_eq!(got, args);
            Ok(())
        })
        .unwrap();
}

/// Our escaping agrees with systemd's own `systemd-escape --path`.
#[test]
fn path_escaping_matches_systemd_escape() {
    let Ok(probe) = Command::new("systemd-escape").arg("--version").output() else {
        if std::env::var_os("CI").is_some() {
            panic!("systemd-escape not found; install Debian package `systemd`");
        }
        eprintln!("SKIPPING: systemd-escape not found (Debian package `systemd`)");
        return;
    };
    assert!(probe.status.success());
    for path in [
        "/var/lib/etcd",
        "/data/my-vol",
        "/var/lib/etcddisk",
        "/.hidden/x",
        "/a b/c:d/e_f/ü",
        "/x\\y",
        "//double//slash/",
    ] {
        let out = Command::new("systemd-escape")
            .args(["--path", path])
            .output()
            .unwrap();
        let want = String::from_utf8(out.stdout).unwrap().trim().to_owned();
        assert_eq!(escape_path(path).unwrap(), want, "path {path:?}");
    }
}
