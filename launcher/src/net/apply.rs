//! Applies a [`NetworkPlan`] with rtnetlink; records each step so a failure can be undone.

use std::net::IpAddr;

use futures::TryStreamExt;
use ipnet::Ipv4Net;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::link::LinkMessage;
use rtnetlink::packet_route::route::{RouteProtocol, RouteScope, RouteType};
use rtnetlink::{
    Handle, LinkBridge, LinkBridgePort, LinkDummy, LinkUnspec, LinkVeth, RouteMessageBuilder,
};

use super::observe::{NetlinkError, link_index, req};
use super::plan::{NetworkPlan, PodInterface};
use super::tap;

/// One undoable step already taken.
#[derive(Debug, Clone)]
enum Step {
    CreatedLink(String),
    ChangedPodInterface,
}

/// What was applied, for undo on a failed start.
#[derive(Debug)]
pub struct AppliedNetwork {
    steps: Vec<Step>,
    original: PodInterface,
}

/// What a running launcher leaves in its state directory so that the next start in the same
/// Pod can put the Pod interface back when the previous run died without undoing (SIGKILL, OOM).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SavedBinding {
    /// The Pod interface as it was before the binding.
    pub original: PodInterface,
    /// Links the binding created.
    pub links: Vec<String>,
}

impl SavedBinding {
    /// File name inside the state directory.
    pub const FILE: &'static str = "network-binding.json";

    /// The record for a plan.
    pub fn new(plan: &NetworkPlan, original: &PodInterface) -> Self {
        Self {
            original: original.clone(),
            links: vec![plan.tap.clone(), plan.bridge.clone(), plan.dummy.clone()],
        }
    }
}

/// Removes a binding left by a previous run: deletes its links and restores the Pod interface.
pub async fn recover(handle: &Handle, saved: &SavedBinding) -> Result<(), NetlinkError> {
    for l in &saved.links {
        delete_link(handle, l).await?;
    }
    restore_pod(handle, &saved.original).await
}

fn sysctl_path(iface: &str, key: &str) -> String {
    format!("/proc/sys/net/ipv4/conf/{iface}/{key}")
}

fn write_sysctl(iface: &str, key: &str, value: &str) -> Result<(), NetlinkError> {
    let path = sysctl_path(iface, key);
    std::fs::write(&path, value).map_err(|e| NetlinkError::Sysctl(path, e))
}

async fn index_of(handle: &Handle, name: &str) -> Result<u32, NetlinkError> {
    link_index(handle, name)
        .await?
        .ok_or_else(|| NetlinkError::NoSuchLink(name.into()))
}

/// Applies the plan. On error the steps already taken are undone before returning.
pub async fn apply(
    handle: &Handle,
    plan: &NetworkPlan,
    original: &PodInterface,
) -> Result<AppliedNetwork, NetlinkError> {
    let mut applied = AppliedNetwork {
        steps: Vec::new(),
        original: original.clone(),
    };
    match apply_steps(handle, plan, &mut applied).await {
        Ok(()) => Ok(applied),
        Err(e) => {
            applied.undo(handle).await;
            Err(e)
        }
    }
}

async fn apply_steps(
    handle: &Handle,
    plan: &NetworkPlan,
    applied: &mut AppliedNetwork,
) -> Result<(), NetlinkError> {
    // Tap first: it is the step most likely to fail (no /dev/net/tun), before eth0 is touched.
    tap::create_persistent_tap(&plan.tap)?;
    applied.steps.push(Step::CreatedLink(plan.tap.clone()));
    create_bridge(handle, plan).await?;
    applied.steps.push(Step::CreatedLink(plan.bridge.clone()));
    let br = address_bridge(handle, plan).await?;
    let pod = index_of(handle, &plan.pod_interface).await?;
    applied.steps.push(Step::ChangedPodInterface);
    enslave_pod_interface(handle, plan, pod, br).await?;
    let tap = enslave_tap(handle, plan, br).await?;
    bring_up_bridge(handle, [pod, tap], br).await?;
    create_dummy(handle, &plan.dummy).await?;
    applied.steps.push(Step::CreatedLink(plan.dummy.clone()));
    let dummy = keep_pod_addresses_on_dummy(handle, plan).await?;
    route_pod_addresses_to_vm(handle, plan, dummy, br).await
}

/// Sets what `message` says about a link.
async fn set_link(
    handle: &Handle,
    message: LinkMessage,
    action: impl Into<String>,
) -> Result<(), NetlinkError> {
    handle
        .link()
        .set(message)
        .execute()
        .await
        .map_err(req(action))
}

/// Adds the IPv4 address `address` to link `index`.
async fn add_address(
    handle: &Handle,
    index: u32,
    address: Ipv4Net,
    action: impl Into<String>,
) -> Result<(), NetlinkError> {
    handle
        .address()
        .add(index, IpAddr::V4(address.addr()), address.prefix_len())
        .execute()
        .await
        .map_err(req(action))
}

/// Creates the bridge, without learning (ageing time 0), at the plan's MTU.
async fn create_bridge(handle: &Handle, plan: &NetworkPlan) -> Result<(), NetlinkError> {
    handle
        .link()
        .add(
            LinkBridge::new(&plan.bridge)
                .ageing_time(0)
                .mtu(plan.mtu)
                .build(),
        )
        .execute()
        .await
        .map_err(req(format!("create bridge {}", plan.bridge)))
}

/// Gives the bridge its link-local DHCP address; returns its index.
async fn address_bridge(handle: &Handle, plan: &NetworkPlan) -> Result<u32, NetlinkError> {
    let br = index_of(handle, &plan.bridge).await?;
    // The bridge only answers for its own link-local DHCP address. It accepts packets from the
    // Pod IP although the dummy holds that address too: they are the VM's answers to the
    // launcher (apiserver /readyz); without this the kernel drops them as martians.
    write_sysctl(&plan.bridge, "arp_ignore", "1")?;
    write_sysctl(&plan.bridge, "accept_local", "1")?;
    add_address(
        handle,
        br,
        plan.bridge_address,
        format!("add {} to {}", plan.bridge_address, plan.bridge),
    )
    .await?;
    Ok(br)
}

/// Takes the Pod interface's IPv4 addresses away, gives it the plan's new MAC (the VM gets the
/// original) and makes it a port of the bridge.
async fn enslave_pod_interface(
    handle: &Handle,
    plan: &NetworkPlan,
    pod: u32,
    br: u32,
) -> Result<(), NetlinkError> {
    let addrs: Vec<_> = handle
        .address()
        .get()
        .set_link_index_filter(pod)
        .execute()
        .try_collect()
        .await
        .map_err(req(format!("list addresses of {}", plan.pod_interface)))?;
    for a in addrs
        .into_iter()
        .filter(|a| a.header.family == AddressFamily::Inet)
    {
        handle
            .address()
            .del(a)
            .execute()
            .await
            .map_err(req(format!(
                "remove IPv4 address from {}",
                plan.pod_interface
            )))?;
    }
    let down = LinkUnspec::new_with_index(pod).down().build();
    set_link(handle, down, format!("set {} down", plan.pod_interface)).await?;
    let swapped = LinkUnspec::new_with_index(pod)
        .address(plan.pod_interface_new_mac.0.to_vec())
        .controller(br)
        .build();
    let action = format!("swap MAC of {} and enslave it", plan.pod_interface);
    set_link(handle, swapped, action).await
}

/// Makes the tap a port of the bridge at the plan's MTU; returns its index.
async fn enslave_tap(handle: &Handle, plan: &NetworkPlan, br: u32) -> Result<u32, NetlinkError> {
    let tap = index_of(handle, &plan.tap).await?;
    let enslaved = LinkUnspec::new_with_index(tap)
        .mtu(plan.mtu)
        .controller(br)
        .build();
    set_link(handle, enslaved, format!("enslave {}", plan.tap)).await?;
    Ok(tap)
}

/// Turns learning off on the bridge's `ports` and sets them and the bridge up.
async fn bring_up_bridge(handle: &Handle, ports: [u32; 2], br: u32) -> Result<(), NetlinkError> {
    for port in ports {
        handle
            .link()
            .set_port(LinkBridgePort::new(port).learning(false).build())
            .execute()
            .await
            .map_err(req("turn bridge port learning off"))?;
    }
    for link in ports.into_iter().chain([br]) {
        let up = LinkUnspec::new_with_index(link).up().build();
        set_link(handle, up, "set links up").await?;
    }
    Ok(())
}

/// Puts the Pod's addresses on the dummy (which answers no ARP for them) and sets it up;
/// returns its index.
async fn keep_pod_addresses_on_dummy(
    handle: &Handle,
    plan: &NetworkPlan,
) -> Result<u32, NetlinkError> {
    let dummy = index_of(handle, &plan.dummy).await?;
    write_sysctl(&plan.dummy, "arp_ignore", "1")?;
    for a in &plan.pod_addresses {
        add_address(handle, dummy, *a, format!("keep {a} on {}", plan.dummy)).await?;
    }
    let up = LinkUnspec::new_with_index(dummy).up().build();
    set_link(handle, up, format!("set {} up", plan.dummy)).await?;
    Ok(dummy)
}

/// The dummy keeps the Pod IP for the CNI, but the VM owns it: the launcher's own traffic to
/// it (apiserver /readyz) must leave through the bridge, from the bridge's link-local address
/// (the guest has an on-link route back to it), instead of being delivered locally.
async fn route_pod_addresses_to_vm(
    handle: &Handle,
    plan: &NetworkPlan,
    dummy: u32,
    br: u32,
) -> Result<(), NetlinkError> {
    for a in &plan.pod_addresses {
        let local = RouteMessageBuilder::<std::net::Ipv4Addr>::new()
            .table_id(RT_TABLE_LOCAL)
            .protocol(RouteProtocol::Kernel)
            .kind(RouteType::Local)
            .scope(RouteScope::Host)
            .destination_prefix(a.addr(), 32)
            .output_interface(dummy)
            .build();
        handle
            .route()
            .del(local)
            .execute()
            .await
            .map_err(req(format!("remove the local route of {}", a.addr())))?;
        let to_vm = RouteMessageBuilder::<std::net::Ipv4Addr>::new()
            .destination_prefix(a.addr(), 32)
            .output_interface(br)
            .pref_source(plan.bridge_address.addr())
            .scope(RouteScope::Link)
            .build();
        handle
            .route()
            .add(to_vm)
            .execute()
            .await
            .map_err(req(format!(
                "route {} to the VM over {}",
                a.addr(),
                plan.bridge
            )))?;
    }
    Ok(())
}

/// The kernel's `local` routing table.
const RT_TABLE_LOCAL: u32 = 255;

/// Creates the link that keeps the Pod IP. Kernels without the dummy driver (EOPNOTSUPP) get a
/// veth pair whose peer stays down: it holds the address just as well and carries no traffic.
async fn create_dummy(handle: &Handle, name: &str) -> Result<(), NetlinkError> {
    match handle
        .link()
        .add(LinkDummy::new(name).build())
        .execute()
        .await
    {
        Ok(()) => Ok(()),
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -95 => {
            tracing::warn!(
                link = name,
                "kernel has no dummy links; keeping the Pod IP on a veth pair instead"
            );
            handle
                .link()
                .add(LinkVeth::new(name, &format!("{name}p")).build())
                .execute()
                .await
                .map_err(req(format!("create veth {name} (no dummy driver)")))
        }
        Err(e) => Err(req(format!("create dummy {name}"))(e)),
    }
}

impl AppliedNetwork {
    /// Best-effort undo in reverse order: deletes created links, gives the Pod interface back
    /// its MAC, addresses and routes. Used when the start fails before QEMU runs.
    pub async fn undo(&mut self, handle: &Handle) {
        while let Some(step) = self.steps.pop() {
            let result = match &step {
                Step::CreatedLink(name) => delete_link(handle, name).await,
                Step::ChangedPodInterface => restore_pod(handle, &self.original).await,
            };
            if let Err(e) = result {
                tracing::warn!(error = %e, step = ?step, "undo network step failed");
            }
        }
    }
}

async fn delete_link(handle: &Handle, name: &str) -> Result<(), NetlinkError> {
    if let Some(i) = link_index(handle, name).await? {
        handle
            .link()
            .del(i)
            .execute()
            .await
            .map_err(req(format!("delete {name}")))?;
    }
    Ok(())
}

async fn restore_pod(handle: &Handle, pod: &PodInterface) -> Result<(), NetlinkError> {
    let i = index_of(handle, &pod.name).await?;
    let restored = LinkUnspec::new_with_index(i)
        .nocontroller()
        .address(pod.mac.0.to_vec())
        .up()
        .build();
    set_link(handle, restored, format!("restore {}", pod.name)).await?;
    for a in &pod.addresses {
        // Already present is fine: the failure may have happened before removal.
        let _ = add_address(handle, i, *a, "restore an address").await;
    }
    // On-link routes first so gateways are reachable when the default route comes back.
    let mut routes = pod.routes.clone();
    routes.sort_by_key(|r| r.gateway.is_some());
    for r in routes {
        let mut b = RouteMessageBuilder::<std::net::Ipv4Addr>::new()
            .destination_prefix(r.destination.addr(), r.destination.prefix_len())
            .output_interface(i);
        if let Some(gw) = r.gateway {
            b = b.gateway(gw).onlink();
        } else {
            b = b.scope(rtnetlink::packet_route::route::RouteScope::Link);
        }
        let _ = handle.route().add(b.build()).execute().await;
    }
    Ok(())
}
