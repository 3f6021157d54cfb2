//! The tcp transport's throughput against a raw loopback stream (a benchmark, ignored by default).

use super::*;

/// CPU seconds this process used so far (all threads, exited ones included).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses): utime is the 12th, stime the 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) / 100.0
}

/// Runs `f` (which moves `TOTAL` bytes and returns GB/s) and adds CPU seconds per GB moved.
fn with_cpu(f: impl FnOnce() -> f64, total: usize) -> (f64, f64) {
    let c0 = cpu_seconds();
    let gbps = f();
    (gbps, (cpu_seconds() - c0) / (total as f64 / 1e9))
}

/// Throughput against a raw std TCP loopback stream (one thread `write_all`s a buffer of the
/// block size, another `read_exact`s it), interleaved in the same run; best of 5 reps. Not a
/// pass/fail test:
/// `cargo test --release -p handoff-transport --lib tcp::tests::throughput -- --ignored --nocapture`
#[test]
#[ignore = "benchmark"]
fn throughput() {
    const TOTAL: usize = 1 << 30;
    // TCP_BENCH_REPS=n and TCP_BENCH_BLOCK_KIB=k narrow a run.
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
    let reps = env("TCP_BENCH_REPS").unwrap_or(5);
    let blocks: Vec<usize> = match env("TCP_BENCH_BLOCK_KIB") {
        Some(k) => vec![k << 10],
        None => vec![64 << 10, 1 << 20],
    };
    let raw = |buf_len: usize| {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let rx = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = vec![0u8; buf_len];
            let mut got = 0;
            while got < TOTAL {
                s.read_exact(&mut buf).unwrap();
                got += buf_len;
            }
        });
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        let buf = vec![1u8; buf_len];
        let start = Instant::now();
        let mut sent = 0;
        while sent < TOTAL {
            s.write_all(&buf).unwrap();
            sent += buf_len;
        }
        rx.join().unwrap();
        TOTAL as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    // TCP_BENCH_REGION_KIB: a small region keeps the data in cache, like the raw stream's buffer.
    let region_len = env("TCP_BENCH_REGION_KIB").map_or(256 << 20, |k| k << 10);
    // The same raw stream between two 256 MiB buffers, in blocks at scattered offsets: the
    // memory traffic a transfer of KV blocks has, without the transport.
    let mut cold_src = vec![2u8; region_len];
    let mut cold_dst = vec![1u8; region_len];
    let mut raw_cold = |block: usize, rng: &mut Rng| {
        let order = |rng: &mut Rng| {
            let mut p: Vec<usize> = (0..region_len / block).collect();
            for i in (1..p.len()).rev() {
                p.swap(i, rng.below(i as u64 + 1) as usize);
            }
            p
        };
        let (src_order, dst_order) = (order(rng), order(rng));
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let (src, dst) = (&mut cold_src, &mut cold_dst);
        std::thread::scope(|sc| {
            sc.spawn(move || {
                let (mut s, _) = l.accept().unwrap();
                let mut got = 0;
                for &b in dst_order.iter().cycle() {
                    if got >= TOTAL {
                        break;
                    }
                    s.read_exact(&mut dst[b * block..(b + 1) * block]).unwrap();
                    got += block;
                }
            });
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_nodelay(true).unwrap();
            let start = Instant::now();
            let mut sent = 0;
            for &b in src_order.iter().cycle() {
                if sent >= TOTAL {
                    break;
                }
                s.write_all(&src[b * block..(b + 1) * block]).unwrap();
                sent += block;
            }
            drop(s);
            start
        })
        .elapsed()
        .as_secs_f64()
        .recip()
            * TOTAL as f64
            / 1e9
    };
    // HANDOFF_TCP_LANDING_SPIN_US applies (compare 0 with the default).
    let a = agent("ba", TcpConfig::from_env());
    let b = agent("bb", TcpConfig::from_env());
    let mut rng = Rng(11);
    for &block in &blocks {
        let ra = Arc::new(KvRegion::new(region_len, block));
        let rb = Arc::new(KvRegion::new(region_len, block));
        // Touch every page up front, so that no run pays for first-touch faults.
        ra.write(0, &rng.bytes(region_len)).unwrap();
        rb.write(0, &rng.bytes(region_len)).unwrap();
        let id = (block >> 10) as u32;
        a.register(id, ra.clone()).unwrap();
        b.register(id, rb.clone()).unwrap();
    }
    pair(&a, &b);
    // Scattered blocks (random permutations), 16 MiB per transfer, 4 transfers in flight.
    let run = |op: XferOp, block: usize, rng: &mut Rng| {
        let blocks = region_len / block;
        let id = (block >> 10) as u32;
        let perm = |rng: &mut Rng| {
            let mut p: Vec<usize> = (0..blocks).collect();
            for i in (1..p.len()).rev() {
                p.swap(i, rng.below(i as u64 + 1) as usize);
            }
            p
        };
        let (src, dst) = (perm(rng), perm(rng));
        let descs: Vec<XferDesc> = src
            .iter()
            .zip(&dst)
            .map(|(s, d)| XferDesc {
                local_region: id,
                local_offset: (d * block) as u64,
                remote_region: id,
                remote_offset: (s * block) as u64,
                len: block as u64,
            })
            .collect();
        let per_xfer = ((16 << 20) / block).min(blocks);
        let start = Instant::now();
        let mut moved = 0usize;
        let mut inflight = std::collections::VecDeque::new();
        for chunk in descs.chunks(per_xfer).cycle() {
            if moved >= TOTAL {
                break;
            }
            while inflight.len() >= 4 {
                let x = inflight.pop_front().unwrap();
                assert_eq!(wait(&*a, x, Duration::from_secs(60)), XferStatus::Done);
                a.release(x).unwrap();
            }
            inflight.push_back(a.post(op, "bb", chunk, None).unwrap());
            moved += chunk.len() * block;
        }
        for x in inflight {
            assert_eq!(wait(&*a, x, Duration::from_secs(60)), XferStatus::Done);
        }
        moved as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    for &block in &blocks {
        let mut best = [0f64; 4];
        let mut cpu = [f64::MAX; 4];

        for rep in 0..reps {
            // TCP_BENCH_ONLY=raw|cold|read|write runs one of them (for profiling).
            let only = std::env::var("TCP_BENCH_ONLY").unwrap_or_default();
            let skip = |what: &str| !only.is_empty() && only != what;
            let got = [
                if skip("raw") {
                    (0.0, 0.0)
                } else {
                    with_cpu(|| raw(block), TOTAL)
                },
                if skip("cold") {
                    (0.0, 0.0)
                } else {
                    with_cpu(|| raw_cold(block, &mut rng), TOTAL)
                },
                if skip("read") {
                    (0.0, 0.0)
                } else {
                    with_cpu(|| run(XferOp::Read, block, &mut rng), TOTAL)
                },
                if skip("write") {
                    (0.0, 0.0)
                } else {
                    with_cpu(|| run(XferOp::Write, block, &mut rng), TOTAL)
                },
            ];
            println!(
                "block {:>4} KiB rep {rep}: GB/s (CPU s per GB): raw {:.2} ({:.2})  raw-cold {:.2} \
                 ({:.2})  READ {:.2} ({:.2})  WRITE {:.2} ({:.2})",
                block >> 10,
                got[0].0,
                got[0].1,
                got[1].0,
                got[1].1,
                got[2].0,
                got[2].1,
                got[3].0,
                got[3].1
            );
            for i in 0..4 {
                best[i] = best[i].max(got[i].0);
                cpu[i] = cpu[i].min(got[i].1);
            }
        }
        println!(
            "block {:>4} KiB least CPU s per GB: raw {:.2}  raw-cold {:.2}  READ {:.2}  WRITE {:.2}",
            block >> 10,
            cpu[0],
            cpu[1],
            cpu[2],
            cpu[3]
        );
        let [raw_hot, cold, read, write] = best;
        println!(
            "block {:>4} KiB best of {reps}: raw {raw_hot:.2}  raw-cold {cold:.2}  READ {read:.2} \
             ({:.2}x raw, {:.2}x cold)  WRITE {write:.2} ({:.2}x raw, {:.2}x cold) GB/s",
            block >> 10,
            read / raw_hot,
            read / cold,
            write / raw_hot,
            write / cold
        );
    }
}
