//! The checked-in CRDs in manifests/crd must be exactly what the Rust types generate.

#[test]
fn checked_in_crds_match_the_rust_types() {
    let dir = package_dir().join("../manifests/crd");
    let mut expected_files = Vec::new();
    for crd in capk_api::crd::crds() {
        let name = capk_api::crd::file_name(&crd);
        let want = capk_api::crd::to_yaml(&crd).expect("CRD renders as YAML");
        let path = dir.join(&name);
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            have == want,
            "{} is stale or missing: run `make generate` and commit the result",
            path.display()
        );
        expected_files.push(name);
    }
    let mut present: Vec<String> = std::fs::read_dir(&dir)
        .expect("manifests/crd exists")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    present.sort();
    expected_files.sort();
    assert_eq!(
        present, expected_files,
        "manifests/crd holds files no type generates: run `make generate` and remove the leftovers"
    );
    let kustomization =
        std::fs::read_to_string(dir.join("kustomization.yaml")).expect("crd/kustomization.yaml");
    for name in &expected_files {
        assert!(
            kustomization.contains(&format!("- {name}")),
            "manifests/crd/kustomization.yaml does not list {name}"
        );
    }
}

#[test]
fn crds_carry_the_cluster_api_contract_labels() {
    for crd in capk_api::crd::crds() {
        let labels = crd.metadata.labels.clone().unwrap_or_default();
        assert_eq!(
            labels.get("cluster.x-k8s.io/v1beta2").map(String::as_str),
            Some("v1alpha1"),
            "{:?}",
            crd.metadata.name
        );
        assert_eq!(
            labels.get("cluster.x-k8s.io/provider").map(String::as_str),
            Some("infrastructure-kvm")
        );
        assert_eq!(
            crd.metadata.name.as_deref(),
            Some(format!("{}.{}", crd.spec.names.plural, crd.spec.group).as_str()),
            "CAPI requires <plural>.<group> CRD names"
        );
    }
}

/// This package's directory: Cargo's `CARGO_MANIFEST_DIR` of this test run, falling back to the
/// one it was compiled with. Checkouts share Cargo's build cache (`$CAPK_CACHE/target`), so a
/// binary Cargo finds fresh may have been compiled in another checkout.
fn package_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| env!("CARGO_MANIFEST_DIR").into(), Into::into)
}
