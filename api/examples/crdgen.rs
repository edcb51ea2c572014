//! Writes the CRDs into a directory (default `manifests/crd`); used by `make generate`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "manifests/crd".into());
    std::fs::create_dir_all(&dir)?;
    for crd in capk_api::crd::crds() {
        let path = std::path::Path::new(&dir).join(capk_api::crd::file_name(&crd));
        std::fs::write(&path, capk_api::crd::to_yaml(&crd)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
