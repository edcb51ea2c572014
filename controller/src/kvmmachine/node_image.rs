//! Pure: how the node image reaches the launcher. A container image is mounted as an image
//! volume or copied once per MC node into a host cache by init containers; a Flatcar release or
//! a URL download is fetched into that cache, verified, by the launcher image's `fetch-image`
//! init container (`capk_launcher::image_cache`), which links it for the launcher.

use capk_api::v1alpha1::{ContainerDiskImage, FlatcarChannel, KVMMachine};
use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, ImageVolumeSource, Volume, VolumeMount,
};

use super::pod_layout::{IMAGE_DIR, STATE_DIR, host_path, mount};
use crate::settings::{MachineDefaults, NodeImageSource};

/// Host directory where MC nodes keep node images (Flatcar releases and URL downloads).
pub const HOST_IMAGE_CACHE: &str = "/var/lib/capk/images";
/// Default path of the disk file inside a node-image container image.
pub const DEFAULT_CONTAINER_DISK_PATH: &str = "/disk/image.qcow2";
/// The init container that fetches Flatcar releases and URL images into the host cache; its
/// termination message (`<Reason>: <message>`) becomes the KVMMachine's `Ready` reason when it
/// fails.
pub const FETCH_IMAGE_CONTAINER: &str = "fetch-image";
/// Where the machine Pod's init containers keep the launcher image's static busybox.
pub const TOOLS_DIR: &str = "/var/lib/capk/tools";
/// The node-image link the `node-image` init container leaves in the state directory (host
/// cache mode): it points at the cached copy in [`IMAGE_DIR`].
pub const NODE_IMAGE_LINK: &str = "/var/lib/capk/state/node-image";
/// What the `node-image` init container runs (host-cache mode), with the static busybox the
/// `tools` init container copied out of the launcher image, so node images need nothing but the
/// disk file. Arguments: busybox, disk file in the node image, cache directory, link to write.
///
/// The copy is named by the sha256 of the disk's content and written under a temporary name,
/// then renamed: a half-copied file is never used, whatever happens. A lock directory on the
/// cache (busybox has no `flock`; `mkdir` is atomic) makes machine Pods that start together on
/// one MC node copy once; a lock left by a Pod killed mid-copy is broken after 15 minutes. A
/// reused copy is touched: the cache evicts least recently modified images first.
pub const NODE_IMAGE_SCRIPT: &str = r#"set -eu
bb=$1 src=$2 cache=$3 link=$4
[ -f "$src" ] || { echo "node image: $src is not in the node image" >&2; exit 1; }
sum=$("$bb" sha256sum "$src" | "$bb" cut -d' ' -f1)
dst="$cache/sha256-$sum.img"
lock="$cache/.lock"
until "$bb" mkdir "$lock" 2>/dev/null; do
  if [ -n "$("$bb" find "$lock" -maxdepth 0 -mmin +15 2>/dev/null)" ]; then
    echo "node image: breaking a lock older than 15 minutes" >&2
    "$bb" rmdir "$lock" 2>/dev/null || true
  fi
  "$bb" sleep 1
done
trap '"$bb" rmdir "$lock" 2>/dev/null || true' EXIT
if [ -f "$dst" ]; then
  echo "node image: $src is cached as $dst"
  "$bb" touch "$dst"
else
  "$bb" cp "$src" "$dst.partial.$$"
  "$bb" mv "$dst.partial.$$" "$dst"
  echo "node image: copied $src to $dst"
fi
"$bb" ln -sfn "$dst" "$link"
"#;

/// How the node image reaches the launcher: volumes, init containers, and the `--image` path.
pub struct NodeImage {
    /// Volumes the Pod needs for it.
    pub volumes: Vec<Volume>,
    /// Init containers that put it in place.
    pub init_containers: Vec<Container>,
    /// The `--image` path the launcher boots.
    pub path: String,
}

/// The node image: a container image through an image volume or the host cache, or a Flatcar
/// release / URL download from the host cache.
pub fn plan(km: &KVMMachine, defaults: &MachineDefaults) -> NodeImage {
    match container_image(km, defaults) {
        Some(ci) if defaults.node_image_source == NodeImageSource::ImageVolume => image_volume(&ci),
        Some(ci) => copied_to_host_cache(&ci, defaults),
        None => fetched_to_host_cache(km, defaults),
    }
}

/// The container image the node image comes from: the machine's, or the default node image
/// when the machine names no image at all.
fn container_image(km: &KVMMachine, defaults: &MachineDefaults) -> Option<ContainerDiskImage> {
    match (km.spec.image.as_ref(), &defaults.default_node_image) {
        (Some(i), _) => i.container_image.clone(),
        (None, Some(i)) => Some(ContainerDiskImage {
            image: i.clone(),
            path: None,
        }),
        (None, None) => None,
    }
}

/// The disk file's path inside a node-image container image.
fn disk_path(ci: &ContainerDiskImage) -> String {
    ci.path
        .clone()
        .unwrap_or_else(|| DEFAULT_CONTAINER_DISK_PATH.into())
}

/// A container image as an image volume: the container runtime pulls and caches the image by
/// digest; it is mounted read-only and used as the qcow2 backing file, never copied.
fn image_volume(ci: &ContainerDiskImage) -> NodeImage {
    let volume = Volume {
        name: "image".into(),
        image: Some(ImageVolumeSource {
            reference: Some(ci.image.clone()),
            pull_policy: Some("IfNotPresent".into()),
        }),
        ..Default::default()
    };
    NodeImage {
        volumes: vec![volume],
        init_containers: vec![],
        path: format!("{IMAGE_DIR}/{}", disk_path(ci).trim_start_matches('/')),
    }
}

/// A container image copied once per MC node into the host cache: the `tools` init container
/// copies the launcher image's static busybox out, and the `node-image` init container runs
/// [`NODE_IMAGE_SCRIPT`] with it inside the node image.
fn copied_to_host_cache(ci: &ContainerDiskImage, defaults: &MachineDefaults) -> NodeImage {
    let cache = host_path("image", HOST_IMAGE_CACHE, "DirectoryOrCreate");
    let tools = Volume {
        name: "tools".into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    };
    let busybox = format!("{TOOLS_DIR}/busybox");
    let copy_tools = init(
        "tools",
        &defaults.launcher_image,
        vec![
            "/bin/busybox".into(),
            "cp".into(),
            "/bin/busybox".into(),
            busybox.clone(),
        ],
        vec![mount("tools", TOOLS_DIR, false)],
    );
    let copy_image = init(
        "node-image",
        &ci.image,
        vec![
            busybox.clone(),
            "sh".into(),
            "-c".into(),
            NODE_IMAGE_SCRIPT.into(),
            "node-image".into(),
            busybox,
            disk_path(ci),
            IMAGE_DIR.into(),
            NODE_IMAGE_LINK.into(),
        ],
        vec![
            mount("tools", TOOLS_DIR, true),
            mount("image", IMAGE_DIR, false),
            mount("state", STATE_DIR, false),
        ],
    );
    NodeImage {
        volumes: vec![cache, tools],
        init_containers: vec![copy_tools, copy_image],
        path: NODE_IMAGE_LINK.into(),
    }
}

/// A URL image or a Flatcar release (the machine's, or the pinned default): fetched into the
/// host cache and verified by the launcher image's [`FETCH_IMAGE_CONTAINER`], linked into the
/// state directory.
fn fetched_to_host_cache(km: &KVMMachine, defaults: &MachineDefaults) -> NodeImage {
    let mut fetch = init(
        FETCH_IMAGE_CONTAINER,
        &defaults.launcher_image,
        vec!["capk-launcher".into()],
        vec![
            mount("image", IMAGE_DIR, false),
            mount("state", STATE_DIR, false),
        ],
    );
    fetch.args = Some(fetch_image_args(km, defaults));
    NodeImage {
        volumes: vec![host_path("image", HOST_IMAGE_CACHE, "DirectoryOrCreate")],
        init_containers: vec![fetch],
        path: NODE_IMAGE_LINK.into(),
    }
}

/// The `capk-launcher fetch-image` arguments: the cache and its bound, then the URL and its
/// digest, or the Flatcar channel, version and (if set) base URL.
fn fetch_image_args(km: &KVMMachine, defaults: &MachineDefaults) -> Vec<String> {
    let image = km.spec.image.as_ref();
    let mut args = vec![
        "fetch-image".to_owned(),
        format!("--cache-dir={IMAGE_DIR}"),
        format!("--link={NODE_IMAGE_LINK}"),
        format!("--max-cache-size={}", defaults.image_cache_bytes),
    ];
    if let Some(u) = image.and_then(|i| i.url.as_ref()) {
        args.extend([format!("--url={}", u.url), format!("--sha256={}", u.sha256)]);
        return args;
    }
    let (channel, version) = match image.and_then(|i| i.flatcar.as_ref()) {
        Some(f) => (channel(f.channel), f.version.as_str()),
        None => ("stable", defaults.flatcar_version.as_str()),
    };
    args.extend([
        format!("--flatcar-channel={channel}"),
        format!("--flatcar-version={version}"),
    ]);
    args.extend(
        defaults
            .flatcar_base_url
            .as_ref()
            .map(|b| format!("--flatcar-base-url={b}")),
    );
    args
}

/// An init container: `command` in `image` with `mounts`; its termination message is the file
/// it writes, else its log's end.
fn init(name: &str, image: &str, command: Vec<String>, mounts: Vec<VolumeMount>) -> Container {
    Container {
        name: name.into(),
        image: Some(image.into()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(command),
        volume_mounts: Some(mounts),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Default::default()
    }
}

/// The channel name Flatcar's release server uses.
fn channel(c: FlatcarChannel) -> &'static str {
    match c {
        FlatcarChannel::Stable => "stable",
        FlatcarChannel::Beta => "beta",
        FlatcarChannel::Alpha => "alpha",
        FlatcarChannel::Lts => "lts",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvmmachine::testing::kvm_machine;
    use serde_json::json;

    #[test]
    fn default_node_image_replaces_flatcar_only_when_the_machine_names_no_image() {
        let defaults = MachineDefaults {
            default_node_image: Some("localhost/capk/test-guest:dev".into()),
            ..MachineDefaults::default()
        };
        let init_images = |km: &KVMMachine| -> Vec<String> {
            plan(km, &defaults)
                .init_containers
                .into_iter()
                .filter_map(|c| c.image)
                .collect()
        };
        let resources = json!({"cpu": 1, "memory": "1Gi", "disk": "20Gi"});
        let plain = kvm_machine("plain", json!({"resources": resources}));
        assert_eq!(
            init_images(&plain),
            [
                "localhost/capk/capk-launcher:dev",
                "localhost/capk/test-guest:dev"
            ],
            "a machine without spec.image boots the default node image"
        );
        let flatcar = kvm_machine(
            "flatcar",
            json!({"resources": resources, "image": {"flatcar": {"channel": "beta", "version": "4230.1.0"}}}),
        );
        assert_eq!(
            init_images(&flatcar),
            ["localhost/capk/capk-launcher:dev"],
            "a machine naming its image keeps it: the launcher image fetches it"
        );
        let fetch = &plan(&flatcar, &defaults).init_containers[0];
        let args = fetch.args.clone().unwrap_or_default();
        assert!(
            args.contains(&"--flatcar-channel=beta".to_owned())
                && args.contains(&"--flatcar-version=4230.1.0".to_owned()),
            "{args:?}"
        );
        assert_eq!(plan(&flatcar, &defaults).path, NODE_IMAGE_LINK);
    }

    #[test]
    fn url_and_default_images_are_fetched_pinned_into_the_host_cache_by_the_launcher_image() {
        let resources = json!({"cpu": 1, "memory": "1Gi", "disk": "20Gi"});
        let defaults = MachineDefaults {
            flatcar_base_url: Some("http://mirror.internal/flatcar/stable".into()),
            image_cache_bytes: 20 << 30,
            ..MachineDefaults::default()
        };
        let args = |km: &KVMMachine| -> Vec<String> {
            let p = plan(km, &defaults);
            assert_eq!(p.path, NODE_IMAGE_LINK);
            let c = &p.init_containers[0];
            assert_eq!(c.name, FETCH_IMAGE_CONTAINER);
            assert_eq!(
                c.command.as_deref(),
                Some(&["capk-launcher".to_owned()][..])
            );
            let host = p.volumes.iter().find(|v| v.name == "image");
            assert_eq!(
                host.and_then(|v| v.host_path.as_ref())
                    .map(|h| h.path.as_str()),
                Some(HOST_IMAGE_CACHE)
            );
            c.args.clone().unwrap_or_default()
        };
        let plain = kvm_machine("plain", json!({"resources": resources}));
        assert_eq!(
            args(&plain),
            [
                "fetch-image",
                "--cache-dir=/var/lib/capk/image",
                "--link=/var/lib/capk/state/node-image",
                "--max-cache-size=21474836480",
                "--flatcar-channel=stable",
                "--flatcar-version=4230.2.3",
                "--flatcar-base-url=http://mirror.internal/flatcar/stable",
            ]
        );
        let sha = "ab".repeat(32);
        let url = kvm_machine(
            "url",
            json!({"resources": resources,
                   "image": {"url": {"url": "https://images.example/n.qcow2", "sha256": sha}}}),
        );
        let a = args(&url);
        assert_eq!(
            &a[4..],
            [
                "--url=https://images.example/n.qcow2".to_owned(),
                format!("--sha256={sha}")
            ],
            "a URL image has no Flatcar mirror: {a:?}"
        );
    }

    #[test]
    fn an_image_volume_mounts_the_container_image_without_a_copy() {
        let km = kvm_machine(
            "m",
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi"},
                   "image": {"containerImage": {"image": "capk-test-guest:v1"}}}),
        );
        let defaults = MachineDefaults {
            node_image_source: NodeImageSource::ImageVolume,
            ..Default::default()
        };
        let p = plan(&km, &defaults);
        assert!(p.init_containers.is_empty());
        let image = p.volumes.iter().find(|v| v.name == "image");
        assert_eq!(
            image
                .and_then(|v| v.image.as_ref())
                .and_then(|i| i.reference.as_deref()),
            Some("capk-test-guest:v1")
        );
        assert_eq!(p.path, "/var/lib/capk/image/disk/image.qcow2");
    }
}
