//! The hostile-peer suite (issue 15): while legitimate requests flow from P to D (both with the
//! cluster key, tcp transport, loopback), an outsider without the key, an insider with it
//! ("mallory", a member that misbehaves) and a client try every attack we know of on the wire
//! protocols and the HTTP listeners. Each attack must be refused and counted in `/metrics`, and
//! the legitimate requests must keep their outputs (zero mismatches) with no block leaked or
//! freed early. The run prints a table: attack, refused, counted, legitimate requests affected.
//! Bounded: every wait has a limit, the legitimate traffic stops by itself.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{metric, metrics_text, pool_whole_within, post, released_within, texts};
use handoff_connector::side_channel::{SideChannel, SideConfig, SideEvent};
use handoff_connector::{ClusterKey, ConnectorCore, CoreConfig, Input, Role, WorkerHello};
use handoff_engine::{start, EngineConfig, RunningEngine};
use handoff_http::probe::{read_until_closed, slowloris};
use handoff_proto::{
    Epoch, HandoffId, Heartbeat, HeartbeatEntry, HelloReply, KvTransferParams, Message, PullDone,
    Release, ReleaseReason, TransferMode,
};
use handoff_transport::tcp::{TcpConfig, TcpTransport};
use handoff_transport::{KvRegion, Transport, XferDesc, XferId, XferOp, XferStatus};
use parking_lot::Mutex;
use serde_json::{json, Value};

const PROMPTS: [&str; 3] = [
    "a capability is only as strong as the check behind it",
    "every peer may lie about its name its blocks and its progress so check",
    "short",
];
const SIDE_CAP: usize = 24;

fn cfg(role: &str, key: Option<&ClusterKey>) -> EngineConfig {
    EngineConfig {
        max_side_connections: SIDE_CAP,
        // Below the cap: one source's flood meets its own budget before the engine's cap.
        max_side_handshakes_per_source: 8,
        staging_capacity: 256,
        staging_per_peer: 64,
        http_header_read_timeout_ms: 1500,
        http_max_body_bytes: 256 << 10,
        ..common::keyed_tcp(role, key)
    }
}

/// What the legitimate traffic saw.
#[derive(Default)]
struct Legit {
    ok: AtomicUsize,
    mismatched: AtomicUsize,
    failed: AtomicUsize,
    /// The params of the request in flight (an insider may learn handoff ids).
    current: Mutex<Option<KvTransferParams>>,
}

impl Legit {
    fn affected(&self) -> usize {
        self.mismatched.load(Ordering::SeqCst) + self.failed.load(Ordering::SeqCst)
    }
}

async fn p_leg(c: &reqwest::Client, p: &RunningEngine, prompt: &str) -> Option<Value> {
    let (s, pr) = post(
        c,
        &p.url(),
        json!({"prompt": prompt, "max_tokens": 1,
               "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await;
    (s == 200).then(|| pr["kv_transfer_params"].clone())
}

/// P then D for each prompt in turn until `stop` (at most 20,000 requests).
async fn legit_traffic(
    c: reqwest::Client,
    p_url: String,
    d_url: String,
    expected: Vec<Vec<String>>,
    legit: Arc<Legit>,
    stop: Arc<AtomicBool>,
) {
    for i in 0..20_000 {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let prompt = PROMPTS[i % PROMPTS.len()];
        let (s, pr) = post(
            &c,
            &p_url,
            json!({"prompt": prompt, "max_tokens": 1,
                   "kv_transfer_params": {"do_remote_decode": true}}),
        )
        .await;
        if s != 200 {
            legit.failed.fetch_add(1, Ordering::SeqCst);
            continue;
        }
        let params = pr["kv_transfer_params"].clone();
        *legit.current.lock() = serde_json::from_value(params.clone()).ok();
        let (s, dr) = post(
            &c,
            &d_url,
            json!({"prompt": prompt, "max_tokens": 8, "kv_transfer_params": params}),
        )
        .await;
        if s != 200 {
            legit.failed.fetch_add(1, Ordering::SeqCst);
        } else if texts(&dr) != expected[i % PROMPTS.len()] {
            legit.mismatched.fetch_add(1, Ordering::SeqCst);
        } else {
            legit.ok.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// An insider's side channel (it holds the key, under its own engine id).
fn side_client(engine_id: &str, key: Option<&ClusterKey>) -> (SideChannel, Receiver<SideEvent>) {
    let (tx, rx) = channel();
    let tx = Mutex::new(tx);
    let side = SideChannel::new(
        SideConfig {
            engine_id: engine_id.into(),
            key: key.cloned(),
            max_connections: 8,
            max_handshakes_per_source: 8,
            protocol_version: handoff_proto::PROTOCOL_VERSION,
        },
        Arc::new(move |ev| tx.lock().send(ev).is_ok()),
    );
    (side, rx)
}

/// Dials `engine` at `addr` with `hello`; the writer and the reply, or why not.
fn dial(
    side: &SideChannel,
    rx: &Receiver<SideEvent>,
    engine: &str,
    addr: SocketAddr,
    hello: Message,
) -> Result<(handoff_connector::side_channel::ConnWriter, Message), String> {
    side.connect(engine.into(), 1, addr.to_string(), hello);
    let deadline = Instant::now() + Duration::from_secs(8);
    while Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(SideEvent::Connected { writer, reply, .. }) => return Ok((writer, reply)),
            Ok(SideEvent::ConnectFailed { error, .. }) => return Err(error),
            _ => {}
        }
    }
    Err("no answer".into())
}

/// A well-formed hello for an engine `engine_id` whose rank 0 is agent `agent`, shaped like the
/// victims' (so only what the attack changes can be refused).
fn hello_as(
    shape: &EngineConfig,
    engine_id: &str,
    agent: &str,
    metadata: Vec<u8>,
    params: &KvTransferParams,
) -> Message {
    let spec = shape.spec().unwrap();
    let layout = shape
        .pool_layout()
        .unwrap()
        .rank_layout(spec, 0, shape.num_blocks, 0)
        .unwrap();
    let mut core = ConnectorCore::new(
        CoreConfig {
            engine_id: engine_id.into(),
            role: Role::Decode,
            mode: TransferMode::Pull,
            model: shape.model.clone(),
            dtype: shape.dtype.clone(),
            advertise_host: "127.0.0.1".into(),
            side_channel_port: 9,
            producer: Default::default(),
            consumer: Default::default(),
            opaque_blocks: false,
            kv_digest: false,
            peer_hosts: Vec::new(),
            protocol_version: handoff_proto::PROTOCOL_VERSION,
            layerwise_pull: false,
            layer_reports: Default::default(),
        },
        vec![WorkerHello {
            rank: 0,
            layout,
            agent: agent.into(),
            metadata,
            memory: Default::default(),
            groups: Default::default(),
        }],
    )
    .unwrap();
    core.handle(
        Input::RequestArrived {
            request: 1,
            params: params.clone(),
            prompt_tokens: 8,
        },
        Duration::ZERO,
    )
    .unwrap();
    core.ready().connects[0].hello.clone()
}

/// The agents (name, metadata) a hello reply announces.
fn agents_of(reply: &Message) -> Vec<(String, Vec<u8>)> {
    match reply {
        Message::HelloReply(HelloReply::Accepted(h)) => {
            postcard::from_bytes(&h.agent_metadata).unwrap()
        }
        other => panic!("not accepted: {other:?}"),
    }
}

fn refused(reply: &Result<(impl Sized, Message), String>) -> bool {
    match reply {
        Err(_) => true,
        Ok((_, Message::HelloReply(HelloReply::Refused { .. }))) => true,
        Ok(_) => false,
    }
}

/// Posts one transfer of `len` bytes of the peer's region 0 at `offset`; whether it landed.
fn try_transfer(t: &TcpTransport, op: XferOp, peer: &str, offset: u64, len: u64) -> XferStatus {
    let _ = t.deregister(7);
    t.register(7, Arc::new(KvRegion::new(len as usize, 4096)))
        .unwrap();
    let Ok(id) = t.post(
        op,
        peer,
        &[XferDesc {
            local_region: 7,
            local_offset: 0,
            remote_region: 0,
            remote_offset: offset,
            len,
        }],
        None,
    ) else {
        return XferStatus::Failed("post refused".into());
    };
    wait_status(t, id, Duration::from_secs(5))
}

/// A transfer's status once it ended, or still in progress after `limit`.
fn wait_status(t: &TcpTransport, id: XferId, limit: Duration) -> XferStatus {
    let start = Instant::now();
    loop {
        let s = t.status(id).unwrap();
        if s != XferStatus::InProgress || start.elapsed() > limit {
            return s;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn tcp_agent(name: &str, key: Option<&ClusterKey>) -> Arc<TcpTransport> {
    TcpTransport::new(
        name,
        TcpConfig {
            key: key.cloned(),
            ..TcpConfig::default()
        },
    )
    .unwrap()
}

struct Row {
    attack: &'static str,
    refused: bool,
    counted: bool,
    affected: usize,
}

/// Reads `metric` on `e` until it exceeds `before` (or 5 s pass); whether it did.
async fn counted(c: &reqwest::Client, e: &RunningEngine, name: &str, before: f64) -> bool {
    let start = Instant::now();
    loop {
        if metric(&metrics_text(c, e).await, name) > before {
            return true;
        }
        if start.elapsed() > Duration::from_secs(5) {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn now_of(c: &reqwest::Client, e: &RunningEngine, name: &str) -> f64 {
    metric(&metrics_text(c, e).await, name)
}

fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> tokio::task::JoinHandle<T> {
    tokio::task::spawn_blocking(f)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_peers_are_refused_counted_and_harmless() {
    tokio::time::timeout(Duration::from_secs(240), suite())
        .await
        .expect("the hostile-peer suite took over 240 s");
}

async fn suite() {
    let key = ClusterKey::generate().unwrap();
    let other_key = ClusterKey::generate().unwrap();
    let c = reqwest::Client::new();
    let mono = start(cfg("both", None)).await.unwrap();
    let mut expected = Vec::new();
    for prompt in PROMPTS {
        let (s, m) = post(&c, &mono.url(), json!({"prompt": prompt, "max_tokens": 8})).await;
        assert_eq!(s, 200);
        expected.push(texts(&m));
    }
    mono.stop().await;
    let p_cfg = cfg("prefill", Some(&key));
    let p = start(p_cfg.clone()).await.unwrap();
    let d = start(cfg("decode", Some(&key))).await.unwrap();
    let p_side = p.connector.as_ref().unwrap().side_channel_addr();
    // 'static, so every blocking attack can name P.
    let p_id: &'static str = Box::leak(p.engine_id.clone().into_boxed_str());
    let d_side = d.connector.as_ref().unwrap().side_channel_addr();

    let legit = Arc::new(Legit::default());
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = tokio::spawn(legit_traffic(
        c.clone(),
        p.url(),
        d.url(),
        expected.clone(),
        legit.clone(),
        stop.clone(),
    ));
    // The first legitimate request is through: P and D are paired.
    let t0 = Instant::now();
    while legit.ok.load(Ordering::SeqCst) == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no legitimate request got through"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let params: KvTransferParams =
        serde_json::from_value(p_leg(&c, &p, PROMPTS[0]).await.unwrap()).unwrap();

    let mut rows = Vec::new();
    let mut row = |attack, refused, counted, legit: &Legit, before: usize| {
        rows.push(Row {
            attack,
            refused,
            counted,
            affected: legit.affected() - before,
        })
    };

    // --- outsiders: no key, or another key ---
    let before = legit.affected();
    let m0 = now_of(&c, &p, "handoff_side_connections_refused_total").await;
    let (k, hello) = (
        other_key.clone(),
        hello_as(&p_cfg, "outsider", "outsider-r0", vec![], &params),
    );
    let res = blocking(move || {
        let (side, rx) = side_client("outsider", Some(&k));
        let with_other_key = dial(&side, &rx, p_id, p_side, hello.clone());
        let (side, rx) = side_client("outsider", None);
        let without_key = dial(&side, &rx, p_id, p_side, hello);
        refused(&with_other_key) && refused(&without_key)
    })
    .await
    .unwrap();
    let cnt = counted(&c, &p, "handoff_side_connections_refused_total", m0 + 1.0).await;
    row(
        "side channel: no key / another key",
        res,
        cnt,
        &legit,
        before,
    );

    // --- the insider: a member with the key, under its own name ---
    let (mallory_side, mallory_rx) = side_client("mallory", Some(&key));
    let mallory_t = tcp_agent("mallory-r0", Some(&key));
    let hello = hello_as(
        &p_cfg,
        "mallory",
        "mallory-r0",
        mallory_t.local_metadata().unwrap(),
        &params,
    );
    let (mallory_conn, p_reply, mallory_rx) = {
        let (side, rx, h) = (mallory_side.clone(), mallory_rx, hello);
        let (res, rx) = blocking(move || (dial(&side, &rx, p_id, p_side, h), rx))
            .await
            .unwrap();
        let (w, reply) = res.expect("a member with the key is accepted under its own name");
        (w, reply, rx)
    };
    let p_agents = agents_of(&p_reply);

    // Spoofed engine id: proves "mallory", says hello as D.
    let before = legit.affected();
    let m0 = now_of(&c, &p, "handoff_handshakes_refused_total").await;
    let h = hello_as(&p_cfg, &d.engine_id, "mallory-r0", vec![], &params);
    let k = key.clone();
    let res = blocking(move || {
        let (side, rx) = side_client("mallory", Some(&k));
        refused(&dial(&side, &rx, p_id, p_side, h))
    })
    .await
    .unwrap();
    let cnt = counted(&c, &p, "handoff_handshakes_refused_total", m0).await;
    row(
        "hello under another engine id (D's)",
        res,
        cnt,
        &legit,
        before,
    );

    // Forged agent metadata: a hello as "mallory2" whose agent is named like D's.
    let before = legit.affected();
    let m0 = now_of(&c, &p, "handoff_handshakes_refused_total").await;
    let h = hello_as(
        &p_cfg,
        "mallory2",
        &format!("{}-r0", d.engine_id),
        vec![],
        &params,
    );
    let k = key.clone();
    let res = blocking(move || {
        let (side, rx) = side_client("mallory2", Some(&k));
        refused(&dial(&side, &rx, p_id, p_side, h))
    })
    .await
    .unwrap();
    let cnt = counted(&c, &p, "handoff_handshakes_refused_total", m0).await;
    row(
        "hello with another engine's agent names",
        res,
        cnt,
        &legit,
        before,
    );

    // Out-of-grant READ of P's memory, and WRITE into D's, by the member's own transport.
    let before = legit.affected();
    let m0 = now_of(&c, &p, "handoff_transport_transfers_refused_total").await;
    let (t, agents) = (mallory_t.clone(), p_agents.clone());
    let res = blocking(move || {
        let (p_agent, meta) = &agents[0];
        t.load_remote(meta).unwrap();
        matches!(
            try_transfer(&t, XferOp::Read, p_agent, 0, 64 << 10),
            XferStatus::Failed(_)
        )
    })
    .await
    .unwrap();
    let cnt = counted(&c, &p, "handoff_transport_transfers_refused_total", m0).await;
    row(
        "READ of P blocks outside any grant",
        res,
        cnt,
        &legit,
        before,
    );

    // One READ naming more descriptors than P serves in a transfer (its header alone is 5 MiB):
    // refused without being held, and the connection keeps serving.
    let before = legit.affected();
    let m0 = now_of(&c, &p, "handoff_transport_transfers_refused_total").await;
    let (k, agents) = (key.clone(), p_agents.clone());
    let res = blocking(move || {
        let (p_agent, meta) = &agents[0];
        let n = TcpConfig::default().max_descs + 1;
        let t = TcpTransport::new(
            "mallory-r1",
            TcpConfig {
                key: Some(k),
                max_descs: n,
                max_queued_descs: n,
                ..TcpConfig::default()
            },
        )
        .unwrap();
        t.register(0, Arc::new(KvRegion::new(n, 4096))).unwrap();
        t.load_remote(meta).unwrap();
        let descs: Vec<XferDesc> = (0..n as u64)
            .map(|i| XferDesc {
                local_region: 0,
                local_offset: i,
                remote_region: 0,
                remote_offset: i % 4096,
                len: 1,
            })
            .collect();
        let id = t.post(XferOp::Read, p_agent, &descs, None).unwrap();
        matches!(
            wait_status(&t, id, Duration::from_secs(10)),
            XferStatus::Failed(e) if e.contains("limit")
        )
    })
    .await
    .unwrap();
    let cnt = counted(&c, &p, "handoff_transport_transfers_refused_total", m0).await;
    row(
        "READ over P's descriptor limit (2^18 + 1)",
        res,
        cnt,
        &legit,
        before,
    );

    let before = legit.affected();
    let m0 = now_of(&c, &d, "handoff_transport_transfers_refused_total").await;
    let h = hello_as(
        &p_cfg,
        "mallory",
        "mallory-r0",
        mallory_t.local_metadata().unwrap(),
        &params,
    );
    let (t, k, d_id) = (mallory_t.clone(), key.clone(), d.engine_id.clone());
    let res = blocking(move || {
        let (side, rx) = side_client("mallory", Some(&k));
        let (_w, reply) = dial(&side, &rx, &d_id, d_side, h).expect("D accepts a member");
        let agents = agents_of(&reply);
        let (d_agent, meta) = &agents[0];
        t.load_remote(meta).unwrap();
        matches!(
            try_transfer(&t, XferOp::Write, d_agent, 0, 64 << 10),
            XferStatus::Failed(_)
        )
    })
    .await
    .unwrap();
    let cnt = counted(&c, &d, "handoff_transport_transfers_refused_total", m0).await;
    row(
        "WRITE into D blocks outside any registration",
        res,
        cnt,
        &legit,
        before,
    );

    // Forged completions: "I read it" from the member for a handoff it does not read, over the
    // side channel and as a transport notification. Without the reader check P frees the
    // blocks (under the reader's READ, when there is one).
    let before = legit.affected();
    let m0 = now_of(&c, &p, "handoff_not_from_reader_refused_total").await;
    let unread = params.handoff_id.unwrap();
    let done = |handoff| {
        Message::PullDone(PullDone {
            handoff,
            epoch: Epoch::FIRST,
            p_rank: 0,
            consumer_rank: 0,
            consumers: 1,
        })
    };
    let mut victims = vec![unread];
    victims.extend(legit.current.lock().as_ref().and_then(|p| p.handoff_id));
    for h in &victims {
        mallory_conn.try_send(&done(*h)).unwrap();
    }
    let bytes = handoff_proto::encode(&done(unread)).unwrap();
    mallory_t.send_notification(&p_agents[0].0, &bytes).unwrap();
    let cnt = counted(&c, &p, "handoff_not_from_reader_refused_total", m0 + 1.0).await;
    let held = p.connector.as_ref().unwrap().held_blocks().unwrap().0;
    row(
        "forged completions (side channel, transport notification)",
        held >= params.block_ids().map_or(1, <[u32]>::len),
        cnt,
        &legit,
        before,
    );

    // A flood of made-up handoff ids from the member: P stages at most its quota of them.
    let before = legit.affected();
    let m0 = now_of(&c, &p, "handoff_staged_over_quota_total").await;
    for batch in 0..30u32 {
        let entries = (0..100u32)
            .map(|i| {
                let mut id = [0xbb; 16];
                id[..4].copy_from_slice(&(batch * 100 + i).to_le_bytes());
                HeartbeatEntry {
                    handoff: HandoffId::from_bytes(id),
                    epoch: Epoch::FIRST,
                }
            })
            .collect();
        mallory_conn
            .try_send(&Message::Heartbeat(Heartbeat {
                seq: u64::from(batch),
                mode: handoff_proto::TransferMode::Pull,
                entries,
            }))
            .unwrap();
    }
    let cnt = counted(&c, &p, "handoff_staged_over_quota_total", m0 + 2000.0).await;
    let staged = p.connector.as_ref().unwrap().staged_messages().unwrap();
    row(
        "flood of made-up handoff ids (3,000)",
        staged <= 64 + 16,
        cnt,
        &legit,
        before,
    );

    // Anonymous messages: a connection (with the key) whose first frame is no hello.
    let before = legit.affected();
    let m0 = now_of(&c, &p, "handoff_side_channel_anonymous_refused_total").await;
    let entry = HeartbeatEntry {
        handoff: unread,
        epoch: Epoch::FIRST,
    };
    let k = key.clone();
    let res = blocking(move || {
        let (side, rx) = side_client("anon", Some(&k));
        let hb = Message::Heartbeat(Heartbeat {
            seq: 1,
            mode: handoff_proto::TransferMode::Pull,
            entries: vec![entry],
        });
        let rel = Message::Release(Release {
            handoff: entry.handoff,
            epoch: Epoch::FIRST,
            reason: ReleaseReason::Aborted,
        });
        dial(&side, &rx, p_id, p_side, hb).is_err() && dial(&side, &rx, p_id, p_side, rel).is_err()
    })
    .await
    .unwrap();
    let cnt = counted(
        &c,
        &p,
        "handoff_side_channel_anonymous_refused_total",
        m0 + 1.0,
    )
    .await;
    let still = p.connector.as_ref().unwrap().held_blocks().unwrap().0;
    row(
        "anonymous heartbeat and release",
        res && still >= params.block_ids().map_or(1, <[u32]>::len),
        cnt,
        &legit,
        before,
    );

    // A client points D at a listener of its choosing (one with another key, and P's real side
    // channel under another engine id): D refuses both, computes the prompt itself.
    let before = legit.affected();
    let m0 = now_of(&c, &d, "handoff_requests_failed_total").await;
    let (fake, _fake_rx) = side_client("p-fake", Some(&other_key));
    let fake_stop = Arc::new(AtomicBool::new(false));
    let fake_addr = fake
        .listen("127.0.0.1:0".parse().unwrap(), fake_stop.clone())
        .unwrap();
    let mut all_served = true;
    // (A P that D already knows under its engine id keeps its proven connection, wherever the
    // client points.)
    for (port, engine) in [(fake_addr.port(), "p-evil"), (p_side.port(), "p-other")] {
        let mut prm = p_leg(&c, &p, PROMPTS[1]).await.unwrap();
        prm["remote_port"] = json!(port);
        prm["remote_engine_id"] = json!(engine);
        let (s, dr) = post(
            &c,
            &d.url(),
            json!({"prompt": PROMPTS[1], "max_tokens": 8, "kv_transfer_params": prm}),
        )
        .await;
        all_served &= s == 200 && texts(&dr) == expected[1];
    }
    fake_stop.store(true, Ordering::SeqCst);
    let cnt = counted(&c, &d, "handoff_requests_failed_total", m0 + 1.0).await;
    row(
        "client-chosen remote_host / remote_engine_id",
        all_served,
        cnt,
        &legit,
        before,
    );

    // A client names another request's blocks: D reads the blocks P names.
    let before = legit.affected();
    let m0 = now_of(&c, &d, "handoff_client_blocks_replaced_total").await;
    let mut prm = p_leg(&c, &p, PROMPTS[0]).await.unwrap();
    let n = prm["remote_block_ids"][0].as_array().unwrap().len();
    prm["remote_block_ids"] = json!([(200..200 + n as u32).collect::<Vec<_>>()]);
    let (s, dr) = post(
        &c,
        &d.url(),
        json!({"prompt": PROMPTS[0], "max_tokens": 8, "kv_transfer_params": prm}),
    )
    .await;
    let cnt = counted(&c, &d, "handoff_client_blocks_replaced_total", m0).await;
    row(
        "client-supplied remote_block_ids",
        s == 200 && texts(&dr) == expected[0],
        cnt,
        &legit,
        before,
    );

    // A flood of side-channel connections that never speak, from one source: past its
    // handshake budget (and the cap) they are closed at once, the rest at the handshake
    // deadline; established peers keep working.
    let before = legit.affected();
    let m0 = now_of(&c, &p, "handoff_side_connections_refused_total").await;
    let mut held = Vec::new();
    for _ in 0..SIDE_CAP + 16 {
        if let Ok(s) = tokio::net::TcpStream::connect(p_side).await {
            held.push(s);
        }
    }
    let mut closed_early = 0;
    for s in held.iter_mut().rev().take(8) {
        if read_until_closed(s, Duration::from_millis(500))
            .await
            .is_empty()
        {
            closed_early += 1;
        }
    }
    let cnt = counted(&c, &p, "handoff_side_connections_refused_total", m0 + 15.0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(held);
    row(
        "flood of side-channel connections (one source)",
        closed_early == 8,
        cnt,
        &legit,
        before,
    );

    // Slowloris on both HTTP listeners, and an oversized body.
    let before = legit.affected();
    let limit_hits = |m: &str| metric(m, "engine_http_limit_hits_total");
    let (mp, md) = (
        limit_hits(&metrics_text(&c, &p).await),
        limit_hits(&metrics_text(&c, &d).await),
    );
    let (a, b) = tokio::join!(
        slowloris(
            p.addr,
            "/metrics",
            Duration::from_millis(300),
            Duration::from_secs(8)
        ),
        slowloris(
            d.addr,
            "/metrics",
            Duration::from_millis(300),
            Duration::from_secs(8)
        ),
    );
    let cut = a.unwrap().closed && b.unwrap().closed;
    let cnt = counted(&c, &p, "engine_http_limit_hits_total", mp).await
        && counted(&c, &d, "engine_http_limit_hits_total", md).await;
    row("slowloris on P's and D's HTTP", cut, cnt, &legit, before);

    let before = legit.affected();
    let md = limit_hits(&metrics_text(&c, &d).await);
    let (status, _) = post(
        &c,
        &d.url(),
        json!({"prompt": "w ".repeat(150 << 10), "max_tokens": 4}),
    )
    .await;
    let res: Result<u16, ()> = Ok(status);
    let cnt = counted(&c, &d, "engine_http_limit_hits_total", md).await;
    row(
        "oversized request body",
        matches!(res, Ok(413)),
        cnt,
        &legit,
        before,
    );

    drop((mallory_conn, mallory_side, mallory_rx));
    stop.store(true, Ordering::SeqCst);
    traffic.await.unwrap();
    print_table(&rows, &legit);
    for r in &rows {
        assert!(r.refused && r.counted && r.affected == 0, "{}", r.attack);
    }
    released_within(&p, Duration::from_secs(10)).await;
    released_within(&d, Duration::from_secs(10)).await;
    pool_whole_within(&c, &p, Duration::from_secs(10)).await;
    pool_whole_within(&c, &d, Duration::from_secs(10)).await;
}

fn print_table(rows: &[Row], legit: &Legit) {
    println!("\n| attack | refused | counted | legitimate requests affected |");
    println!("| --- | --- | --- | --- |");
    for r in rows {
        println!(
            "| {} | {} | {} | {} |",
            r.attack,
            if r.refused { "yes" } else { "NO" },
            if r.counted { "yes" } else { "NO" },
            r.affected
        );
    }
    println!(
        "legitimate requests: {} ok, {} mismatched, {} failed\n",
        legit.ok.load(Ordering::SeqCst),
        legit.mismatched.load(Ordering::SeqCst),
        legit.failed.load(Ordering::SeqCst)
    );
}
