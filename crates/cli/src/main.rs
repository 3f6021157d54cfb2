//! `handoff`: the one binary. It only parses flags and wires the crates together. In the book
//! (`docs/` in the repository): `docs/src/reference/cli.md`.

#![forbid(unsafe_code)]

mod demo;
mod engine_cmd;
mod replay_cmd;

use handoff_bench as bench;

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Parser, Subcommand};

/// Every engine, proxy and benchmark process of this binary allocates through mimalloc: with
/// glibc's malloc an engine's resident memory crept up by about 1-2 bytes per request over
/// hundreds of thousands of requests (its per-thread arenas fragmenting; one arena made it flat),
/// with no table of handoff's growing.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "handoff",
    version,
    about = "Moves a prompt's KV cache from prefill to decode, and never strands a block"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// A P/D cluster on loopback under a faulty workload, with a report (the first command to try).
    Demo(demo::DemoArgs),
    /// The reference engine (prefill, decode or both).
    Engine(engine_cmd::EngineArgs),
    /// The P/D router.
    Proxy(ProxyArgs),
    /// Writes a new cluster key (64 hex digits) to a file only its owner can read: give every
    /// engine of the cluster the same file (`--set cluster_key_file=PATH`).
    Keygen {
        /// Where to write it (refuses to overwrite).
        #[arg(long, default_value = "handoff-cluster.key")]
        out: std::path::PathBuf,
    },
    /// Feeds a trace an engine recorded (`record_trace`) through a fresh connector core: which
    /// rule the recorded run broke, after which input, and whether today's core does the same.
    Replay(replay_cmd::ReplayArgs),
    /// Benchmarks that print ratios against a baseline measured in the same run.
    Bench {
        #[command(subcommand)]
        which: bench::BenchCommand,
    },
}

#[derive(clap::Args)]
struct ProxyArgs {
    #[arg(long, default_value = "127.0.0.1:8000")]
    bind: SocketAddr,
    /// Prefill engine base URL (repeatable).
    #[arg(long)]
    prefill: Vec<String>,
    /// Decode engine base URL (repeatable).
    #[arg(long)]
    decode: Vec<String>,
    /// round-robin or least-loaded.
    #[arg(long, default_value = "round-robin")]
    policy: String,
    /// pull or push (push: every P answers `GET /v1/handoff/info`).
    #[arg(long, default_value = "pull")]
    mode: String,
    /// Time between two health checks of every instance.
    #[arg(long, default_value_t = 1000)]
    health_interval_ms: u64,
    /// Limit of one health check (`GET /health`, and `/ready` where the engine has it).
    #[arg(long, default_value_t = 1000)]
    health_timeout_ms: u64,
    /// Health checks in a row without an answer in time before a healthy instance is taken out
    /// (a busy engine answers late); no connection (refused, or not made within half the
    /// check's limit) or an error status takes it out at once.
    #[arg(long, default_value_t = 3)]
    health_timeouts_to_fail: u32,
    /// Address of the admin API (`/admin/instances`), or `off`. Not loopback: needs a token.
    #[arg(long, default_value = "127.0.0.1:8001")]
    admin_listen: String,
    /// File holding the admin API's bearer token (at least 16 visible ASCII characters); else
    /// the HANDOFF_ADMIN_TOKEN environment variable; neither: no token (loopback only).
    #[arg(long)]
    admin_token_file: Option<std::path::PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The demo's faults are expected: its report says what happened, the log only what broke.
    let default_level = match cli.command {
        Command::Demo(_) | Command::Bench { .. } => "error",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Bench { which } => bench::run(which),
        Command::Demo(args) => demo::run(args),
        Command::Keygen { out } => keygen(&out),
        Command::Replay(args) => replay_cmd::run(args),
        Command::Engine(args) => {
            let cfg = args.resolve()?;
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?
                .block_on(handoff_engine::run(cfg))
        }
        Command::Proxy(a) => {
            let policy = match a.policy.as_str() {
                "round-robin" => handoff_proxy::Policy::RoundRobin,
                "least-loaded" => handoff_proxy::Policy::LeastLoaded,
                other => anyhow::bail!("--policy {other:?}: expected round-robin or least-loaded"),
            };
            let mode = match a.mode.as_str() {
                "pull" => handoff_proxy::TransferMode::Pull,
                "push" => handoff_proxy::TransferMode::Push,
                other => anyhow::bail!("--mode {other:?}: expected pull or push"),
            };
            let admin_bind = match a.admin_listen.as_str() {
                "off" | "none" => None,
                addr => Some(addr.parse::<SocketAddr>().map_err(|e| {
                    anyhow::anyhow!("--admin-listen {addr:?}: {e} (an address:port, or off)")
                })?),
            };
            let admin_token = match (&a.admin_token_file, std::env::var("HANDOFF_ADMIN_TOKEN")) {
                (Some(path), _) => Some(handoff_proxy::AdminToken::from_file(path)?),
                (None, Ok(t)) => Some(
                    handoff_proxy::AdminToken::new(&t)
                        .map_err(|e| e.context("HANDOFF_ADMIN_TOKEN"))?,
                ),
                (None, Err(_)) => None,
            };
            let cfg = handoff_proxy::ProxyConfig {
                bind: a.bind,
                admin_bind,
                admin_token,
                prefill: a.prefill,
                decode: a.decode,
                policy,
                mode,
                health_interval: Duration::from_millis(a.health_interval_ms),
                health_timeout: Duration::from_millis(a.health_timeout_ms),
                health_timeouts_to_fail: a.health_timeouts_to_fail,
                ..Default::default()
            };
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?
                .block_on(async {
                    let p = handoff_proxy::start(cfg).await?;
                    // One banner line on stdout (scripts read its last word, then may close
                    // the pipe); the rest goes to the log.
                    println!("handoff proxy listening on {}", p.url());
                    if let Some(admin) = p.admin_url() {
                        eprintln!("handoff proxy admin API on {admin}/admin/instances");
                    }
                    p.wait().await
                })
        }
    }
}

/// `handoff keygen`: a fresh key, written with mode 0600, never over an existing file.
fn keygen(out: &std::path::Path) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let key = handoff_connector::ClusterKey::generate()?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(out)
        .with_context(|| format!("cannot create {} (it must not exist yet)", out.display()))?;
    writeln!(f, "{}", key.to_hex())?;
    println!("wrote a cluster key to {}", out.display());
    Ok(())
}
