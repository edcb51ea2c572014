//! The Pod's resolv.conf: DNS servers and search domains handed to the guest by DHCP.

use std::net::Ipv4Addr;

/// What the guest's resolver needs from resolv.conf.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ResolvConf {
    /// IPv4 name servers in order.
    pub nameservers: Vec<Ipv4Addr>,
    /// Search domains in order.
    pub search: Vec<String>,
}

/// Parses resolv.conf text; unknown lines and IPv6 servers are ignored (no IPv6 in bridge mode).
pub fn parse(text: &str) -> ResolvConf {
    let mut out = ResolvConf::default();
    for line in text.lines() {
        let line = line.split(['#', ';']).next().unwrap_or("");
        let mut words = line.split_whitespace();
        match words.next() {
            Some("nameserver") => {
                if let Some(ip) = words.next().and_then(|w| w.parse().ok()) {
                    out.nameservers.push(ip);
                }
            }
            // The last search/domain line wins, as in glibc.
            Some("search") | Some("domain") => {
                out.search = words.map(|w| w.trim_end_matches('.').to_string()).collect();
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_kubernetes_pod_resolv_conf() {
        let r = super::parse(
            "search default.svc.cluster.local svc.cluster.local cluster.local\n\
             nameserver 10.96.0.10\nnameserver fd00::10\noptions ndots:5\n# nameserver 1.1.1.1\n",
        );
        assert_eq!(
            r.nameservers,
            vec!["10.96.0.10".parse::<std::net::Ipv4Addr>().unwrap()]
        );
        assert_eq!(
            r.search,
            [
                "default.svc.cluster.local",
                "svc.cluster.local",
                "cluster.local"
            ]
        );
    }
}
