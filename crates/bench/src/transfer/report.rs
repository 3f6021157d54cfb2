//! The report: ratios against the baselines, the JSON's last line, and `--report DIR`'s page.

use std::time::Instant;

use handoff_transport::nixl::NixlConfig;
use handoff_transport::tcp::TcpConfig;
use serde_json::{json, Value};

use super::cases::{Case, Layout};
use super::peer::handshake_ms;
use super::{
    Results, TransferArgs, LAYERWISE_CASE, MIB, RATIO_CASE, SCATTERED_BLOCKS,
    TARGET_LAYERWISE_VS_RAW_NIXL, TARGET_NIXL_VS_MEMCPY, TARGET_NIXL_VS_RAW, TARGET_TCP_VS_RAW,
};

pub(super) fn report(
    args: &TransferArgs,
    cfg: &NixlConfig,
    layout: &Layout,
    res: &Results,
    nixl_lib: &Result<std::path::PathBuf, String>,
    started: Instant,
    load1: f64,
) -> anyhow::Result<()> {
    let rows: [(&str, &str); 11] = [
        ("tcp_read", "tcp READ"),
        ("tcp_write", "tcp WRITE"),
        ("raw_tcp_read", "raw-tcp READ"),
        ("raw_tcp_write", "raw-tcp WRITE"),
        ("nixl_read", "nixl READ"),
        ("nixl_write", "nixl WRITE"),
        ("nixl_1proc_read", "nixl 1-proc READ"),
        ("nixl_1proc_write", "nixl 1-proc WRITE"),
        ("raw_nixl_read", "raw-nixl READ"),
        ("raw_nixl_write", "raw-nixl WRITE"),
        ("memcpy", "memcpy"),
    ];
    println!();
    print!("{:<19}", "GB/s");
    for c in &layout.cases {
        print!("{:>14}", c.label);
    }
    println!();
    let mut gb = serde_json::Map::new();
    for (key, label) in rows {
        print!("{label:<19}");
        let mut per = serde_json::Map::new();
        for c in &layout.cases {
            let v = res.get(key, c.key);
            match v {
                Some(v) => print!("{v:>14.2}"),
                None => print!("{:>14}", "-"),
            }
            per.insert(c.key.to_string(), json!(v));
        }
        println!();
        gb.insert(key.to_string(), Value::Object(per));
    }
    println!("(nixl and the tcp rows: two processes, shuffled blocks; nixl 1-proc and raw-nixl: one process, raw's interleaved mapping; memcpy: one thread)");

    let ratio = |a: &str, b: &str| -> Option<f64> {
        Some(res.get(a, RATIO_CASE)? / res.get(b, RATIO_CASE)?)
    };
    let pair = |a: &str, b: &str| -> (Option<f64>, Option<f64>) {
        (
            ratio(&format!("{a}_read"), &format!("{b}_read")),
            ratio(&format!("{a}_write"), &format!("{b}_write")),
        )
    };
    let min = |(r, w): (Option<f64>, Option<f64>)| Some(r?.min(w?));
    let tcp = pair("tcp", "raw_tcp");
    let nixl = pair("nixl_1proc", "raw_nixl");
    let mem = (ratio("nixl_read", "memcpy"), ratio("nixl_write", "memcpy"));
    // The layer-wise case: 32 posts of one layer each, against the same 32 steps of each
    // baseline.
    let at_layerwise = |a: &str, b: &str| -> (Option<f64>, Option<f64>) {
        let r = |op: &str| {
            Some(
                res.get(&format!("{a}_{op}"), LAYERWISE_CASE)?
                    / res.get(&format!("{b}_{op}"), LAYERWISE_CASE)?,
            )
        };
        (r("read"), r("write"))
    };
    let mut ratios = serde_json::Map::new();
    println!();
    println!(
        "ratios (the worse of READ and WRITE) at 64 KiB blocks, and layer-wise: the model's \
         contiguous run one layer per post"
    );
    for (name, (r, w), target) in [
        ("tcp_vs_raw_tcp", tcp, TARGET_TCP_VS_RAW),
        ("nixl_vs_raw_nixl", nixl, TARGET_NIXL_VS_RAW),
        ("nixl_vs_memcpy", mem, TARGET_NIXL_VS_MEMCPY),
        (
            "layerwise_tcp_vs_raw_tcp",
            at_layerwise("tcp", "raw_tcp"),
            TARGET_TCP_VS_RAW,
        ),
        (
            "layerwise_vs_raw_nixl",
            at_layerwise("nixl_1proc", "raw_nixl"),
            TARGET_LAYERWISE_VS_RAW_NIXL,
        ),
    ] {
        let worst = min((r, w));
        let verdict = match worst {
            None => "n/a (NIXL not available)".to_string(),
            Some(v) if v >= target => "meets target".to_string(),
            Some(v) => format!("MISSES target by {:.1}%", (target - v) / target * 100.0),
        };
        let f = |x: Option<f64>| x.map_or("-".into(), |v| format!("{v:.3}"));
        println!(
            "  {name:<24} {:>6}  (READ {}, WRITE {})  target >= {target}: {verdict}",
            f(worst),
            f(r),
            f(w)
        );
        ratios.insert(name.into(), json!(worst));
        ratios.insert(format!("{name}_read"), json!(r));
        ratios.insert(format!("{name}_write"), json!(w));
        ratios.insert(format!("{name}_target"), json!(target));
    }
    let handshake = handshake_ms(20)?;
    println!(
        "cluster-key handshake per new connection (both proofs, loopback): {handshake:.3} ms \
         (median of 20); the tcp rows above ran keyed and grant-checked, as engines run"
    );
    let secs = started.elapsed().as_secs_f64();
    println!("total run time {secs:.0} s");
    if args.json || args.report.is_some() {
        let report = json!({
            "bench": "transfer",
            "settings": {
                "total_bytes_per_case": args.total_mib * MIB,
                "repetitions": args.reps,
                "tcp_repetitions": args.tcp_reps,
                "ratio_case_repetitions": args.ratio_reps,
                "scattered_block_bytes": SCATTERED_BLOCKS,
                "model": {
                    "layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2,
                    "block_tokens": 16,
                    "block_bytes_per_layer": layout.model_layer_block,
                    "cross_layer_block_bytes": layout.model_block,
                },
                "descriptors": layout.cases.iter()
                    .map(|c| (c.key.to_string(), json!(c.descs.len())))
                    .collect::<serde_json::Map<_, _>>(),
                "block_bytes": layout.cases.iter()
                    .map(|c| (c.key.to_string(), json!(c.block)))
                    .collect::<serde_json::Map<_, _>>(),
                "nixl_progress_delay_us": cfg.progress_delay_us,
                "nixl_backend": cfg.backend,
                "nixl_backend_params": cfg.backend_params.iter()
                    .map(|(k, v)| (k.clone(), json!(v)))
                    .collect::<serde_json::Map<_, _>>(),
                "nixl": match nixl_lib {
                    Ok(p) => json!(p.display().to_string()),
                    Err(e) => json!(format!("skipped: {e}")),
                },
                "ratio_case": RATIO_CASE,
                "load_average_at_start": load1,
                "status_poll_us": args.poll_us,
                "tcp_landing_spin_us": TcpConfig::from_env().landing_spin.as_micros() as u64,
            },
            "gbps": gb,
            "ratios": ratios,
            "auth_handshake_ms": handshake,
            "run_seconds": secs,
        });
        if let Some(dir) = &args.report {
            write_report(dir, layout, res, &report)?;
        }
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        }
    }
    Ok(())
}

/// READ and WRITE bandwidth by block size (the scattered cases) for each backend beside its
/// baselines; the model's cases are in the JSON and the notes.
fn write_report(
    dir: &std::path::Path,
    layout: &Layout,
    res: &Results,
    report: &Value,
) -> anyhow::Result<()> {
    let scattered: Vec<&Case> = layout
        .cases
        .iter()
        .filter(|c| !c.key.starts_with("model"))
        .collect();
    let series = |op: &str| -> Vec<(String, Vec<(f64, f64)>)> {
        ["tcp", "raw_tcp", "nixl", "nixl_1proc", "raw_nixl"]
            .iter()
            .map(|b| format!("{b}_{op}"))
            .chain(std::iter::once("memcpy".to_string()))
            .filter_map(|row| {
                let points: Vec<(f64, f64)> = scattered
                    .iter()
                    .filter_map(|c| Some((c.block as f64, res.get(&row, c.key)?)))
                    .collect();
                (!points.is_empty()).then(|| (row.replace('_', "-"), points))
            })
            .collect()
    };
    let mut charts = Vec::new();
    for (op, title) in [
        ("read", "READ bandwidth by block size"),
        ("write", "WRITE bandwidth by block size"),
    ] {
        charts.push(crate::report::lines(
            title,
            ("block size (bytes)", "GB/s"),
            false,
            &series(op),
        )?);
    }
    let mut notes = String::from("GB/s by case (median of the repetitions):\n");
    for (row, case, v) in &res.rows {
        notes.push_str(&format!("  {row:<18} {case:<13} {v:6.2}\n"));
    }
    notes.push_str(&format!(
        "ratios at 64 KiB blocks: {}",
        serde_json::to_string_pretty(&report["ratios"])?
    ));
    crate::report::write(
        dir,
        "transfer",
        "handoff bench transfer",
        &charts,
        &notes,
        &serde_json::to_string_pretty(report)?,
    )
}
