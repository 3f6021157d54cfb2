//! Different tensor-parallel sizes and block sizes between P and D, end to end in one process:
//! outputs equal a monolithic engine's; incompatible pairs are refused at handshake with an error
//! that says why, and the request is recomputed or failed per policy.

mod common;

use std::time::Duration;

use common::{metric, metrics_text, metrics_until, post, released_within, texts};

use handoff_engine::{start, EngineConfig, RunningEngine};
use serde_json::{json, Value};

fn cfg(role: &str, tp: u32, block_size: u32) -> EngineConfig {
    EngineConfig {
        role: role.into(),
        port: 0,
        transport: "mem".into(),
        tp,
        block_size,
        num_blocks: 8192 / block_size,
        prefill_us_per_token: 1.0,
        decode_step_ms: 0.2,
        decode_us_per_seq: 0.0,
        ..EngineConfig::default()
    }
}

fn with_pool(mut c: EngineConfig, pool: &str) -> EngineConfig {
    c.kv_pool_layout = pool.into();
    c
}

fn prompt(seed: usize, words: usize) -> String {
    (0..words)
        .map(|i| format!("h{}", (i * 31 + seed * 977) % 3000))
        .collect::<Vec<_>>()
        .join(" ")
}

async fn disaggregated(
    c: &reqwest::Client,
    p: &RunningEngine,
    d: &RunningEngine,
    text: &str,
    n: u32,
) -> (u16, Value) {
    common::pulled(c, p, d, text, 10, n).await
}

/// `text` through P and D answers as through `mono`, with one sequence and with four (n=4).
async fn answers_like(
    c: &reqwest::Client,
    mono: &RunningEngine,
    (p, d): (&RunningEngine, &RunningEngine),
    text: &str,
    case: &str,
) {
    for n in [1, 4] {
        let body = json!({"prompt": text, "max_tokens": 10, "n": n});
        let (s, m) = post(c, &mono.url(), body).await;
        assert_eq!(s, 200);
        let (s, dis) = disaggregated(c, p, d, text, n).await;
        assert_eq!(s, 200, "{case}: {dis}");
        assert_eq!(texts(&dis), texts(&m), "{case}, n={n}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_tp_and_block_sizes_match_monolithic() {
    let c = reqwest::Client::new();
    let mono = start(cfg("both", 1, 16)).await.unwrap();
    let cases = [
        ((1, 16), (2, 16)),
        ((2, 16), (1, 16)),
        ((2, 16), (4, 16)),
        ((4, 16), (2, 16)),
        ((1, 16), (1, 32)),
        ((1, 32), (1, 16)),
        ((1, 16), (1, 16)),
        ((2, 32), (4, 16)),
        ((4, 16), (1, 32)),
    ];
    // Each case on one pairing of pool layouts, so every pairing meets several shapes.
    let pools = [
        ("blocks-outermost", "blocks-outermost"),
        ("heads-outermost", "heads-outermost"),
        ("heads-outermost", "blocks-outermost"),
        ("blocks-outermost", "heads-outermost"),
        ("layers-outermost", "heads-outermost"),
        ("blocks-outermost", "layers-outermost"),
    ];
    for (case, ((ptp, pbs), (dtp, dbs))) in cases.into_iter().enumerate() {
        let (p_pool, d_pool) = pools[case % pools.len()];
        let p = start(with_pool(cfg("prefill", ptp, pbs), p_pool))
            .await
            .unwrap();
        let d = start(with_pool(cfg("decode", dtp, dbs), d_pool))
            .await
            .unwrap();
        for (i, words) in [3usize, 16, 33, 250].into_iter().enumerate() {
            let text = prompt(i + ptp as usize * 10 + dtp as usize, words);
            let case = format!(
                "P tp {ptp} bs {pbs} {p_pool} -> D tp {dtp} bs {dbs} {d_pool}, {words} words"
            );
            answers_like(&c, &mono, (&p, &d), &text, &case).await;
        }
        released_within(&p, Duration::from_secs(1)).await;
        p.stop().await;
        d.stop().await;
    }
    mono.stop().await;
}

/// K and V rows side by side in a block (vLLM 0.33's `[B, H, N, C]` views on a GPU) on one side
/// or both, across TP and block sizes: the answers are one engine's (what D decodes from is
/// read back from its own memory, so a row landed in the wrong place changes them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interleaved_k_and_v_rows_pair_with_planes_and_with_each_other() {
    let c = reqwest::Client::new();
    let mono = start(cfg("both", 1, 16)).await.unwrap();
    let with_layout = |mut c: EngineConfig, layout: &str| {
        c.block_layout = layout.into();
        c
    };
    let cases = [
        ("head-major-interleaved", (2, 16), "head-major", (1, 16)),
        ("token-major", (1, 16), "token-major-interleaved", (2, 32)),
        (
            "head-major-interleaved",
            (1, 32),
            "head-major-interleaved",
            (2, 16),
        ),
        (
            "token-major-interleaved",
            (1, 16),
            "token-major-interleaved",
            (1, 16),
        ),
    ];
    for (p_layout, (ptp, pbs), d_layout, (dtp, dbs)) in cases {
        let p = start(with_layout(cfg("prefill", ptp, pbs), p_layout))
            .await
            .unwrap();
        // A transfer that fails fails the request: nothing is quietly recomputed.
        let d_cfg = EngineConfig {
            failure_policy: "fail".into(),
            ..with_layout(cfg("decode", dtp, dbs), d_layout)
        };
        let d = start(d_cfg).await.unwrap();
        for (i, words) in [3usize, 33, 250].into_iter().enumerate() {
            let text = prompt(i + 40, words);
            let case = format!(
                "P {p_layout} tp {ptp} bs {pbs} -> D {d_layout} tp {dtp} bs {dbs}, {words} words"
            );
            answers_like(&c, &mono, (&p, &d), &text, &case).await;
        }
        released_within(&p, Duration::from_secs(1)).await;
        p.stop().await;
        d.stop().await;
    }
    mono.stop().await;
}

/// More ranks than KV heads: each head is replicated on `tp / heads` ranks (as vLLM does for a
/// model with fewer KV heads than GPUs). P/D pairs of a one-head and a two-head model across TP
/// sizes answer like one engine, and D reads one copy of each head: a handoff moves the bytes an
/// unreplicated TP 1 pair moves (a P rank whose copy another rank gave only confirms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_kv_heads_match_monolithic_and_move_one_copy() {
    let c = reqwest::Client::new();
    let of = |heads: u32, role: &str, tp: u32| EngineConfig {
        num_kv_heads: heads,
        ..cfg(role, tp, 16)
    };
    for (heads, pairs) in [
        (1, &[(2, 1), (1, 2), (4, 2), (2, 4)][..]),
        (2, &[(4, 1), (1, 4), (4, 2)][..]),
    ] {
        let mono = start(of(heads, "both", 1)).await.unwrap();
        let bytes_read = |m: &str| metric(m, "handoff_transfer_bytes_total");
        let text = prompt(heads as usize, 250);
        // What a TP 1 pair moves for this prompt: one copy of every head.
        let (p, d) = (
            start(of(heads, "prefill", 1)).await.unwrap(),
            start(of(heads, "decode", 1)).await.unwrap(),
        );
        let (s, _) = disaggregated(&c, &p, &d, &text, 1).await;
        assert_eq!(s, 200);
        let one_copy = bytes_read(&metrics_text(&c, &d).await);
        p.stop().await;
        d.stop().await;
        for &(ptp, dtp) in pairs {
            let case = format!("{heads} KV heads, P tp {ptp} -> D tp {dtp}");
            let p = start(of(heads, "prefill", ptp)).await.unwrap();
            let d = start(of(heads, "decode", dtp)).await.unwrap();
            let (s, dis) = disaggregated(&c, &p, &d, &text, 1).await;
            assert_eq!(s, 200, "{case}: {dis}");
            // Every D rank holds its own copy: D tp 2 over one head reads it twice.
            let copies = f64::from(dtp / dtp.min(heads));
            let read = bytes_read(&metrics_text(&c, &d).await);
            assert_eq!(read, one_copy * copies, "{case}: bytes D read");
            answers_like(&c, &mono, (&p, &d), &text, &case).await;
            released_within(&p, Duration::from_secs(1)).await;
            p.stop().await;
            d.stop().await;
        }
        mono.stop().await;
    }
}

/// Descriptors D posted for one handoff of `words` tokens, on fresh engines (so both allocations
/// are contiguous).
async fn descriptors_for(
    c: &reqwest::Client,
    p: EngineConfig,
    d: EngineConfig,
    words: usize,
) -> f64 {
    let p = start(p).await.unwrap();
    let d = start(d).await.unwrap();
    let (s, _) = disaggregated(c, &p, &d, &prompt(1, words), 1).await;
    assert_eq!(s, 200);
    let m = metrics_text(c, &d).await;
    p.stop().await;
    d.stop().await;
    metric(&m, "handoff_transfer_descriptors_sum")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contiguous_blocks_cost_a_constant_number_of_descriptors() {
    let c = reqwest::Client::new();
    let layers = f64::from(EngineConfig::default().num_layers);
    // Equal TP and block size, however long the prompt: blocks outermost moves a contiguous run
    // in one descriptor for the whole model, layers outermost (the default) in one per layer.
    for (pool, per_pair) in [("blocks-outermost", 1.0), ("layers-outermost", layers)] {
        for (ptp, dtp) in [(1, 1), (2, 2)] {
            let mut per_prompt = Vec::new();
            for words in [64usize, 1024, 4096] {
                let (p, d) = (cfg("prefill", ptp, 16), cfg("decode", dtp, 16));
                per_prompt
                    .push(descriptors_for(&c, with_pool(p, pool), with_pool(d, pool), words).await);
            }
            // Per (D rank, P rank) pair, for 4 blocks as for 256.
            assert!(
                per_prompt.iter().all(|d| *d == ptp as f64 * per_pair),
                "{pool} tp {ptp}->{dtp}: {per_prompt:?}"
            );
        }
    }
    // Heads outermost, any TP and block-size pairing: one descriptor per (layer, K|V, head) moved,
    // for 4 blocks as for 256.
    let shape = EngineConfig::default();
    let expected = f64::from(shape.num_layers * 2 * shape.num_kv_heads);
    for ((ptp, pbs), (dtp, dbs)) in [
        ((1, 16), (2, 16)),
        ((2, 16), (4, 16)),
        ((4, 16), (2, 16)),
        ((1, 16), (1, 32)),
        ((2, 32), (4, 16)),
    ] {
        let mut per_prompt = Vec::new();
        for words in [64usize, 1024, 4096] {
            per_prompt.push(
                descriptors_for(
                    &c,
                    with_pool(cfg("prefill", ptp, pbs), "heads-outermost"),
                    with_pool(cfg("decode", dtp, dbs), "heads-outermost"),
                    words,
                )
                .await,
            );
        }
        assert!(
            per_prompt.iter().all(|d| *d == expected),
            "tp {ptp}->{dtp} bs {pbs}->{dbs}: {per_prompt:?}, expected {expected} each"
        );
    }
}

/// One request between an incompatible P and D (policy `recompute`): D answers from a local
/// prefill, both count the refused handshake, and P gives the prompt's blocks back at once —
/// the refused D sends its release on the refused connection — instead of holding them until
/// its lease ends (10 s); P counts that end as `rejected` and D the request as `incompatible`,
/// not as a dead peer.
async fn refused(p_cfg: EngineConfig, d_cfg: EngineConfig) {
    let c = reqwest::Client::new();
    let p = start(p_cfg).await.unwrap();
    let d = start(d_cfg).await.unwrap();
    let text = prompt(5, 40);
    let (s, body) = disaggregated(&c, &p, &d, &text, 1).await;
    // Policy `recompute` (default): D answers anyway, from a local prefill.
    assert_eq!(s, 200, "{body}");
    let m = metrics_text(&c, &d).await;
    assert!(metric(&m, "handoff_handshakes_refused_total") >= 1.0, "{m}");
    assert_eq!(metric(&m, "handoff_transfer_bytes_total"), 0.0);
    assert!(
        common::metric_with(&m, "handoff_requests_failed_total", "incompatible") >= 1.0,
        "{m}"
    );
    assert_eq!(
        common::metric_with(&m, "handoff_requests_failed_total", "peer_dead"),
        0.0,
        "{m}"
    );
    // P refused too, and counted it.
    let pm = metrics_text(&c, &p).await;
    assert!(
        metric(&pm, "handoff_handshakes_refused_total") >= 1.0,
        "{pm}"
    );
    // Well under P's initial lease (10 s): the release came with the refusal.
    released_within(&p, Duration::from_secs(1)).await;
    let pm = metrics_text(&c, &p).await;
    assert!(
        common::metric_with(&pm, "handoff_handoffs_ended_total", "rejected") >= 1.0,
        "{pm}"
    );
    p.stop().await;
    d.stop().await;
}

/// The refusal can reach D while the request still waits in D's queue (here: a local request
/// fills D's pool). Under policy `fail` the request must fail with P's reason, at once, not
/// prefill locally once it is admitted. (A full workspace run once hit this by timing alone.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_while_queued_fails_the_request_under_policy_fail() {
    let c = reqwest::Client::new();
    let p = start(EngineConfig {
        model: "other-model".into(),
        ..cfg("prefill", 1, 16)
    })
    .await
    .unwrap();
    let d = start(EngineConfig {
        failure_policy: "fail".into(),
        num_blocks: 20,
        decode_step_ms: 5.0,
        ..cfg("decode", 1, 16)
    })
    .await
    .unwrap();
    // 200 prompt + 100 generated tokens: 19 of D's 20 blocks for about half a second.
    let (hc, hurl) = (c.clone(), d.url());
    let hog = tokio::spawn(async move {
        post(
            &hc,
            &hurl,
            json!({"prompt": prompt(9, 200), "max_tokens": 100}),
        )
        .await
    });
    metrics_until(
        &c,
        &d,
        Duration::from_secs(5),
        "the hog never started",
        |m| metric(m, "engine_kv_blocks_used") > 0.0,
    )
    .await;
    let (s, body) = disaggregated(&c, &p, &d, &prompt(6, 40), 1).await;
    assert_eq!(s, 502, "{body}");
    let msg = body["error"]["message"].as_str().unwrap().to_lowercase();
    assert!(msg.contains("model"), "expected P's reason in {msg:?}");
    let (s, _) = hog.await.unwrap();
    assert_eq!(s, 200, "the queue-filling request is unaffected");
    p.stop().await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incompatible_pairs_are_refused_with_a_reason() {
    let c = reqwest::Client::new();
    let cases: Vec<(EngineConfig, EngineConfig, &str)> = vec![
        (
            EngineConfig {
                num_kv_heads: 12,
                ..cfg("prefill", 2, 16)
            },
            EngineConfig {
                num_kv_heads: 12,
                ..cfg("decode", 3, 16)
            },
            "divide",
        ),
        (
            EngineConfig {
                num_layers: 6,
                ..cfg("prefill", 1, 16)
            },
            cfg("decode", 1, 16),
            "layers",
        ),
        (
            EngineConfig {
                model: "other-model".into(),
                ..cfg("prefill", 1, 16)
            },
            cfg("decode", 1, 16),
            "model",
        ),
        (
            EngineConfig {
                block_layout: "token-major".into(),
                ..cfg("prefill", 1, 16)
            },
            cfg("decode", 1, 16),
            "major",
        ),
    ];
    for (p_cfg, d_cfg, expect) in cases {
        refused(p_cfg.clone(), d_cfg.clone()).await;
        // With policy `fail`, the client sees why.
        let p = start(p_cfg).await.unwrap();
        let d = start(EngineConfig {
            failure_policy: "fail".into(),
            ..d_cfg
        })
        .await
        .unwrap();
        let (s, body) = disaggregated(&c, &p, &d, &prompt(6, 40), 1).await;
        assert_eq!(s, 502, "case {expect:?}: {body}");
        let msg = body["error"]["message"].as_str().unwrap().to_lowercase();
        assert!(msg.contains(expect), "expected {expect:?} in {msg:?}");
        p.stop().await;
        d.stop().await;
    }
    // More ranks than KV heads, but not a whole number of copies of each: refused at start,
    // naming the field.
    let e = start(cfg("decode", 6, 16)).await.err().expect("refused");
    assert!(e.to_string().contains("tp"), "{e}");
}
