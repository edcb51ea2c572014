//! Pure network planning: what eth0 has today → the links, addresses and DHCP lease to set up.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use serde::Serialize;

use super::MacAddr;

/// Name of the bridge joining the Pod interface and the VM's tap.
pub const BRIDGE: &str = "capkbr0";
/// Name of the VM's tap.
pub const TAP: &str = "capktap0";
/// Name of the dummy link that keeps the Pod IP for the CNI's CHECK.
pub const DUMMY: &str = "capkdummy0";
/// Link-local address of the bridge: the DHCP server's identity and the launcher's source
/// address towards the VM (apiserver `/readyz`); the guest has an on-link route to it, nothing
/// else routes it.
pub const DHCP_SERVER_ADDRESS: Ipv4Addr = Ipv4Addr::new(169, 254, 75, 10);

/// What the Pod interface has before the launcher touches it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct PodInterface {
    /// Interface name (eth0).
    pub name: String,
    /// Its MAC (the VM will own it).
    pub mac: MacAddr,
    /// Its MTU.
    pub mtu: u32,
    /// Its IPv4 addresses with prefix length.
    pub addresses: Vec<Ipv4Net>,
    /// Main-table IPv4 routes through it.
    pub routes: Vec<PodRoute>,
}

/// One route through the Pod interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct PodRoute {
    /// Destination.
    pub destination: Ipv4Net,
    /// Next hop; `None` for on-link routes.
    pub gateway: Option<Ipv4Addr>,
}

/// Per-boot facts the guest learns by DHCP besides addressing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct GuestNaming {
    /// Hostname (option 12).
    pub hostname: String,
    /// DNS servers (option 6).
    pub dns_servers: Vec<Ipv4Addr>,
    /// Search domains (option 119; the first also as option 15).
    pub dns_search: Vec<String>,
    /// NTP servers (option 42).
    pub ntp_servers: Vec<Ipv4Addr>,
}

/// The single lease the DHCP server hands out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DhcpLease {
    /// The only client served: the VM's NIC.
    pub client_mac: MacAddr,
    /// The Pod IP with its prefix (a /32 on Calico).
    pub address: Ipv4Net,
    /// Default router (option 3), also the last classless route.
    pub router: Option<Ipv4Addr>,
    /// Option 121, most specific first, default route last (RFC 3442 clients ignore option 3).
    pub classless_routes: Vec<(Ipv4Net, Ipv4Addr)>,
    /// Option 54.
    pub server_id: Ipv4Addr,
    /// Option 26.
    pub mtu: u16,
    /// Naming facts.
    pub naming: GuestNaming,
}

/// Everything the apply step creates and changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NetworkPlan {
    /// Pod interface, enslaved to the bridge after losing its IP and MAC.
    pub pod_interface: String,
    /// The MAC the Pod interface gets (random, locally administered).
    pub pod_interface_new_mac: MacAddr,
    /// The addresses removed from the Pod interface and kept on the dummy link.
    pub pod_addresses: Vec<Ipv4Net>,
    /// MTU of bridge, tap and the guest NIC.
    pub mtu: u32,
    /// Bridge name.
    pub bridge: String,
    /// Bridge address (the DHCP server's source address, and the launcher's towards the VM:
    /// the apply step routes the Pod IP to the bridge instead of keeping it local).
    pub bridge_address: Ipv4Net,
    /// Tap name.
    pub tap: String,
    /// Dummy link name.
    pub dummy: String,
    /// The VM's NIC MAC: the Pod's original MAC.
    pub vm_mac: MacAddr,
    /// The DHCP lease for the VM.
    pub lease: DhcpLease,
}

/// Why the Pod interface cannot be handed to a VM.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    /// No IPv4 address.
    #[error(
        "{0} has no IPv4 address; the VM needs the Pod's IPv4 address (IPv6-only Pods are not supported)"
    )]
    NoIpv4(String),
    /// More than one IPv4 address.
    #[error("{0} has {1} IPv4 addresses; exactly one is supported")]
    ManyIpv4(String, usize),
    /// MTU the guest cannot be told.
    #[error("{0} has MTU {1}; DHCP option 26 needs 68..=65535")]
    Mtu(String, u32),
}

/// Plans the binding. `new_mac` is the Pod interface's replacement MAC (random in production).
pub fn plan(
    pod: &PodInterface,
    naming: GuestNaming,
    new_mac: MacAddr,
) -> Result<NetworkPlan, PlanError> {
    let address = match pod.addresses.as_slice() {
        [] => return Err(PlanError::NoIpv4(pod.name.clone())),
        [one] => *one,
        many => return Err(PlanError::ManyIpv4(pod.name.clone(), many.len())),
    };
    let mtu = u16::try_from(pod.mtu)
        .ok()
        .filter(|m| *m >= 68)
        .ok_or_else(|| PlanError::Mtu(pod.name.clone(), pod.mtu))?;

    let connected = address.trunc();
    let mut specific: Vec<(Ipv4Net, Ipv4Addr)> = Vec::new();
    let mut router = None;
    for r in &pod.routes {
        if r.destination.prefix_len() == 0 {
            if router.is_none() {
                router = r.gateway;
            }
            continue;
        }
        // The guest derives the connected route from the netmask itself.
        if r.gateway.is_none() && r.destination == connected {
            continue;
        }
        let entry = (
            r.destination.trunc(),
            r.gateway.unwrap_or(Ipv4Addr::UNSPECIFIED),
        );
        if !specific.contains(&entry) {
            specific.push(entry);
        }
    }
    // The launcher talks to the VM (apiserver /readyz) from the bridge's address: the guest
    // must answer it on the link, not through the Pod's gateway.
    let launcher_route = (
        Ipv4Net::new(DHCP_SERVER_ADDRESS, 32).expect("32 is a valid prefix"),
        Ipv4Addr::UNSPECIFIED,
    );
    if !specific.contains(&launcher_route) {
        specific.push(launcher_route);
    }
    specific.sort_by(|a, b| {
        b.0.prefix_len()
            .cmp(&a.0.prefix_len())
            .then(a.0.network().cmp(&b.0.network()))
    });
    let mut classless_routes = specific;
    if let Some(gw) = router {
        classless_routes.push((Ipv4Net::default(), gw));
    }

    Ok(NetworkPlan {
        pod_interface: pod.name.clone(),
        pod_interface_new_mac: new_mac,
        pod_addresses: vec![address],
        mtu: pod.mtu,
        bridge: BRIDGE.into(),
        bridge_address: Ipv4Net::new(DHCP_SERVER_ADDRESS, 32).expect("32 is a valid prefix"),
        tap: TAP.into(),
        dummy: DUMMY.into(),
        vm_mac: pod.mac,
        lease: DhcpLease {
            client_mac: pod.mac,
            address,
            router,
            classless_routes,
            server_id: DHCP_SERVER_ADDRESS,
            mtu,
            naming,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naming() -> GuestNaming {
        GuestNaming {
            hostname: "wc1-md-0-abcde".into(),
            dns_servers: vec!["10.96.0.10".parse().unwrap()],
            dns_search: vec!["svc.cluster.local".into(), "cluster.local".into()],
            ntp_servers: vec!["10.0.0.123".parse().unwrap()],
        }
    }

    /// A route to `destination`, over `gateway` or on-link.
    fn route(destination: &str, gateway: Option<&str>) -> PodRoute {
        PodRoute {
            destination: destination.parse().unwrap(),
            gateway: gateway.map(|g| g.parse().unwrap()),
        }
    }

    const NEW_MAC: MacAddr = MacAddr([0x02, 0, 0, 0, 0, 0x01]);

    fn calico() -> PodInterface {
        PodInterface {
            name: "eth0".into(),
            mac: "9a:1c:3e:aa:bb:cc".parse().unwrap(),
            mtu: 1440,
            addresses: vec!["10.244.1.5/32".parse().unwrap()],
            routes: vec![
                route("0.0.0.0/0", Some("169.254.1.1")),
                route("169.254.1.1/32", None),
            ],
        }
    }

    #[test]
    fn calico_pod_gets_onlink_gateway_route_before_default() {
        let p = plan(&calico(), naming(), NEW_MAC).unwrap();
        insta::assert_yaml_snapshot!(p);
    }

    #[test]
    fn bridge_cni_pod_keeps_its_prefix_and_gateway() {
        let pod = PodInterface {
            name: "eth0".into(),
            mac: "0a:58:0a:16:00:05".parse().unwrap(),
            mtu: 1500,
            addresses: vec!["10.22.0.5/24".parse().unwrap()],
            routes: vec![
                route("10.22.0.0/24", None),
                route("0.0.0.0/0", Some("10.22.0.1")),
                route("10.96.0.0/12", Some("10.22.0.1")),
            ],
        };
        let p = plan(&pod, naming(), NEW_MAC).unwrap();
        insta::assert_yaml_snapshot!(p.lease);
    }

    #[test]
    fn refuses_pod_without_ipv4() {
        let mut pod = calico();
        pod.addresses.clear();
        let err = plan(&pod, naming(), NEW_MAC).unwrap_err();
        assert_eq!(
            err.to_string(),
            "eth0 has no IPv4 address; the VM needs the Pod's IPv4 address (IPv6-only Pods are not supported)"
        );
    }

    #[test]
    fn replacement_mac_is_local_unicast() {
        let m = MacAddr::locally_administered([0xff; 6]);
        assert_eq!(m.0[0] & 0x03, 0x02);
        assert_ne!(MacAddr::random(), MacAddr::random());
    }
}
