//! Addresses as operators write them in vLLM's extra config: an IP literal or a DNS name (a
//! Kubernetes Service, a pod's hostname, an `/etc/hosts` entry), resolved when a listener binds,
//! and the address peers are told to dial. A listener on an unspecified address (`0.0.0.0`,
//! `::`) must be told which address peers reach it at: advertising `0.0.0.0` would send every
//! peer to itself. Names peers are told are resolved by them, at each dial, so a peer that
//! restarts under the same name with a new IP is found again.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

/// A configured address that cannot be used; `setting` names the extra-config key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    #[error("{setting}: empty host")]
    Empty { setting: &'static str },
    #[error("{setting} {host:?} does not resolve: {why}")]
    Unresolved {
        setting: &'static str,
        host: String,
        why: String,
    },
    #[error("{setting} {value:?}: expected host:port with a port number")]
    NotHostPort {
        setting: &'static str,
        value: String,
    },
    #[error(
        "advertise_host must be set when {setting} is {ip} (an unspecified address): peers need \
         an address they can reach (the pod's IP or a name that resolves to it)"
    )]
    NotAdvertised { setting: &'static str, ip: IpAddr },
    #[error("advertise_host {0:?} is an unspecified address: give one peers can dial")]
    UnspecifiedAdvertised(String),
    #[error(
        "{setting}: port {port} + rank {rank} is past 65535 (each rank listens on port + rank)"
    )]
    PortPastEnd {
        setting: &'static str,
        port: u16,
        rank: u16,
    },
}

/// `host` (an IP literal, `[v6]` or a name) and `port`, resolved to the address a listener
/// binds.
pub fn resolve_bind(
    setting: &'static str,
    host: &str,
    port: u16,
) -> Result<SocketAddr, AddressError> {
    let host = host.trim();
    if host.is_empty() {
        return Err(AddressError::Empty { setting });
    }
    let unresolved = |why: String| AddressError::Unresolved {
        setting,
        host: host.to_string(),
        why,
    };
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    (bare, port)
        .to_socket_addrs()
        .map_err(|e| unresolved(e.to_string()))?
        .next()
        .ok_or_else(|| unresolved("no address".into()))
}

/// `host:port` (`[v6]:port` for an IPv6 literal) split.
pub fn split_host_port<'a>(
    setting: &'static str,
    s: &'a str,
) -> Result<(&'a str, u16), AddressError> {
    s.trim()
        .rsplit_once(':')
        .and_then(|(host, port)| Some((host, port.parse().ok()?)))
        .ok_or_else(|| AddressError::NotHostPort {
            setting,
            value: s.to_string(),
        })
}

/// The host peers are told to dial for a listener bound at `bind` (`setting` names the bind's
/// key): `advertise` when given (a name or an address, never an unspecified one), else the
/// bound address unless it is unspecified.
pub fn advertised(
    setting: &'static str,
    bind: &SocketAddr,
    advertise: Option<&str>,
) -> Result<String, AddressError> {
    match advertise.map(str::trim).filter(|a| !a.is_empty()) {
        Some(a) => {
            let bare = a.trim_start_matches('[').trim_end_matches(']');
            if bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_unspecified()) {
                return Err(AddressError::UnspecifiedAdvertised(a.to_string()));
            }
            Ok(a.to_string())
        }
        None if bind.ip().is_unspecified() => Err(AddressError::NotAdvertised {
            setting,
            ip: bind.ip(),
        }),
        None => Ok(bind.ip().to_string()),
    }
}

/// The port rank `rank` listens on when `port` is rank 0's: `port + rank`, so that a firewall
/// opens `port .. port + tp`; 0 stays 0 (any free port).
pub fn rank_port(setting: &'static str, port: u16, rank: u16) -> Result<u16, AddressError> {
    if port == 0 {
        return Ok(0);
    }
    port.checked_add(rank).ok_or(AddressError::PortPastEnd {
        setting,
        port,
        rank,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_literals_resolve_and_a_bad_name_says_which_setting() {
        assert_eq!(
            resolve_bind("side_channel_host", "127.0.0.1", 7000).unwrap(),
            "127.0.0.1:7000".parse().unwrap()
        );
        assert_eq!(
            resolve_bind("side_channel_host", "[::1]", 7000).unwrap(),
            "[::1]:7000".parse().unwrap()
        );
        // `localhost` comes from /etc/hosts, as a name an operator writes does.
        assert!(resolve_bind("side_channel_host", "localhost", 0)
            .unwrap()
            .ip()
            .is_loopback());
        let e = resolve_bind("side_channel_host", "no-such-host.invalid", 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("side_channel_host") && e.contains("no-such-host.invalid"),
            "{e}"
        );
        assert!(resolve_bind("side_channel_host", " ", 0).is_err());
    }

    #[test]
    fn an_unspecified_bind_needs_an_advertised_address() {
        let any: SocketAddr = "0.0.0.0:5600".parse().unwrap();
        let e = advertised("side_channel_host", &any, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("advertise_host must be set") && e.contains("0.0.0.0"),
            "{e}"
        );
        assert_eq!(
            advertised("side_channel_host", &any, Some("p-0.p.svc")).unwrap(),
            "p-0.p.svc"
        );
        assert!(advertised("side_channel_host", &any, Some("0.0.0.0")).is_err());
        assert!(advertised("side_channel_host", &any, Some("[::]")).is_err());
        let one: SocketAddr = "10.1.2.3:5600".parse().unwrap();
        assert_eq!(
            advertised("side_channel_host", &one, None).unwrap(),
            "10.1.2.3"
        );
    }

    #[test]
    fn each_rank_has_its_own_data_port() {
        assert_eq!(rank_port("data_bind", 0, 3), Ok(0));
        assert_eq!(rank_port("data_bind", 5700, 0), Ok(5700));
        assert_eq!(rank_port("data_bind", 5700, 3), Ok(5703));
        assert!(rank_port("data_bind", 65535, 1).is_err());
        assert_eq!(
            split_host_port("data_bind", "[::1]:5700"),
            Ok(("[::1]", 5700))
        );
        assert_eq!(
            split_host_port("data_bind", "d-0.d.svc:0"),
            Ok(("d-0.d.svc", 0))
        );
        assert!(split_host_port("data_bind", "d-0.d.svc").is_err());
    }
}
