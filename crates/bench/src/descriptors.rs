//! `handoff bench descriptors`: what a pool layout costs NIXL. The same bytes (a handoff of
//! `layers` × `blocks` blocks of `block_bytes` per layer) are READ by the bare C API
//! ([`raw::RawSession`]) as one descriptor per block and layer — what a layer range of a
//! blocks-outermost pool is cut into — and as one descriptor per layer — what a contiguous run
//! of a layers-outermost pool is. Host memory, or GPU memory (`--memory vram`: CUDA's driver is
//! loaded at run time), so the ratio can be read on the hardware where descriptors cost most.
//! The two cases alternate, repetition by repetition, in one process.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use handoff_transport::nixl::raw::{self, RawMemory, RawSession, RawSpec};
use handoff_transport::nixl::NixlConfig;
use handoff_transport::XferOp;
use serde::Serialize;

#[derive(Args, Debug, Clone)]
pub struct DescriptorsArgs {
    /// Print the report as one JSON object on the last line.
    #[arg(long)]
    json: bool,
    /// Layers of the model (a descriptor each in the per-layer case).
    #[arg(long, default_value_t = 32)]
    layers: usize,
    /// KV blocks of the handoff, contiguous on both sides.
    #[arg(long, default_value_t = 64)]
    blocks: usize,
    /// Bytes of one block in one layer (K and V: 8 KV heads × 128 × 16 tokens × 2 × 2 bytes).
    #[arg(long, default_value_t = 65_536)]
    block_bytes: usize,
    /// Timed READs per case (after one checked warm-up each).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// dram (host memory) or vram (GPU 0, through the CUDA driver).
    #[arg(long, default_value = "dram")]
    memory: String,
}

#[derive(Serialize)]
struct Case {
    descriptors: usize,
    bytes: u64,
    median_ms: f64,
    gbps: f64,
}

#[derive(Serialize)]
struct Report {
    memory: String,
    layers: usize,
    blocks: usize,
    block_bytes: usize,
    per_block: Case,
    per_layer: Case,
    /// per_layer.gbps / per_block.gbps: what coalescing buys.
    per_layer_vs_per_block: f64,
}

pub fn run(args: DescriptorsArgs) -> anyhow::Result<()> {
    let memory = match args.memory.as_str() {
        "dram" => RawMemory::Dram,
        "vram" => RawMemory::Vram,
        other => anyhow::bail!("--memory {other:?}: expected dram or vram"),
    };
    anyhow::ensure!(
        args.layers > 0 && args.blocks > 0 && args.block_bytes > 0 && args.iters > 0,
        "--layers, --blocks, --block-bytes and --iters must be at least 1"
    );
    let cfg = NixlConfig::from_env();
    let spec = |blocks: usize, block_size: usize| RawSpec {
        op: XferOp::Read,
        block_size,
        blocks,
        iters: args.iters,
        notify: false,
        poll: Duration::ZERO,
        memory,
    };
    let mut per_block = RawSession::new(&cfg, &spec(args.layers * args.blocks, args.block_bytes))
        .context("raw NIXL, a descriptor per block and layer")?;
    let mut per_layer = RawSession::new(&cfg, &spec(args.layers, args.blocks * args.block_bytes))
        .context("raw NIXL, a descriptor per layer")?;
    for s in [&mut per_block, &mut per_layer] {
        s.once()?;
        s.check()?;
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..args.iters {
        a.push(per_block.once()?);
        b.push(per_layer.once()?);
    }
    let case = |s: &RawSession, descriptors: usize, secs: &[f64]| {
        let gbps = raw::median_gbps(s.bytes(), secs);
        Case {
            descriptors,
            bytes: s.bytes(),
            median_ms: s.bytes() as f64 / gbps / 1e6,
            gbps,
        }
    };
    let r = Report {
        memory: args.memory.clone(),
        layers: args.layers,
        blocks: args.blocks,
        block_bytes: args.block_bytes,
        per_block: case(&per_block, args.layers * args.blocks, &a),
        per_layer: case(&per_layer, args.layers, &b),
        per_layer_vs_per_block: 0.0,
    };
    let r = Report {
        per_layer_vs_per_block: r.per_layer.gbps / r.per_block.gbps,
        ..r
    };
    println!(
        "bench descriptors — raw NIXL READ of {} MiB ({} layers × {} blocks × {} B), {} memory, backend {}",
        r.per_block.bytes >> 20,
        r.layers,
        r.blocks,
        r.block_bytes,
        r.memory,
        cfg.backend
    );
    for (name, c) in [
        ("a descriptor per block and layer", &r.per_block),
        ("a descriptor per layer", &r.per_layer),
    ] {
        println!(
            "  {name:>34}: {:>6} descriptors, {:>8.3} ms, {:>7.2} GB/s",
            c.descriptors, c.median_ms, c.gbps
        );
    }
    println!("  per_layer_vs_per_block {:.2}", r.per_layer_vs_per_block);
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
    }
    Ok(())
}
