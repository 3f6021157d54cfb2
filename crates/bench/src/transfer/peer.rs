//! The peer process (`handoff bench transfer-peer`) and this process's handle on it; the
//! transports and the cluster key both sides open.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use handoff_transport::auth::ClusterKey;
use handoff_transport::conformance::{from_hex, to_hex};
use handoff_transport::nixl::{NixlConfig, NixlTransport};
use handoff_transport::tcp::{TcpConfig, TcpTransport};
use handoff_transport::{Extent, GrantId, KvRegion, RegionId, Transport, XferOp};

use super::cases::{build, fill, median, remote_hash, Layout};
use super::{peer_host, PeerArgs, HOSTS, NETNS_NODES, PEER_SEED};

pub(super) fn open_transport(
    backend: &str,
    name: &str,
    nixl: &NixlConfig,
    host: &str,
) -> anyhow::Result<Arc<dyn Transport>> {
    Ok(match backend {
        "tcp" => {
            // As engines run it: every connection proves the cluster key, and the target serves
            // only what it granted (the peer grants its regions to the initiator it loads).
            let cfg = TcpConfig {
                bind: std::net::SocketAddr::new(host.parse()?, 0),
                advertise_host: Some(host.to_string()),
                key: Some(bench_key()?),
                check_grants: true,
                ..TcpConfig::from_env()
            };
            TcpTransport::new(name, cfg)? as Arc<dyn Transport>
        }
        "nixl" => NixlTransport::open(name, nixl.clone())? as Arc<dyn Transport>,
        other => bail!("unknown backend {other:?} (tcp or nixl)"),
    })
}

/// The cluster key of a run: made by the benchmark, handed to its peer in the environment.
fn bench_key() -> anyhow::Result<ClusterKey> {
    static KEY: std::sync::OnceLock<ClusterKey> = std::sync::OnceLock::new();
    if let Some(k) = KEY.get() {
        return Ok(k.clone());
    }
    let k = match std::env::var(BENCH_KEY_ENV) {
        Ok(hex) => ClusterKey::from_hex(&hex)?,
        Err(_) => ClusterKey::generate()?,
    };
    Ok(KEY.get_or_init(|| k).clone())
}

const BENCH_KEY_ENV: &str = "HANDOFF_BENCH_CLUSTER_KEY";

/// Median time of the cluster-key handshake (both proofs) between two ends over loopback: what
/// authentication adds to each new connection of a peer pair.
pub(super) fn handshake_ms(n: usize) -> anyhow::Result<f64> {
    let key = bench_key()?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut times = Vec::with_capacity(n);
    let limit = Duration::from_secs(5);
    std::thread::scope(|sc| -> anyhow::Result<()> {
        for _ in 0..n {
            let acceptor = sc.spawn(|| -> anyhow::Result<()> {
                let (s, _) = listener.accept()?;
                handoff_transport::auth::accept(&s, &key, "tcp", "bench-target", limit)?;
                Ok(())
            });
            let t0 = Instant::now();
            let s = TcpStream::connect(addr)?;
            handoff_transport::auth::dial(
                &s,
                &key,
                "tcp",
                "bench-initiator",
                "bench-target",
                limit,
            )?;
            times.push(t0.elapsed().as_secs_f64() * 1e3);
            acceptor
                .join()
                .map_err(|_| anyhow!("the acceptor panicked"))??;
        }
        Ok(())
    })?;
    Ok(median(times))
}

/// `handoff bench transfer-peer`: prints `READY <raw tcp port> <hex metadata>`, then answers
/// `LOAD <hex>` (→ `OK <name>`) and `HASH <case>` (→ `HASH <u64>`) until stdin closes.
pub fn peer(args: PeerArgs) -> anyhow::Result<()> {
    let r = serve_peer(&args);
    if let Err(e) = &r {
        println!("ERR {e:#}");
    }
    // Leave without tearing the agent down (NIXL's threads may still run).
    let _ = std::io::stdout().flush();
    std::process::exit(if r.is_ok() { 0 } else { 1 });
}

fn serve_peer(args: &PeerArgs) -> anyhow::Result<()> {
    let layout = Arc::new(build(args.total_mib)?);
    let cfg = NixlConfig {
        progress_delay_us: args.progress_delay_us,
        ..NixlConfig::from_env()
    };
    let name = format!("bench-peer-{}", std::process::id());
    let t = open_transport(&args.backend, &name, &cfg, &args.host)?;
    let mut regions = Vec::new();
    for (class, (&len, &chunk)) in layout.lens.iter().zip(&layout.chunks).enumerate() {
        let r = Arc::new(KvRegion::new(len, chunk));
        fill(&r, PEER_SEED ^ class as u64)?;
        t.register(class as RegionId, r.clone())?;
        regions.push(r);
    }
    let regions = Arc::new(regions);
    let listener = TcpListener::bind((args.host.as_str(), 0))?;
    let port = listener.local_addr()?.port();
    {
        let (regions, layout) = (regions.clone(), layout.clone());
        std::thread::spawn(move || {
            for s in listener.incoming().flatten() {
                let (regions, layout) = (regions.clone(), layout.clone());
                std::thread::spawn(move || {
                    if let Err(e) = serve_raw_tcp(s, &regions, &layout) {
                        eprintln!("transfer-peer: raw tcp: {e:#}");
                    }
                });
            }
        });
    }
    let md = t.local_metadata()?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "READY {port} {}", to_hex(&md))?;
    out.flush()?;
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let reply = match words.as_slice() {
            ["LOAD", hex] => match from_hex(hex).map(|md| t.load_remote(&md)) {
                Some(Ok(name)) => match grant_all(t.as_ref(), &name, &regions) {
                    Ok(()) => format!("OK {name}"),
                    Err(e) => format!("ERR {e}"),
                },
                Some(Err(e)) => format!("ERR {e}"),
                None => "ERR bad hex".into(),
            },
            ["HASH", i] => match i.parse::<usize>().ok().and_then(|i| layout.cases.get(i)) {
                Some(case) => match remote_hash(&regions[case.class], case) {
                    Ok(h) => format!("HASH {h}"),
                    Err(e) => format!("ERR {e:#}"),
                },
                None => "ERR no such case".into(),
            },
            _ => format!("ERR unknown command {line:?}"),
        };
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    Ok(())
}

/// Lets `peer` read and write every region (a transport that checks grants serves only those).
fn grant_all(t: &dyn Transport, peer: &str, regions: &[Arc<KvRegion>]) -> anyhow::Result<()> {
    let extents: Vec<Extent> = (0..)
        .zip(regions)
        .map(|(region, r)| Extent {
            region,
            offset: 0,
            len: r.len() as u64,
        })
        .collect();
    let peers = [peer.to_string()];
    t.grant(GrantId(1), XferOp::Read, &peers, &extents)?;
    t.grant(GrantId(2), XferOp::Write, &peers, &extents)?;
    Ok(())
}

/// Raw TCP, target side: `[op, case, stage]` then, for READ (0), the stage's remote blocks in
/// order; for WRITE (1), receive them in order and answer one byte.
pub(super) fn serve_raw_tcp(
    mut s: TcpStream,
    regions: &[Arc<KvRegion>],
    layout: &Layout,
) -> anyhow::Result<()> {
    s.set_nodelay(true)?;
    loop {
        let mut hdr = [0u8; 3];
        match s.read_exact(&mut hdr) {
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            r => r?,
        }
        let case = layout
            .cases
            .get(hdr[1] as usize)
            .ok_or_else(|| anyhow!("no case {}", hdr[1]))?;
        let region = &regions[case.class];
        let stage = case
            .stage_descs()
            .nth(hdr[2] as usize)
            .ok_or_else(|| anyhow!("no stage {}", hdr[2]))?;
        for d in stage {
            let (off, len) = (d.remote_offset as usize, d.len as usize);
            if hdr[0] == 0 {
                region.with_span(off, len, |p| s.write_all(p))??;
            } else {
                region.with_span_mut(off, len, |p| s.read_exact(p))??;
            }
        }
        if hdr[0] == 1 {
            s.write_all(&[1])?;
        }
    }
}

/// `--netns`: makes the two hosts, runs this same bench on `local` (the peer goes on `peer`),
/// removes them, and exits as the bench did.
pub(super) fn run_in_namespaces() -> anyhow::Result<()> {
    if let Some(why) = crate::netns::unavailable() {
        bail!("bench transfer --netns needs network namespaces (root and iproute2): {why}");
    }
    let net = crate::netns::Net::create(&NETNS_NODES)?;
    let status = net
        .rerun_inside("local")
        .context("cannot run the bench inside the namespaces")?;
    drop(net);
    if !status.success() {
        bail!("the bench inside the namespaces failed ({status})");
    }
    Ok(())
}

/// The child process, from this side.
pub(super) struct Peer {
    pub(super) child: Child,
    pub(super) stdin: Option<ChildStdin>,
    pub(super) stdout: BufReader<ChildStdout>,
    pub(super) raw_port: u16,
    pub(super) md: Vec<u8>,
}

impl Peer {
    pub(super) fn spawn(backend: &str, total_mib: usize, delay_us: u64) -> anyhow::Result<Peer> {
        let exe = std::env::current_exe()?;
        let mut cmd = match HOSTS.get() {
            Some(h) => {
                let mut c = h.net.exec("peer");
                c.arg(exe);
                c
            }
            None => Command::new(exe),
        };
        let mut child = cmd
            .args(["bench", "transfer-peer", "--backend", backend])
            .args(["--host", peer_host()])
            .args(["--total-mib", &total_mib.to_string()])
            .args(["--progress-delay-us", &delay_us.to_string()])
            .env(BENCH_KEY_ENV, bench_key()?.to_hex())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawning the transfer peer")?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        let mut p = Peer {
            child,
            stdin,
            stdout,
            raw_port: 0,
            md: Vec::new(),
        };
        let line = p.line()?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["READY", port, hex] => {
                p.raw_port = port.parse()?;
                p.md = from_hex(hex).ok_or_else(|| anyhow!("peer sent bad hex"))?;
            }
            _ => bail!("{backend} peer: {line}"),
        }
        Ok(p)
    }

    pub(super) fn line(&mut self) -> anyhow::Result<String> {
        let mut s = String::new();
        if self.stdout.read_line(&mut s)? == 0 {
            bail!("the peer exited");
        }
        Ok(s.trim_end().to_string())
    }

    pub(super) fn cmd(&mut self, cmd: &str) -> anyhow::Result<String> {
        let stdin = self.stdin.as_mut().expect("open until drop");
        writeln!(stdin, "{cmd}")?;
        stdin.flush()?;
        let reply = self.line()?;
        if reply.starts_with("ERR") {
            bail!("peer: {reply}");
        }
        Ok(reply)
    }

    pub(super) fn hash(&mut self, case: usize) -> anyhow::Result<u64> {
        let r = self.cmd(&format!("HASH {case}"))?;
        r.strip_prefix("HASH ")
            .and_then(|h| h.parse().ok())
            .ok_or_else(|| anyhow!("peer: {r}"))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
