//! Reads the Pod interface's current state over rtnetlink (the planner's input).

use std::net::{IpAddr, Ipv4Addr};

use futures::TryStreamExt;
use ipnet::Ipv4Net;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::packet_route::link::LinkAttribute;
use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute, RouteType};
use rtnetlink::{Handle, RouteMessageBuilder};

use super::MacAddr;
use super::plan::{PodInterface, PodRoute};

/// Netlink failures, named after what was being done.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// Opening the netlink socket failed.
    #[error("open rtnetlink socket")]
    Connect(#[source] std::io::Error),
    /// The interface does not exist.
    #[error("interface {0} not found in this network namespace")]
    NoSuchLink(String),
    /// Some request failed.
    #[error("{action}")]
    Request {
        /// What was being done.
        action: String,
        /// Cause.
        #[source]
        source: rtnetlink::Error,
    },
    /// Writing a sysctl failed.
    #[error("write {0}")]
    Sysctl(String, #[source] std::io::Error),
    /// Tap creation failed.
    #[error(transparent)]
    Tap(#[from] super::tap::TapError),
}

pub(crate) fn req(action: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> NetlinkError {
    let action = action.into();
    move |source| NetlinkError::Request { action, source }
}

/// Opens an rtnetlink handle whose connection runs on the current tokio runtime.
pub fn connect() -> Result<Handle, NetlinkError> {
    let (conn, handle, _) = rtnetlink::new_connection().map_err(NetlinkError::Connect)?;
    tokio::spawn(conn);
    Ok(handle)
}

/// Index of a link by name, `None` when absent.
pub async fn link_index(handle: &Handle, name: &str) -> Result<Option<u32>, NetlinkError> {
    let mut links = handle.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(Some(msg)) => Ok(Some(msg.header.index)),
        Ok(None) => Ok(None),
        // The kernel answers ENODEV for an unknown name.
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -19 => Ok(None),
        Err(e) => Err(req(format!("get link {name}"))(e)),
    }
}

/// Reads name, MAC, MTU, IPv4 addresses and main-table IPv4 routes of `name`.
pub async fn observe(handle: &Handle, name: &str) -> Result<PodInterface, NetlinkError> {
    let index = link_index(handle, name)
        .await?
        .ok_or_else(|| NetlinkError::NoSuchLink(name.into()))?;
    let link = handle
        .link()
        .get()
        .match_index(index)
        .execute()
        .try_next()
        .await
        .map_err(req(format!("get link {name}")))?
        .ok_or_else(|| NetlinkError::NoSuchLink(name.into()))?;
    let mut mac = MacAddr([0; 6]);
    let mut mtu = 1500;
    for a in &link.attributes {
        match a {
            LinkAttribute::Address(b) => {
                if let Ok(m) = MacAddr::try_from(b.as_slice()) {
                    mac = m;
                }
            }
            LinkAttribute::Mtu(m) => mtu = *m,
            _ => {}
        }
    }

    let addrs: Vec<_> = handle
        .address()
        .get()
        .set_link_index_filter(index)
        .execute()
        .try_collect()
        .await
        .map_err(req(format!("list addresses of {name}")))?;
    let mut addresses = Vec::new();
    for a in addrs {
        if a.header.family != AddressFamily::Inet {
            continue;
        }
        for attr in &a.attributes {
            if let AddressAttribute::Address(IpAddr::V4(ip)) = attr
                && let Ok(net) = Ipv4Net::new(*ip, a.header.prefix_len)
            {
                addresses.push(net);
            }
        }
    }

    let routes_msgs: Vec<_> = handle
        .route()
        .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
        .execute()
        .try_collect()
        .await
        .map_err(req("list IPv4 routes"))?;
    let mut routes = Vec::new();
    for r in routes_msgs {
        if r.header.kind != RouteType::Unicast {
            continue;
        }
        let mut oif = None;
        let mut dst = Ipv4Addr::UNSPECIFIED;
        let mut gw = None;
        let mut table = u32::from(r.header.table);
        for attr in &r.attributes {
            match attr {
                RouteAttribute::Oif(i) => oif = Some(*i),
                RouteAttribute::Destination(RouteAddress::Inet(d)) => dst = *d,
                RouteAttribute::Gateway(RouteAddress::Inet(g)) => gw = Some(*g),
                RouteAttribute::Table(t) => table = *t,
                _ => {}
            }
        }
        if oif != Some(index) || table != 254 {
            continue;
        }
        if let Ok(destination) = Ipv4Net::new(dst, r.header.destination_prefix_length) {
            routes.push(PodRoute {
                destination,
                gateway: gw,
            });
        }
    }
    Ok(PodInterface {
        name: name.into(),
        mac,
        mtu,
        addresses,
        routes,
    })
}
