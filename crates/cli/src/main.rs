//! `handoff`: the one binary. It only parses flags and wires the crates together.

mod bench;

use clap::{Parser, Subcommand};

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
    /// Benchmarks that print ratios against a baseline measured in the same run.
    Bench {
        #[command(subcommand)]
        which: bench::BenchCommand,
    },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Bench { which } => bench::run(which),
    }
}
