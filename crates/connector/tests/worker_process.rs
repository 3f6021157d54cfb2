//! The scheduler side and the worker sides in separate processes, as vLLM runs them: P's
//! workers (its KV memory and transport agents) live in a child process and speak to P's
//! scheduler side in this one only through step metadata; D runs here. A pull moves P's bytes
//! into D's blocks, D zeroes the tail past the prompt, and P frees its blocks once D read them.
//! Also: a side channel port already taken stops start-up with an error naming it.

use std::net::TcpListener;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_connector::{
    remote, Connector, ConnectorConfig, ConnectorEvent, Hooks, RankMemory, Role,
};
use handoff_plan::{BlockLayout, KvSpec, ModelShape, RankLayout};
use handoff_proto::TransferMode;
use handoff_transport::conformance::fill;
use handoff_transport::tcp::{TcpConfig, TcpTransport};
use handoff_transport::KvRegion;
use prometheus_client::registry::Registry;

const BLOCKS: u32 = 16;
const SEED: u64 = 77;

fn spec() -> KvSpec {
    KvSpec {
        shape: ModelShape {
            num_layers: 3,
            num_kv_heads: 4,
            head_dim: 8,
            dtype_size: 2,
        },
        tp: 2,
        block_size: 16,
        block_layout: BlockLayout::HeadMajor,
    }
}

fn config(engine: &str, role: Role) -> ConnectorConfig {
    ConnectorConfig {
        engine_id: engine.into(),
        role,
        mode: TransferMode::Pull,
        model: "m".into(),
        dtype: "bf16".into(),
        side_channel_bind: "127.0.0.1:0".parse().unwrap(),
        advertise_host: "127.0.0.1".into(),
        producer: Default::default(),
        consumer: Default::default(),
        opaque_blocks: false,
        kv_digest: false,
        layerwise_pull: false,
        layer_reports: Default::default(),
        peer_hosts: Vec::new(),
        key: None,
        insecure: false,
        max_side_connections: handoff_connector::DEFAULT_MAX_SIDE_CONNECTIONS,
        max_side_handshakes_per_source: handoff_connector::DEFAULT_MAX_SIDE_HANDSHAKES_PER_SOURCE,
        record: None,
        protocol_version: handoff_proto::PROTOCOL_VERSION,
    }
}

struct KillOnDrop(Child);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for(
    c: &Connector,
    what: &str,
    mut f: impl FnMut(&ConnectorEvent) -> bool,
) -> ConnectorEvent {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Some(ev) = c.wait_event(Duration::from_millis(100)) {
            if f(&ev) {
                return ev;
            }
        }
    }
    panic!("no {what} within 20 s");
}

#[test]
fn workers_in_another_process_serve_a_pull() {
    let spec = spec();
    // P: scheduler side here, workers in a child process.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_handoff-connector-worker"))
        .args([
            listener.local_addr().unwrap().to_string(),
            "p-remote".into(),
            serde_json::to_string(&spec).unwrap(),
            BLOCKS.to_string(),
            SEED.to_string(),
        ])
        .spawn()
        .expect("worker process starts");
    let _child = KillOnDrop(child);
    let (hellos, workers) = remote::accept(&listener).expect("worker process says hello");
    assert_eq!(hellos.len(), 2);
    let (p, _sink) = Connector::start_with(
        config("p-remote", Role::Prefill),
        hellos,
        &mut Registry::default(),
        |sink| {
            workers
                .start(2, sink)
                .map_err(handoff_connector::ConnectorError::Thread)
        },
    )
    .expect("P's scheduler side starts");

    // D: everything in this process; its blocks start full of garbage.
    let mut d_regions = Vec::new();
    let mut ranks = Vec::new();
    for rank in 0..2 {
        let layout = RankLayout::cross_layer(spec, rank, BLOCKS, 0).unwrap();
        let region = Arc::new(KvRegion::new(
            layout.region_len(0).unwrap() as usize,
            64 * 1024,
        ));
        fill(&region, 999, 0);
        d_regions.push((layout.clone(), region.clone()));
        ranks.push(RankMemory {
            layout,
            regions: vec![(0, region)],
            transport: TcpTransport::new(&format!("d-local-r{rank}"), TcpConfig::default())
                .unwrap(),
        });
    }
    let d = Connector::start(
        config("d-local", Role::Decode),
        ranks,
        &mut Registry::default(),
    )
    .expect("D starts");
    // D's engine loop is woken when events are queued (it sleeps between polls otherwise).
    let wakes = Arc::new(AtomicUsize::new(0));
    let w = wakes.clone();
    d.set_waker(move || {
        w.fetch_add(1, Ordering::Relaxed);
    });

    // A 40-token prompt in P's blocks 3..6 lands in D's blocks 9..12.
    let (p_blocks, d_blocks, tokens) = (vec![3, 4, 5], vec![9, 10, 11], 40);
    let leg = handoff_proto::KvTransferParams::for_prefill_leg();
    let handoff = Connector::new_handoff_id().unwrap();
    let params = p
        .prefilled("req-1", &leg, handoff, p_blocks.clone(), tokens)
        .map(|end| end.params.expect("a finished pull answers its params"))
        .expect("P creates the handoff");
    d.request_arrived(1, &params, tokens).expect("D tracks it");
    d.blocks_allocated(1, Vec::new(), d_blocks.clone())
        .expect("D admits it");
    let ready = wait_for(&d, "Ready on D", |e| {
        matches!(e, ConnectorEvent::Ready { .. })
    });
    assert_eq!(
        ready,
        ConnectorEvent::Ready {
            requests: vec![1],
            blocks: d_blocks.clone()
        }
    );
    let woken = Instant::now();
    while wakes.load(Ordering::Relaxed) == 0 && woken.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        wakes.load(Ordering::Relaxed) > 0,
        "D queued Ready without waking its engine"
    );
    let released = wait_for(&p, "release on P", |e| {
        matches!(e, ConnectorEvent::BlocksReleased { .. })
    });
    let ConnectorEvent::BlocksReleased { blocks, reason, .. } = released else {
        unreachable!("waited for a release")
    };
    assert_eq!((blocks, reason.as_str()), (p_blocks.clone(), "done"));

    // D's blocks hold exactly P's bytes for the prompt's tokens, and zeros past them.
    for (rank, (layout, region)) in d_regions.iter().enumerate() {
        let p_region = KvRegion::new(region.len(), 64 * 1024);
        fill(&p_region, SEED + rank as u64, 0);
        let stride = region.len() / BLOCKS as usize;
        let mut expected = vec![0u8; region.len()];
        region.read(0, &mut expected).unwrap();
        for (pb, db) in p_blocks.iter().zip(&d_blocks) {
            let mut block = vec![0u8; stride];
            p_region.read(*pb as usize * stride, &mut block).unwrap();
            expected[*db as usize * stride..][..stride].copy_from_slice(&block);
        }
        for s in handoff_plan::uncovered_dst(layout, &d_blocks, tokens).unwrap() {
            expected[s.offset as usize..][..s.len as usize].fill(0);
        }
        let mut got = vec![0u8; region.len()];
        region.read(0, &mut got).unwrap();
        // The control: before the pull, D's blocks differed from what it must hold now.
        let mut before = vec![0u8; region.len()];
        let garbage = KvRegion::new(region.len(), 64 * 1024);
        fill(&garbage, 999, 0);
        garbage.read(0, &mut before).unwrap();
        assert_ne!(
            before, expected,
            "rank {rank}: the check must be able to fail"
        );
        assert!(
            got == expected,
            "rank {rank}: D's blocks do not hold P's KV"
        );
    }
    p.shutdown();
    d.shutdown();
}

/// A side channel port another socket holds (an engine of a second session, a port a test picked
/// and lost) stops the connector with an error that names the address, not a bare errno.
#[test]
fn a_side_channel_port_already_taken_is_refused_naming_it() {
    let holder = TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = holder.local_addr().unwrap();
    let spec = spec();
    let rank = |name: &str, rank: u32| {
        let layout = RankLayout::cross_layer(spec, rank, BLOCKS, 0).unwrap();
        let region = Arc::new(KvRegion::new(
            layout.region_len(0).unwrap() as usize,
            64 * 1024,
        ));
        RankMemory {
            layout,
            regions: vec![(0, region)],
            transport: TcpTransport::new(&format!("{name}-r{rank}"), TcpConfig::default()).unwrap(),
        }
    };
    let mut cfg = config("taken", Role::Decode);
    cfg.side_channel_bind = taken;
    let err = Connector::start(
        cfg,
        vec![rank("taken", 0), rank("taken", 1)],
        &mut Registry::default(),
    )
    .err()
    .expect("a port in use cannot be listened on");
    let msg = err.to_string();
    assert!(msg.contains(&taken.to_string()), "{msg}");
    // The control: the same config on a free port starts.
    let ok = Connector::start(
        config("free", Role::Decode),
        vec![rank("free", 0), rank("free", 1)],
        &mut Registry::default(),
    )
    .expect("a free port is listened on");
    ok.shutdown();
}
