//! Single-client DHCPv4 server: answers only the VM's MAC with the planned lease.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;

use dhcproto::v4::{DhcpOption, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Decodable, Decoder, Encodable, Encoder, Name};
use tokio::net::UdpSocket;

use super::plan::DhcpLease;

/// Infinite lease (RFC 2131 §3.3): the guest never needs to renew.
pub const INFINITE_LEASE: u32 = u32::MAX;

/// DHCP server failures.
#[derive(Debug, thiserror::Error)]
pub enum DhcpError {
    /// Creating or binding the server socket failed.
    #[error("bind the DHCP server socket on {interface}")]
    Bind {
        /// Interface the socket is bound to.
        interface: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// What the server does with one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// Send this message.
    Send(Box<Message>),
    /// Not for us (another MAC, not a request, a release): stay quiet.
    Ignore(&'static str),
}

/// Builds the reply to one client message. Pure: the unit tests cover every branch.
pub fn reply(lease: &DhcpLease, req: &Message) -> Reply {
    if req.opcode() != Opcode::BootRequest {
        return Reply::Ignore("not a BOOTREQUEST");
    }
    if req.chaddr().get(..6) != Some(&lease.client_mac.0[..]) {
        return Reply::Ignore("not the VM's MAC");
    }
    let Some(DhcpOption::MessageType(kind)) = req.opts().get(OptionCode::MessageType) else {
        return Reply::Ignore("no message type");
    };
    let kind = *kind;
    let requested = match req.opts().get(OptionCode::RequestedIpAddress) {
        Some(DhcpOption::RequestedIpAddress(ip)) => Some(*ip),
        _ if !req.ciaddr().is_unspecified() => Some(req.ciaddr()),
        _ => None,
    };
    let addr = lease.address.addr();
    let (answer, yiaddr) = match kind {
        MessageType::Discover => (MessageType::Offer, addr),
        MessageType::Request if requested.is_none_or(|r| r == addr) => (MessageType::Ack, addr),
        MessageType::Request => (MessageType::Nak, Ipv4Addr::UNSPECIFIED),
        MessageType::Inform => (MessageType::Ack, Ipv4Addr::UNSPECIFIED),
        _ => return Reply::Ignore("release/decline needs no answer"),
    };

    let mut msg = Message::default();
    msg.set_opcode(Opcode::BootReply)
        .set_xid(req.xid())
        .set_flags(req.flags())
        .set_chaddr(req.chaddr())
        .set_giaddr(req.giaddr())
        .set_ciaddr(if kind == MessageType::Inform {
            req.ciaddr()
        } else {
            Ipv4Addr::UNSPECIFIED
        })
        .set_yiaddr(yiaddr)
        .set_siaddr(Ipv4Addr::UNSPECIFIED);
    let opts = msg.opts_mut();
    opts.insert(DhcpOption::MessageType(answer));
    opts.insert(DhcpOption::ServerIdentifier(lease.server_id));
    if answer == MessageType::Nak {
        return Reply::Send(Box::new(msg));
    }
    if kind != MessageType::Inform {
        opts.insert(DhcpOption::AddressLeaseTime(INFINITE_LEASE));
    }
    opts.insert(DhcpOption::SubnetMask(lease.address.netmask()));
    if let Some(r) = lease.router {
        opts.insert(DhcpOption::Router(vec![r]));
    }
    if !lease.classless_routes.is_empty() {
        opts.insert(DhcpOption::ClasslessStaticRoute(
            lease.classless_routes.clone(),
        ));
    }
    let n = &lease.naming;
    if !n.dns_servers.is_empty() {
        opts.insert(DhcpOption::DomainNameServer(n.dns_servers.clone()));
    }
    let search: Vec<Name> = n
        .dns_search
        .iter()
        .filter_map(|d| Name::from_ascii(d).ok())
        .collect();
    if !search.is_empty() {
        opts.insert(DhcpOption::DomainSearch(search));
    }
    if let Some(first) = n.dns_search.first() {
        opts.insert(DhcpOption::DomainName(first.clone()));
    }
    if !n.ntp_servers.is_empty() {
        opts.insert(DhcpOption::NtpServers(n.ntp_servers.clone()));
    }
    if !n.hostname.is_empty() {
        opts.insert(DhcpOption::Hostname(n.hostname.clone()));
    }
    opts.insert(DhcpOption::InterfaceMtu(lease.mtu));
    Reply::Send(Box::new(msg))
}

/// Decodes a datagram and builds the reply bytes; `None` when nothing must be sent.
pub fn handle_datagram(lease: &DhcpLease, datagram: &[u8]) -> Option<(Vec<u8>, MessageType)> {
    let req = Message::decode(&mut Decoder::new(datagram)).ok()?;
    let Reply::Send(msg) = reply(lease, &req) else {
        return None;
    };
    let kind = match msg.opts().get(OptionCode::MessageType) {
        Some(DhcpOption::MessageType(k)) => *k,
        _ => return None,
    };
    let mut buf = Vec::with_capacity(576);
    msg.encode(&mut Encoder::new(&mut buf)).ok()?;
    Some((buf, kind))
}

/// Serves the lease on `interface` until the task is dropped.
pub struct DhcpServer {
    socket: UdpSocket,
    lease: Arc<DhcpLease>,
}

impl DhcpServer {
    /// Binds UDP port 67 on `interface` only (SO_BINDTODEVICE), broadcast allowed.
    pub fn bind(interface: &str, lease: DhcpLease) -> Result<Self, DhcpError> {
        let err = |source| DhcpError::Bind {
            interface: interface.to_string(),
            source,
        };
        let socket =
            std::net::UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 67)).map_err(err)?;
        nix::sys::socket::setsockopt(
            &socket,
            nix::sys::socket::sockopt::BindToDevice,
            &std::ffi::OsString::from(interface),
        )
        .map_err(|e| err(e.into()))?;
        socket.set_broadcast(true).map_err(err)?;
        socket.set_nonblocking(true).map_err(err)?;
        let socket = UdpSocket::from_std(socket).map_err(err)?;
        Ok(Self {
            socket,
            lease: Arc::new(lease),
        })
    }

    /// Answers requests forever. Replies are broadcast: the client has no address yet.
    pub async fn serve(self) {
        let mut buf = vec![0u8; 1500];
        loop {
            let (n, from) = match self.socket.recv_from(&mut buf).await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "dhcp receive failed");
                    continue;
                }
            };
            let Some((bytes, kind)) = handle_datagram(&self.lease, &buf[..n]) else {
                continue;
            };
            let to = SocketAddrV4::new(Ipv4Addr::BROADCAST, 68);
            match self.socket.send_to(&bytes, to).await {
                Ok(_) => tracing::info!(
                    dhcp.reply = ?kind,
                    dhcp.client = %self.lease.client_mac,
                    dhcp.address = %self.lease.address,
                    dhcp.from = %from,
                    "dhcp reply sent"
                ),
                Err(e) => tracing::warn!(error = %e, "dhcp send failed"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::MacAddr;
    use crate::net::plan::GuestNaming;

    const VM_MAC: MacAddr = MacAddr([0x9a, 0x1c, 0x3e, 0xaa, 0xbb, 0xcc]);

    fn calico_lease() -> DhcpLease {
        DhcpLease {
            client_mac: VM_MAC,
            address: "10.244.1.5/32".parse().unwrap(),
            router: Some("169.254.1.1".parse().unwrap()),
            classless_routes: vec![
                ("169.254.1.1/32".parse().unwrap(), Ipv4Addr::UNSPECIFIED),
                ("0.0.0.0/0".parse().unwrap(), "169.254.1.1".parse().unwrap()),
            ],
            server_id: "169.254.75.10".parse().unwrap(),
            mtu: 1440,
            naming: GuestNaming {
                hostname: "wc1-cp-x7k2p".into(),
                dns_servers: vec!["10.96.0.10".parse().unwrap()],
                dns_search: vec!["default.svc.cluster.local".into(), "cluster.local".into()],
                ntp_servers: vec!["10.0.0.123".parse().unwrap()],
            },
        }
    }

    fn request(kind: MessageType, mac: MacAddr, requested: Option<Ipv4Addr>) -> Message {
        let mut m = Message::default();
        m.set_opcode(Opcode::BootRequest)
            .set_xid(0x1234_5678)
            .set_chaddr(&mac.0);
        m.opts_mut().insert(DhcpOption::MessageType(kind));
        if let Some(ip) = requested {
            m.opts_mut().insert(DhcpOption::RequestedIpAddress(ip));
        }
        m
    }

    /// Round-trips through the wire format, as the guest would see it.
    fn answer(lease: &DhcpLease, req: &Message) -> Option<Message> {
        let mut bytes = Vec::new();
        req.encode(&mut Encoder::new(&mut bytes)).unwrap();
        let (out, _) = handle_datagram(lease, &bytes)?;
        Some(Message::decode(&mut Decoder::new(&out)).unwrap())
    }

    /// Options in code order, printed the way a reviewer reads them.
    fn summary(m: &Message) -> Vec<String> {
        let mut opts: Vec<_> = m
            .opts()
            .iter()
            .map(|(c, o)| (u8::from(*c), format!("{o:?}")))
            .collect();
        opts.sort();
        let mut out = vec![format!(
            "op={:?} xid={:#x} yiaddr={}",
            m.opcode(),
            m.xid(),
            m.yiaddr()
        )];
        out.extend(opts.into_iter().map(|(c, o)| format!("{c}: {o}")));
        out
    }

    #[test]
    fn offer_carries_pod_ip_routes_dns_ntp_hostname_mtu_infinite_lease() {
        let offer = answer(
            &calico_lease(),
            &request(MessageType::Discover, VM_MAC, None),
        )
        .unwrap();
        insta::assert_yaml_snapshot!(summary(&offer));
    }

    #[test]
    fn request_for_the_pod_ip_is_acked() {
        let ip = "10.244.1.5".parse().unwrap();
        let ack = answer(
            &calico_lease(),
            &request(MessageType::Request, VM_MAC, Some(ip)),
        )
        .unwrap();
        assert_eq!(ack.yiaddr(), ip);
        assert_eq!(
            ack.opts().get(OptionCode::MessageType),
            Some(&DhcpOption::MessageType(MessageType::Ack))
        );
        assert_eq!(
            ack.opts().get(OptionCode::AddressLeaseTime),
            Some(&DhcpOption::AddressLeaseTime(u32::MAX))
        );
    }

    #[test]
    fn request_for_another_ip_is_nakked() {
        let nak = answer(
            &calico_lease(),
            &request(
                MessageType::Request,
                VM_MAC,
                Some("192.168.1.9".parse().unwrap()),
            ),
        )
        .unwrap();
        assert_eq!(
            nak.opts().get(OptionCode::MessageType),
            Some(&DhcpOption::MessageType(MessageType::Nak))
        );
        assert_eq!(nak.yiaddr(), Ipv4Addr::UNSPECIFIED);
        assert!(nak.opts().get(OptionCode::AddressLeaseTime).is_none());
    }

    #[test]
    fn other_macs_and_garbage_get_no_answer() {
        let other = MacAddr([0x02, 1, 2, 3, 4, 5]);
        assert!(
            answer(
                &calico_lease(),
                &request(MessageType::Discover, other, None)
            )
            .is_none()
        );
        assert!(handle_datagram(&calico_lease(), b"not dhcp").is_none());
        assert!(
            answer(
                &calico_lease(),
                &request(MessageType::Release, VM_MAC, None)
            )
            .is_none()
        );
    }
}
