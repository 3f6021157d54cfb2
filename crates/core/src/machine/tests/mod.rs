//! Unit tests of the core on a simulated clock: each drives one `ConnectorCore` through the
//! inputs of a case and checks what it asks its executor to do. A module per topic; the helpers
//! they share are here.

use std::time::Duration;

use handoff_plan::testing::tiny_spec;
use handoff_plan::{KvSpec, RankLayout};
use handoff_proto::{
    Heartbeat, HeartbeatEntry, Hello, HelloReply, KvTransferParams, MemoryKind, Message,
    ReleaseReason, TransferMode,
};

use super::*;
use crate::worker_protocol::{PushLayer, WorkerHello, WorkerOp, WorkerReport};
use crate::{Hooks, Input};

mod digest;
mod handshake;
mod lifecycle;
mod push_grants;

fn spec() -> KvSpec {
    tiny_spec(2)
}

fn core(engine: &str, role: Role) -> ConnectorCore {
    core_with(engine, role, false)
}

fn core_with(engine: &str, role: Role, kv_digest: bool) -> ConnectorCore {
    core_in(engine, role, TransferMode::Pull, kv_digest)
}

fn core_in(engine: &str, role: Role, mode: TransferMode, kv_digest: bool) -> ConnectorCore {
    core_of(engine, role, mode, kv_digest, ProducerConfig::default())
}

fn core_of(
    engine: &str,
    role: Role,
    mode: TransferMode,
    kv_digest: bool,
    producer: ProducerConfig,
) -> ConnectorCore {
    ConnectorCore::new(
        CoreConfig {
            engine_id: engine.into(),
            role,
            mode,
            model: "m".into(),
            dtype: "bf16".into(),
            advertise_host: "127.0.0.1".into(),
            side_channel_port: 7000,
            producer,
            consumer: Default::default(),
            opaque_blocks: false,
            kv_digest,
            peer_hosts: Vec::new(),
            protocol_version: handoff_proto::PROTOCOL_VERSION,
            layerwise_pull: false,
            layer_reports: Default::default(),
        },
        vec![WorkerHello {
            rank: 0,
            layout: RankLayout::cross_layer(spec(), 0, 64, 0).unwrap(),
            agent: format!("{engine}-r0"),
            metadata: vec![1, 2, 3],
            memory: Default::default(),
            groups: Default::default(),
        }],
    )
    .unwrap()
}

fn t(ms: u64) -> Time {
    Duration::from_millis(ms)
}

fn hello_of(c: &ConnectorCore) -> Hello {
    c.hello.clone()
}

/// The typed hooks on a core at one moment (what the executor does, in place).
struct At<'a>(std::cell::RefCell<&'a mut ConnectorCore>, Time);

impl crate::Hooks for At<'_> {
    type Error = CoreError;
    fn give(&self, input: Input) -> Result<crate::Answer, CoreError> {
        self.0.borrow_mut().handle(input, self.1)
    }
}

fn at(c: &mut ConnectorCore, now: Time) -> At<'_> {
    At(std::cell::RefCell::new(c), now)
}

/// P's params for a pull handoff it created (a prefill started and finished).
fn params(p: &mut ConnectorCore, n: u8) -> KvTransferParams {
    let mut id = [0u8; 16];
    id[0] = n;
    id[15] = 0xa5;
    let leg = KvTransferParams::for_prefill_leg();
    let p = at(p, t(0));
    p.prefill_started("r", &leg, HandoffId::from_bytes(id), vec![1, 2], 32)
        .unwrap();
    p.prefill_ended("r", crate::PrefillOutcome::Finished)
        .unwrap()
        .params
        .unwrap()
}

/// A D core connected to P on `conn` (what an executor would do with D's connect).
fn connected_d(p: &mut ConnectorCore, prm: &KvTransferParams, conn: ConnId) -> ConnectorCore {
    connect(p, core("d", Role::Decode), prm, conn)
}

fn connect(
    p: &mut ConnectorCore,
    mut d: ConnectorCore,
    prm: &KvTransferParams,
    conn: ConnId,
) -> ConnectorCore {
    d.on_request_arrived(1, prm, 32, t(1)).unwrap();
    let r = d.ready();
    assert_eq!(r.connects.len(), 1, "D dials P once");
    let hello = r.connects[0].hello.clone();
    let attempt = r.connects[0].attempt;
    d.advance(r);
    p.handle_accepted(100, hello, None, t(1));
    let rp = p.ready();
    let reply = rp.messages[0].1.clone();
    p.advance(rp);
    d.handle_connected("p", attempt, conn, reply, t(2));
    d
}
