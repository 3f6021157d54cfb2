//! proptest strategies for every wire message, bounded by the limits in `message.rs` and
//! `batch.rs`, so that every generated message is one a conforming peer may send.

#![allow(dead_code)] // each test binary uses a different subset

use handoff_proto::*;
use proptest::collection::vec;
use proptest::prelude::*;

pub fn handoff_id() -> impl Strategy<Value = HandoffId> + Clone {
    prop_oneof![
        any::<[u8; 16]>().prop_map(HandoffId::from_bytes),
        Just(HandoffId::from_bytes(u128::to_le_bytes(0))),
        Just(HandoffId::from_bytes(u128::to_le_bytes(u128::MAX))),
    ]
}

pub fn epoch() -> impl Strategy<Value = Epoch> + Clone {
    prop_oneof![
        any::<u32>().prop_map(Epoch),
        Just(Epoch::FIRST),
        Just(Epoch(u32::MAX)),
    ]
}

pub fn transfer_mode() -> impl Strategy<Value = TransferMode> + Clone {
    prop_oneof![Just(TransferMode::Pull), Just(TransferMode::Push)]
}

/// A string of at most `max` bytes (not chars): short unicode, long ASCII, and exactly `max`
/// bytes made of ASCII or of 2-byte characters.
pub fn text(max: usize) -> impl Strategy<Value = String> + Clone {
    let quarter = max / 4; // a char is at most 4 bytes
    prop_oneof![
        4 => proptest::string::string_regex(&format!("\\PC{{0,{}}}", quarter.min(64)))
            .expect("valid regex"),
        2 => proptest::string::string_regex(&format!("[a-zA-Z0-9_./:-]{{0,{max}}}"))
            .expect("valid regex"),
        1 => Just("x".repeat(max)),
        1 => Just("é".repeat(max / 2)),
    ]
    .prop_map(move |s| {
        assert!(s.len() <= max, "strategy bug: {} > {max} bytes", s.len());
        s
    })
}

/// A byte blob of at most `max` bytes, mostly small, sometimes at the limit.
pub fn blob(max: usize) -> impl Strategy<Value = Vec<u8>> + Clone {
    prop_oneof![
        6 => vec(any::<u8>(), 0..64),
        2 => vec(any::<u8>(), 0..=max),
        1 => Just(vec![0xff; max]),
    ]
}

/// A vector of at most `max` items, mostly short, sometimes full.
pub fn bounded_vec<S: Strategy + Clone>(
    s: S,
    max: usize,
) -> impl Strategy<Value = Vec<S::Value>> + Clone
where
    S::Value: Clone,
{
    prop_oneof![
        6 => vec(s.clone(), 0..=max.min(15)),
        2 => vec(s.clone(), 0..=max),
        1 => vec(s, max..=max),
    ]
}

pub fn fingerprint() -> impl Strategy<Value = Fingerprint> + Clone {
    (
        any::<u16>(),
        text(MAX_TEXT_BYTES),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        text(MAX_TEXT_BYTES),
        transfer_mode(),
    )
        .prop_map(
            |(protocol_version, model, num_layers, num_kv_heads, head_dim, dtype, mode)| {
                Fingerprint {
                    protocol_version,
                    model,
                    num_layers,
                    num_kv_heads,
                    head_dim,
                    dtype,
                    mode,
                }
            },
        )
}

pub fn hello() -> impl Strategy<Value = Hello> + Clone {
    (
        text(MAX_TEXT_BYTES),
        any::<u16>(),
        any::<u16>(),
        fingerprint(),
        blob(MAX_BLOB_BYTES),
        blob(MAX_BLOB_BYTES),
        proptest::collection::vec(memory_kind(), 0..=MAX_HELLO_RANKS),
    )
        .prop_map(
            |(engine_id, rank, tp, fingerprint, layout, agent_metadata, memory)| Hello {
                engine_id,
                rank,
                tp,
                fingerprint,
                layout,
                agent_metadata,
                memory,
            },
        )
}

pub fn memory_kind() -> impl Strategy<Value = MemoryKind> + Clone {
    prop_oneof![
        Just(MemoryKind::Host),
        any::<u32>().prop_map(|device| MemoryKind::Cuda { device }),
    ]
}

/// The longest reason a `HelloReply::Refused` may carry.
pub const MAX_REFUSED_REASON: usize = MAX_TEXT_BYTES * 4;

pub fn hello_reply() -> impl Strategy<Value = HelloReply> + Clone {
    prop_oneof![
        hello().prop_map(HelloReply::Accepted),
        text(MAX_REFUSED_REASON).prop_map(|reason| HelloReply::Refused { reason }),
    ]
}

pub fn heartbeat_entry() -> impl Strategy<Value = HeartbeatEntry> + Clone {
    (handoff_id(), epoch()).prop_map(|(handoff, epoch)| HeartbeatEntry { handoff, epoch })
}

pub fn grant() -> impl Strategy<Value = Grant> + Clone {
    (handoff_id(), epoch(), any::<u32>()).prop_map(|(handoff, epoch, lease_ms)| Grant {
        handoff,
        epoch,
        lease_ms,
    })
}

pub fn heartbeat() -> impl Strategy<Value = Heartbeat> + Clone {
    (
        any::<u64>(),
        bounded_vec(heartbeat_entry(), MAX_BATCH_ENTRIES),
    )
        .prop_map(|(seq, entries)| Heartbeat {
            seq,
            mode: TransferMode::Pull,
            entries,
        })
}

/// grants + gone never exceed MAX_BATCH_ENTRIES together.
pub fn grant_batch() -> impl Strategy<Value = GrantBatch> + Clone {
    (any::<u64>(), bounded_vec(grant(), MAX_BATCH_ENTRIES)).prop_flat_map(|(seq, grants)| {
        let room = MAX_BATCH_ENTRIES - grants.len();
        bounded_vec(heartbeat_entry(), room).prop_map(move |gone| GrantBatch {
            seq,
            grants: grants.clone(),
            gone,
        })
    })
}

pub fn pull_done() -> impl Strategy<Value = PullDone> + Clone {
    (
        handoff_id(),
        epoch(),
        any::<u16>(),
        any::<u16>(),
        any::<u16>(),
    )
        .prop_map(
            |(handoff, epoch, p_rank, consumer_rank, consumers)| PullDone {
                handoff,
                epoch,
                p_rank,
                consumer_rank,
                consumers,
            },
        )
}

pub fn release_reason() -> impl Strategy<Value = ReleaseReason> + Clone {
    prop_oneof![
        Just(ReleaseReason::Done),
        Just(ReleaseReason::Rejected),
        Just(ReleaseReason::Aborted),
        Just(ReleaseReason::Cancelled),
        Just(ReleaseReason::Failed),
    ]
}

pub fn release() -> impl Strategy<Value = Release> + Clone {
    (handoff_id(), epoch(), release_reason()).prop_map(|(handoff, epoch, reason)| Release {
        handoff,
        epoch,
        reason,
    })
}

pub fn push_register() -> impl Strategy<Value = PushRegister> + Clone {
    (
        handoff_id(),
        epoch(),
        any::<u16>(),
        any::<u16>(),
        any::<u32>(),
        bounded_vec(any::<u32>(), MAX_REGISTERED_BLOCKS),
        any::<u32>(),
    )
        .prop_map(
            |(handoff, epoch, d_rank, d_tp, num_tokens, block_ids, cached_blocks)| PushRegister {
                handoff,
                epoch,
                d_rank,
                d_tp,
                num_tokens,
                block_ids,
                cached_blocks,
            },
        )
}

pub fn push_done() -> impl Strategy<Value = PushDone> + Clone {
    (
        handoff_id(),
        epoch(),
        any::<u16>(),
        any::<u16>(),
        any::<Option<u64>>(),
    )
        .prop_map(|(handoff, epoch, p_rank, d_rank, digest)| PushDone {
            handoff,
            epoch,
            p_rank,
            d_rank,
            digest,
        })
}

pub fn push_failed() -> impl Strategy<Value = PushFailed> + Clone {
    (handoff_id(), epoch(), any::<u16>(), text(MAX_TEXT_BYTES)).prop_map(
        |(handoff, epoch, p_rank, reason)| PushFailed {
            handoff,
            epoch,
            p_rank,
            reason,
        },
    )
}

pub fn push_cancel() -> impl Strategy<Value = PushCancel> + Clone {
    (handoff_id(), epoch()).prop_map(|(handoff, epoch)| PushCancel { handoff, epoch })
}

pub fn push_cancel_ack() -> impl Strategy<Value = PushCancelAck> + Clone {
    (handoff_id(), epoch(), any::<u16>()).prop_map(|(handoff, epoch, p_rank)| PushCancelAck {
        handoff,
        epoch,
        p_rank,
    })
}

/// Any message a conforming peer may send, every variant equally likely.
pub fn message() -> impl Strategy<Value = Message> + Clone {
    prop_oneof![
        hello().prop_map(Message::Hello),
        hello_reply().prop_map(Message::HelloReply),
        heartbeat().prop_map(Message::Heartbeat),
        grant_batch().prop_map(Message::GrantBatch),
        pull_done().prop_map(Message::PullDone),
        release().prop_map(Message::Release),
        push_register().prop_map(Message::PushRegister),
        push_done().prop_map(Message::PushDone),
        push_failed().prop_map(Message::PushFailed),
        push_cancel().prop_map(Message::PushCancel),
        push_cancel_ack().prop_map(Message::PushCancelAck),
    ]
}

/// A Hello with every field at its limit and every integer at its maximum: the largest Hello a
/// conforming peer may send.
pub fn worst_case_hello() -> Hello {
    Hello {
        engine_id: "e".repeat(MAX_TEXT_BYTES),
        rank: u16::MAX,
        tp: u16::MAX,
        fingerprint: Fingerprint {
            protocol_version: u16::MAX,
            model: "m".repeat(MAX_TEXT_BYTES),
            num_layers: u32::MAX,
            num_kv_heads: u32::MAX,
            head_dim: u32::MAX,
            dtype: "d".repeat(MAX_TEXT_BYTES),
            mode: TransferMode::Push,
        },
        layout: vec![0xff; MAX_BLOB_BYTES],
        agent_metadata: vec![0xff; MAX_BLOB_BYTES],
        memory: vec![MemoryKind::Cuda { device: u32::MAX }; MAX_HELLO_RANKS],
    }
}

/// A small Hello with made-up but plausible values.
pub fn sample_hello() -> Hello {
    Hello {
        engine_id: "prefill-0".into(),
        rank: 0,
        tp: 2,
        fingerprint: Fingerprint {
            protocol_version: 1,
            model: "Qwen/Qwen3-0.6B".into(),
            num_layers: 28,
            num_kv_heads: 8,
            head_dim: 128,
            dtype: "bfloat16".into(),
            mode: TransferMode::Pull,
        },
        layout: vec![1, 2, 3],
        agent_metadata: b"tcp://10.0.0.1:7000".to_vec(),
        memory: vec![
            MemoryKind::Cuda { device: 0 },
            MemoryKind::Cuda { device: 1 },
        ],
    }
}
