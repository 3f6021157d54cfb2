//! Hosts made of network namespaces, for `handoff demo --netns` and the multi-host tests: each
//! node is a namespace with one address on a bridge that lives in a hub namespace of its own,
//! so nothing is added to the host's own network. Needs root and iproute2 (`ip`).

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{bail, Context};

static NEXT_NET: AtomicU32 = AtomicU32::new(0);

/// Runs `ip` with `args`; the error names the command and what `ip` said.
pub fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("cannot run ip (iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Why network namespaces cannot be used here, if they cannot. Probed once per process: the
/// tests ask from many threads at once, and one probe namespace name per process is enough.
pub fn unavailable() -> Option<String> {
    static PROBE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    PROBE.get_or_init(probe).clone()
}

fn probe() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let root = status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .is_some_and(|l| l.split_whitespace().nth(1) == Some("0"));
    if !root {
        return Some("needs root".into());
    }
    let probe = format!("hoprobe{}", std::process::id());
    ip(&["netns", "add", &probe])
        .and_then(|()| ip(&["netns", "del", &probe]))
        .err()
        .map(|e| format!("{e:#}"))
}

/// Hosts on one bridge: node i is namespace `<prefix><name>` at `10.199.<subnet>.<i + 2>`.
pub struct Net {
    pub prefix: String,
    pub subnet: u32,
    pub nodes: Vec<String>,
    /// Whether dropping this removes the namespaces (the process that made them).
    owner: bool,
}

impl Net {
    /// Creates the hub and one namespace per node.
    pub fn create(nodes: &[&str]) -> anyhow::Result<Net> {
        let n = NEXT_NET.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let mut net = Net {
            prefix: format!("h{}n{}", pid % 10_000, n),
            subnet: 100 + (pid % 100 + n * 7) % 150,
            nodes: Vec::new(),
            owner: true,
        };
        let hub = net.hub();
        ip(&["netns", "add", &hub])?;
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        for name in nodes {
            net.add(name)?;
        }
        Ok(net)
    }

    /// The same hosts, seen from a process that did not make them (it leaves them in place).
    pub fn attach(prefix: &str, subnet: u32, nodes: &[&str]) -> Net {
        Net {
            prefix: prefix.into(),
            subnet,
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
            owner: false,
        }
    }

    pub fn hub(&self) -> String {
        format!("{}hub", self.prefix)
    }

    pub fn ns(&self, name: &str) -> String {
        format!("{}{}", self.prefix, self.index(name))
    }

    fn index(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .position(|n| n == name)
            .unwrap_or(usize::MAX)
    }

    pub fn addr(&self, name: &str) -> String {
        format!("10.199.{}.{}", self.subnet, self.index(name) + 2)
    }

    /// The hub's end of a node's link.
    fn port(&self, name: &str) -> String {
        format!("{}{}b", self.prefix, self.index(name))
    }

    fn add(&mut self, name: &str) -> anyhow::Result<()> {
        self.nodes.push(name.to_string());
        let i = self.nodes.len() - 1;
        let (ns, hub) = (self.ns(name), self.hub());
        let (a, b) = (format!("{}{i}a", self.prefix), self.port(name));
        ip(&["netns", "add", &ns])?;
        ip(&["link", "add", &a, "type", "veth", "peer", "name", &b])?;
        ip(&["link", "set", &a, "netns", &ns])?;
        ip(&["link", "set", &b, "netns", &hub])?;
        ip(&["-n", &ns, "link", "set", &a, "name", "eth0"])?;
        let cidr = format!("{}/24", self.addr(name));
        ip(&["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
        ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        ip(&["-n", &hub, "link", "set", &b, "master", "br0"])?;
        ip(&["-n", &hub, "link", "set", &b, "up"])
    }

    /// Partitions a node: its link goes down at the hub, so nothing it sends arrives and no FIN
    /// or RST reaches anyone.
    pub fn cut(&self, name: &str) -> anyhow::Result<()> {
        ip(&["-n", &self.hub(), "link", "set", &self.port(name), "down"])
    }

    pub fn heal(&self, name: &str) -> anyhow::Result<()> {
        ip(&["-n", &self.hub(), "link", "set", &self.port(name), "up"])
    }

    /// Runs this same binary, with this process's arguments and `--netns-inside PREFIX:SUBNET`
    /// (how the inner run attaches to these hosts), on node `name`, and waits for it.
    pub fn rerun_inside(&self, name: &str) -> std::io::Result<std::process::ExitStatus> {
        self.exec(name)
            .arg(std::env::current_exe()?)
            .args(std::env::args().skip(1))
            .args([
                "--netns-inside",
                &format!("{}:{}", self.prefix, self.subnet),
            ])
            .status()
    }

    /// Makes each `(address, name)` of `entries` resolve inside node `node` only: the node's
    /// hosts file, `/etc/netns/<namespace>/hosts`, which `ip netns exec` mounts over
    /// `/etc/hosts` for what it starts there (write it before starting them). Rewritten in
    /// place, so a process already running in the node sees a change at its next lookup.
    pub fn write_hosts(&self, node: &str, entries: &[(&str, &str)]) -> std::io::Result<()> {
        let dir = format!("/etc/netns/{}", self.ns(node));
        std::fs::create_dir_all(&dir)?;
        let mut text = String::from("127.0.0.1 localhost\n");
        for (addr, name) in entries {
            text.push_str(&format!("{addr} {name}\n"));
        }
        // `fs::write` truncates the file it opens: the same inode, the one mounted.
        std::fs::write(format!("{dir}/hosts"), text)
    }

    /// `ip netns exec <node's namespace>`, ready for the program and its arguments.
    pub fn exec(&self, name: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(name)]);
        c
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        if !self.owner {
            return;
        }
        for name in self.nodes.clone() {
            let ns = self.ns(&name);
            let _ = ip(&["netns", "del", &ns]);
            // The hosts file `write_hosts` may have made.
            let _ = std::fs::remove_dir_all(format!("/etc/netns/{ns}"));
        }
        let _ = ip(&["netns", "del", &self.hub()]);
    }
}
