//! handoff's benchmarks (`handoff bench ...`): each prints what it ran with, a table, and (with
//! `--json`) one JSON object on the last line, with ratios against a baseline measured in the
//! same run. Also the local-cluster harness they share with `handoff demo`: engines as child
//! processes of the `handoff` binary ([`cluster`]), network namespaces ([`netns`]) and the
//! charts of `--report` ([`report`]).

pub mod cluster;
pub mod netns;
pub mod report;

mod connector;
mod descriptors;
mod ledger;
mod soak;
mod timeline;
mod transfer;
mod ttft;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Cost per ledger event and per idle tick with 1k, 10k and 100k handoffs in flight.
    Ledger {
        /// Print the report as one JSON object on the last line.
        #[arg(long)]
        json: bool,
        /// Handoffs in flight to measure at (comma separated).
        #[arg(long, value_delimiter = ',', default_values_t = vec![1_000usize, 10_000, 100_000])]
        sizes: Vec<usize>,
        /// Also write DIR/ledger.html (cost by handoffs in flight, drawn) and DIR/ledger.json.
        #[arg(long, value_name = "DIR")]
        report: Option<std::path::PathBuf>,
    },
    /// Cost of carrying one request through a P and a D connector core, and of an idle
    /// timeout, with 1k and 100k other handoffs in flight.
    Connector {
        /// Print the report as one JSON object on the last line.
        #[arg(long)]
        json: bool,
        /// Handoffs in flight to measure at (comma separated).
        #[arg(long, value_delimiter = ',', default_values_t = vec![1_000usize, 100_000])]
        sizes: Vec<usize>,
    },
    /// Memory soak: many short requests through the proxy (a share abandoned mid-stream) into
    /// a P and a D engine, and their RSS growth per 1,000 requests once every bound filled.
    Soak(soak::SoakArgs),
    /// tcp and nixl throughput (READ and WRITE, scattered 4 KiB / 64 KiB / 1 MiB blocks and a
    /// real model's blocks, two processes) against raw TCP, raw NIXL and memcpy.
    Transfer(transfer::TransferArgs),
    /// What a pool layout costs NIXL: one handoff's bytes READ as a descriptor per block and
    /// layer against a descriptor per layer, raw NIXL, host or GPU memory (`--memory vram`).
    Descriptors(descriptors::DescriptorsArgs),
    /// Time to first token through pull, through push and on one monolithic engine (by default
    /// prompts of 512, 2048 and 8192 tokens, concurrency 1 and 8), with the ratios between them
    /// and each case's timeline broken down into phases.
    Ttft(ttft::TtftArgs),
    /// The peer process of `bench transfer` (serves until stdin closes).
    #[command(hide = true)]
    TransferPeer(transfer::PeerArgs),
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Ledger {
            json,
            sizes,
            report,
        } => ledger::run(&sizes, json, report.as_deref()),
        BenchCommand::Connector { json, sizes } => connector::run(&sizes, json),
        BenchCommand::Soak(args) => soak::run(args),
        BenchCommand::Descriptors(args) => descriptors::run(args),
        BenchCommand::Transfer(args) => transfer::run(args),
        BenchCommand::TransferPeer(args) => transfer::peer(args),
        BenchCommand::Ttft(args) => ttft::run(args),
    }
}
