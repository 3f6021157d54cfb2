//! The raw-C-API baseline and the throughput comparisons against it (the latter ignored:
//! run them by name).

use super::*;

#[test]
fn nixl_raw_baseline_moves_blocks() {
    let Some(cfg) = nixl() else { return };
    for op in [XferOp::Read, XferOp::Write] {
        let r = raw::measure(
            &cfg,
            &raw::RawSpec {
                op,
                block_size: 4096,
                blocks: 64,
                iters: 3,
                notify: true,
                poll: std::time::Duration::ZERO,
                memory: raw::RawMemory::Dram,
            },
        )
        .unwrap();
        assert_eq!(r.bytes_per_xfer, 4096 * 64);
        assert_eq!(r.secs.len(), 3);
        assert!(r.gbps > 0.0);
    }
}

/// GPU memory through the same baseline: on a machine with a GPU the bytes land (checked by
/// copying both buffers back); without one, a clear error naming the CUDA driver, no panic.
#[test]
fn nixl_raw_baseline_on_gpu_memory_moves_blocks_or_says_why_not() {
    let Some(cfg) = nixl() else { return };
    let spec = raw::RawSpec {
        op: XferOp::Read,
        block_size: 4096,
        blocks: 16,
        iters: 2,
        notify: false,
        poll: std::time::Duration::ZERO,
        memory: raw::RawMemory::Vram,
    };
    match raw::measure(&cfg, &spec) {
        Ok(r) => assert_eq!(r.bytes_per_xfer, 4096 * 16),
        Err(e) => assert!(e.to_string().contains("cuda"), "{e}"),
    }
}

/// `cargo test -p handoff-transport --lib nixl_throughput -- --ignored --nocapture`: the
/// transport and the raw baseline on the same scattered blocks, 64 MiB per transfer, in
/// alternating rounds (the host is shared and noisy), median over all rounds.
#[test]
#[ignore]
fn nixl_throughput_vs_raw() {
    let Some(cfg) = nixl() else { return };
    let (rounds, per_round) = (8, 5);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "progress delay {} us, 64 MiB per transfer with a notification, median of {rounds}x{per_round} \
         (alternating nixl/raw rounds); loadavg {}",
        cfg.progress_delay_us,
        load.trim()
    );
    println!(
        "{:<6} {:>6} {:>15} {:>15} {:>13}",
        "op", "block", "nixl GB/s", "raw GB/s", "nixl/raw"
    );
    println!(
        "{:<6} {:>6} {:>15} {:>15} {:>13}",
        "", "", "median / best", "median / best", "median / best"
    );
    for block in [4usize << 10, 64 << 10, 1 << 20] {
        let blocks = (64usize << 20) / block;
        let len = raw::region_len(blocks, block);
        let p = pair(&cfg, len, block);
        p.rb.write(0, &pattern(3, len)).unwrap();
        p.ra.write(0, &pattern(5, len)).unwrap();
        let descs: Vec<XferDesc> = raw::scattered_pairs(blocks, block)
            .into_iter()
            .map(|(l, r)| desc(l, r, block as u64))
            .collect();
        for op in [XferOp::Read, XferOp::Write] {
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            for _ in 0..rounds {
                for i in 0..=per_round {
                    let t0 = Instant::now();
                    let id = p.a.post(op, p.b.name(), &descs, Some(b"n")).unwrap();
                    // Busy-poll, as the raw baseline does.
                    while p.a.status(id).unwrap() == XferStatus::InProgress {}
                    assert_eq!(p.a.status(id).unwrap(), XferStatus::Done);
                    p.a.release(id).unwrap();
                    if i > 0 {
                        ours.push(t0.elapsed().as_secs_f64());
                    }
                }
                assert_eq!(wait_notifs(&*p.b, per_round + 1).len(), per_round + 1);
                let r = raw::measure(
                    &cfg,
                    &raw::RawSpec {
                        op,
                        block_size: block,
                        blocks,
                        iters: per_round,
                        notify: true,
                        poll: std::time::Duration::ZERO,
                        memory: raw::RawMemory::Dram,
                    },
                )
                .unwrap();
                theirs.extend(r.secs);
            }
            let bytes = (blocks * block) as u64;
            let (o, t) = (
                raw::median_gbps(bytes, &ours),
                raw::median_gbps(bytes, &theirs),
            );
            let best = |v: &[f64]| bytes as f64 / v.iter().copied().fold(f64::MAX, f64::min) / 1e9;
            let (ob, tb) = (best(&ours), best(&theirs));
            println!(
                "{:<6} {:>5}K {:>6.2} / {:>5.2} {:>6.2} / {:>5.2} {:>5.2} / {:>5.2}",
                format!("{op:?}"),
                block >> 10,
                o,
                ob,
                t,
                tb,
                o / t,
                ob / tb
            );
        }
    }
}

/// Per-transfer cost with almost no bytes: 1024 scattered 64-byte blocks, READ, µs per
/// transfer (post to release), transport vs raw baseline.
#[test]
#[ignore]
fn nixl_throughput_overhead() {
    let Some(cfg) = nixl() else { return };
    let (block, blocks, iters) = (64usize, 1024usize, 200usize);
    let len = raw::region_len(blocks, block);
    let p = pair(&cfg, len, block);
    let descs: Vec<XferDesc> = raw::scattered_pairs(blocks, block)
        .into_iter()
        .map(|(l, r)| desc(l, r, block as u64))
        .collect();
    let mut ours = Vec::new();
    for _ in 0..iters {
        let t0 = Instant::now();
        let id = p.a.post(XferOp::Read, p.b.name(), &descs, None).unwrap();
        while p.a.status(id).unwrap() == XferStatus::InProgress {}
        p.a.release(id).unwrap();
        ours.push(t0.elapsed().as_secs_f64());
    }
    let r = raw::measure(
        &cfg,
        &raw::RawSpec {
            op: XferOp::Read,
            block_size: block,
            blocks,
            iters,
            notify: false,
            poll: std::time::Duration::ZERO,
            memory: raw::RawMemory::Dram,
        },
    )
    .unwrap();
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2] * 1e6
    };
    let mut theirs = r.secs;
    println!(
        "1024 x 64 B READ: nixl {:.0} us, raw {:.0} us per transfer",
        med(&mut ours),
        med(&mut theirs)
    );
}
