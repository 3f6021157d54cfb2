//! A worker process for the connector's cross-process test: serves the worker sides of every
//! rank of an engine for a scheduler side in another process (as vLLM's worker processes do).
//! Each rank's KV region is filled with a seeded pattern (`conformance::fill`, seed + rank) and
//! served over the tcp transport.
//!
//! Usage: `handoff-connector-worker <scheduler addr> <engine id> <spec json> <blocks> <seed>`

use std::sync::Arc;

use handoff_connector::{remote, RankMemory, WorkerSide};
use handoff_plan::{KvSpec, RankLayout};
use handoff_transport::conformance::fill;
use handoff_transport::tcp::{TcpConfig, TcpTransport};
use handoff_transport::KvRegion;

fn main() {
    if let Err(e) = run() {
        eprintln!("handoff-connector-worker: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let [_, addr, engine, spec, blocks, seed] = &args[..] else {
        return Err("usage: <scheduler addr> <engine id> <spec json> <blocks> <seed>".into());
    };
    let addr = addr.parse().map_err(|e| format!("bad address: {e}"))?;
    let spec: KvSpec = serde_json::from_str(spec).map_err(|e| format!("bad spec: {e}"))?;
    let blocks: u32 = blocks.parse().map_err(|_| "bad block count")?;
    let seed: u64 = seed.parse().map_err(|_| "bad seed")?;
    let mut workers = Vec::new();
    for rank in 0..spec.tp {
        let layout = RankLayout::cross_layer(spec, rank, blocks, 0).map_err(|e| e.to_string())?;
        let len = layout.region_len(0).ok_or("no region 0")? as usize;
        let region = Arc::new(KvRegion::new(len, 64 * 1024));
        fill(&region, seed + rank as u64, 0);
        let transport = TcpTransport::new(&format!("{engine}-r{rank}"), TcpConfig::default())
            .map_err(|e| e.to_string())?;
        workers.push(
            WorkerSide::new(RankMemory {
                layout,
                regions: vec![(0, region)],
                transport,
            })
            .map_err(|e| e.to_string())?,
        );
    }
    remote::serve(addr, workers).map_err(|e| e.to_string())
}
