//! `handoff bench ...`: each benchmark prints what it ran with, a table, and (with `--json`) one
//! JSON object on the last line.

mod ledger;

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
    },
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Ledger { json, sizes } => ledger::run(&sizes, json),
    }
}
