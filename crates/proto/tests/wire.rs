//! Binary wire: round trips for every message variant, decoding of hostile bytes, size and field
//! limits, and heartbeat/grant batching.

mod common;

use common::*;
use handoff_proto::*;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;

// ---------------------------------------------------------------------------------------------
// Helpers

/// `decode(encode(m)) == m`, the encoding is versioned, bounded and deterministic.
fn assert_roundtrip(m: &Message) {
    let bytes = encode(m).unwrap_or_else(|e| panic!("{} failed to encode: {e}", m.kind()));
    assert_eq!(bytes[0], PROTOCOL_VERSION);
    assert!(bytes.len() <= MAX_MESSAGE_BYTES);
    let back = decode(&bytes).unwrap_or_else(|e| panic!("{} failed to decode: {e}", m.kind()));
    assert_eq!(&back, m);
    assert_eq!(
        encode(&back).unwrap(),
        bytes,
        "encoding is not deterministic"
    );
}

/// What must hold for `decode` of any input whatsoever: it returns (never panics), its error says
/// what is wrong in the order documented, and an accepted message survives a re-encode.
fn check_decode(bytes: &[u8]) {
    let result = decode(bytes);
    match &result {
        Ok(m) => {
            let again = encode(m).expect("a decoded message must re-encode");
            // Re-encoding is canonical (shortest varints), so it never grows.
            assert!(again.len() <= bytes.len());
            assert_eq!(decode(&again).as_ref(), Ok(m));
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
    if bytes.is_empty() {
        assert_eq!(result, Err(DecodeError::Empty));
    } else if bytes.len() > MAX_MESSAGE_BYTES {
        assert_eq!(result, Err(DecodeError::TooLarge { size: bytes.len() }));
    } else if !versions::speaks(bytes[0]) {
        assert_eq!(
            result,
            Err(DecodeError::UnsupportedVersion {
                got: bytes[0],
                newest: PROTOCOL_VERSION
            })
        );
    }
}

#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(Index, u8),
    Overwrite(Index, u8),
    Truncate(Index),
    Extend(Vec<u8>),
    Insert(Index, Vec<u8>),
    Remove(Index, usize),
    Version(u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<Index>(), 0u8..8).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
        2 => (any::<Index>(), any::<u8>()).prop_map(|(i, v)| Mutation::Overwrite(i, v)),
        1 => any::<Index>().prop_map(Mutation::Truncate),
        1 => vec(any::<u8>(), 1..32).prop_map(Mutation::Extend),
        1 => (any::<Index>(), vec(any::<u8>(), 1..8)).prop_map(|(i, v)| Mutation::Insert(i, v)),
        1 => (any::<Index>(), 1usize..8).prop_map(|(i, n)| Mutation::Remove(i, n)),
        1 => any::<u8>().prop_map(Mutation::Version),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    match m {
        Mutation::FlipBit(i, bit) if !bytes.is_empty() => {
            let i = i.index(bytes.len());
            bytes[i] ^= 1 << bit;
        }
        Mutation::Overwrite(i, v) if !bytes.is_empty() => {
            let i = i.index(bytes.len());
            bytes[i] = *v;
        }
        Mutation::Truncate(i) if !bytes.is_empty() => {
            let n = i.index(bytes.len());
            bytes.truncate(n);
        }
        Mutation::Extend(tail) => bytes.extend_from_slice(tail),
        Mutation::Insert(i, v) => {
            let at = i.index(bytes.len() + 1);
            bytes.splice(at..at, v.iter().copied());
        }
        Mutation::Remove(i, n) if !bytes.is_empty() => {
            let at = i.index(bytes.len());
            let end = (at + n).min(bytes.len());
            bytes.drain(at..end);
        }
        Mutation::Version(v) if !bytes.is_empty() => bytes[0] = *v,
        _ => {}
    }
}

fn entry(i: u64) -> HeartbeatEntry {
    HeartbeatEntry {
        handoff: HandoffId::from_bytes(u128::to_le_bytes(u128::from(i) << 64 | 0xabcd)),
        epoch: Epoch(i as u32),
    }
}

fn grant_for(i: u64) -> Grant {
    Grant {
        handoff: HandoffId::from_bytes(u128::to_le_bytes(u128::from(i) << 64 | 0x1234)),
        epoch: Epoch(i as u32),
        lease_ms: 30_000,
    }
}

fn field_too_long(field: &'static str, len: usize, max: usize) -> Result<Message, DecodeError> {
    Err(DecodeError::FieldTooLong { field, len, max })
}

// ---------------------------------------------------------------------------------------------
// Round trips, one property per variant

macro_rules! roundtrip_per_variant {
    ($($name:ident: $strategy:expr => $variant:path;)*) => {
        proptest! {
            $(
                #[test]
                fn $name(inner in $strategy) {
                    assert_roundtrip(&$variant(inner));
                }
            )*
        }
    };
}

roundtrip_per_variant! {
    roundtrip_hello: hello() => Message::Hello;
    roundtrip_hello_reply: hello_reply() => Message::HelloReply;
    roundtrip_heartbeat: heartbeat() => Message::Heartbeat;
    roundtrip_grant_batch: grant_batch() => Message::GrantBatch;
    roundtrip_pull_done: pull_done() => Message::PullDone;
    roundtrip_release: release() => Message::Release;
    roundtrip_push_register: push_register() => Message::PushRegister;
    roundtrip_push_done: push_done() => Message::PushDone;
    roundtrip_push_failed: push_failed() => Message::PushFailed;
    roundtrip_push_cancel: push_cancel() => Message::PushCancel;
    roundtrip_push_cancel_ack: push_cancel_ack() => Message::PushCancelAck;
}

#[test]
fn worst_case_hello_and_accepted_reply_fit_in_one_message() {
    // Every field of a Hello at its decode limit must still be sendable, or a peer with large
    // transport metadata could never complete a handshake.
    let h = worst_case_hello();
    assert_roundtrip(&Message::Hello(h.clone()));
    assert_roundtrip(&Message::HelloReply(HelloReply::Accepted(h)));
    assert_roundtrip(&Message::HelloReply(HelloReply::Refused {
        reason: "r".repeat(MAX_REFUSED_REASON),
    }));
}

#[test]
fn worst_case_push_register_and_heartbeat_fit_in_one_message() {
    assert_roundtrip(&Message::PushRegister(PushRegister {
        handoff: HandoffId::from_bytes(u128::to_le_bytes(u128::MAX)),
        epoch: Epoch(u32::MAX),
        d_rank: u16::MAX,
        d_tp: u16::MAX,
        num_tokens: u32::MAX,
        block_ids: vec![u32::MAX; MAX_REGISTERED_BLOCKS],
        cached_blocks: u32::MAX,
    }));
    let full = HeartbeatEntry {
        handoff: HandoffId::from_bytes(u128::to_le_bytes(u128::MAX)),
        epoch: Epoch(u32::MAX),
    };
    assert_roundtrip(&Message::Heartbeat(Heartbeat {
        seq: u64::MAX,
        mode: TransferMode::Pull,
        entries: vec![full; MAX_BATCH_ENTRIES],
    }));
}

#[test]
fn worst_case_pull_blocks_fits_in_one_message() {
    // The most lists and blocks a PullBlocks may carry, every number at its widest (a layer-wise
    // list names its layers too): P must always be able to answer.
    let per_list = MAX_REGISTERED_BLOCKS / MAX_LISTS_PER_MESSAGE;
    let lists = (0..MAX_LISTS_PER_MESSAGE)
        .map(|_| BlockList {
            handoff: HandoffId::from_bytes(u128::to_le_bytes(u128::MAX)),
            epoch: Epoch(u32::MAX),
            blocks: vec![u32::MAX; per_list],
            digest: Some(u64::MAX),
            layers: Some(u32::MAX),
        })
        .collect();
    assert_roundtrip(&Message::PullBlocks(PullBlocks { lists }));
}

#[test]
fn release_wire_layout_is_stable() {
    // Pins the format: version, variant index, 16 little-endian id bytes, varint epoch, reason.
    let id = HandoffId::from_bytes(u128::to_le_bytes(0x0011_2233_4455_6677_8899_aabb_ccdd_eeff));
    let bytes = encode(&Message::Release(Release {
        handoff: id,
        epoch: Epoch(300),
        reason: ReleaseReason::Aborted,
    }))
    .unwrap();
    let mut want = vec![PROTOCOL_VERSION, 5];
    want.extend_from_slice(&id.to_bytes());
    want.extend_from_slice(&[0xac, 0x02, 2]); // 300 as a varint, then variant 2
    assert_eq!(bytes, want);
}

#[test]
fn message_kind_and_handoff_are_per_variant() {
    let id = HandoffId::from_bytes(u128::to_le_bytes(42));
    let e = Epoch::FIRST;
    let per_handoff = [
        Message::PullDone(PullDone {
            handoff: id,
            epoch: e,
            p_rank: 0,
            consumer_rank: 0,
            consumers: 1,
        }),
        Message::Release(Release {
            handoff: id,
            epoch: e,
            reason: ReleaseReason::Done,
        }),
        Message::PushRegister(PushRegister {
            handoff: id,
            epoch: e,
            d_rank: 0,
            d_tp: 1,
            num_tokens: 0,
            block_ids: vec![],
            cached_blocks: 0,
        }),
        Message::PushDone(PushDone {
            handoff: id,
            epoch: e,
            p_rank: 0,
            d_rank: 0,
            digest: Some(0xfeed),
        }),
        Message::PushFailed(PushFailed {
            handoff: id,
            epoch: e,
            p_rank: 0,
            reason: String::new(),
        }),
        Message::PushCancel(PushCancel {
            handoff: id,
            epoch: e,
        }),
        Message::PushCancelAck(PushCancelAck {
            handoff: id,
            epoch: e,
            p_rank: 0,
        }),
    ];
    let batched = [
        Message::Hello(sample_hello()),
        Message::HelloReply(HelloReply::Refused {
            reason: "no".into(),
        }),
        Message::Heartbeat(Heartbeat {
            seq: 0,
            mode: TransferMode::Pull,
            entries: vec![],
        }),
        Message::GrantBatch(GrantBatch {
            seq: 0,
            grants: vec![],
            gone: vec![],
        }),
    ];
    for m in &per_handoff {
        assert_eq!(m.handoff(), Some(id), "{}", m.kind());
    }
    for m in &batched {
        assert_eq!(m.handoff(), None, "{}", m.kind());
    }
    let mut kinds: Vec<_> = per_handoff
        .iter()
        .chain(&batched)
        .map(Message::kind)
        .collect();
    kinds.sort_unstable();
    kinds.dedup();
    assert_eq!(kinds.len(), 11, "kinds must be distinct: {kinds:?}");
}

// ---------------------------------------------------------------------------------------------
// Hostile input

proptest! {
    #[test]
    fn roundtrip_any_message(m in message()) {
        assert_roundtrip(&m);
    }

    #[test]
    fn decode_random_bytes_never_panics(bytes in vec(any::<u8>(), 0..1024)) {
        check_decode(&bytes);
    }

    #[test]
    fn decode_random_body_with_current_version_never_panics(
        body in prop_oneof![vec(any::<u8>(), 0..64), vec(any::<u8>(), 0..4096)],
        variant in 0u8..12,
    ) {
        // Past the version check and onto a real (or one-past-the-last) variant, so the bytes
        // reach every message's deserializer.
        let mut bytes = vec![PROTOCOL_VERSION, variant];
        bytes.extend(body);
        check_decode(&bytes);
    }

    #[test]
    fn decode_mutated_encoding_never_panics(m in message(), muts in vec(mutation(), 1..4)) {
        let mut bytes = encode(&m).unwrap();
        for mu in &muts {
            apply(&mut bytes, mu);
        }
        check_decode(&bytes);
    }

    #[test]
    fn truncated_encoding_is_rejected(m in message(), cut in any::<Index>()) {
        let bytes = encode(&m).unwrap();
        let cut = cut.index(bytes.len()); // strictly shorter
        match decode(&bytes[..cut]) {
            Err(DecodeError::Empty) => prop_assert_eq!(cut, 0),
            Err(DecodeError::Malformed(_)) => prop_assert!(cut > 0),
            other => prop_assert!(false, "prefix of {} bytes gave {:?}", cut, other),
        }
    }

    #[test]
    fn extended_encoding_is_rejected(m in message(), tail in vec(any::<u8>(), 1..64)) {
        let mut bytes = encode(&m).unwrap();
        bytes.extend_from_slice(&tail);
        let want = if bytes.len() > MAX_MESSAGE_BYTES {
            DecodeError::TooLarge { size: bytes.len() }
        } else {
            DecodeError::TrailingBytes { trailing: tail.len() }
        };
        prop_assert_eq!(decode(&bytes), Err(want));
    }

    #[test]
    fn other_version_byte_is_rejected(m in message(), v in any::<u8>()) {
        prop_assume!(!versions::speaks(v));
        let mut bytes = encode(&m).unwrap();
        bytes[0] = v;
        prop_assert_eq!(
            decode(&bytes),
            Err(DecodeError::UnsupportedVersion { got: v, newest: PROTOCOL_VERSION })
        );
    }

    #[test]
    fn single_bit_flip_decodes_consistently(m in message(), at in any::<Index>(), bit in 0u8..8) {
        let mut bytes = encode(&m).unwrap();
        let i = at.index(bytes.len());
        bytes[i] ^= 1 << bit;
        check_decode(&bytes);
        if i == 0 {
            prop_assert_eq!(
                decode(&bytes),
                Err(DecodeError::UnsupportedVersion {
                    got: PROTOCOL_VERSION ^ (1 << bit),
                    newest: PROTOCOL_VERSION,
                })
            );
        }
    }
}

#[test]
fn decode_empty_and_version_only() {
    assert_eq!(decode(&[]), Err(DecodeError::Empty));
    assert!(matches!(
        decode(&[PROTOCOL_VERSION]),
        Err(DecodeError::Malformed(_))
    ));
    // Variant index 11 is one past PushCancelAck.
    assert!(matches!(
        decode(&[PROTOCOL_VERSION, 11]),
        Err(DecodeError::Malformed(_))
    ));
}

#[test]
fn decode_huge_declared_lengths_fails_without_allocating_them() {
    // A heartbeat claiming u32::MAX entries, a Hello whose engine id claims 4 GiB, a
    // PushRegister claiming u64::MAX block ids: each must fail cleanly on the short input.
    let varint_u32_max = [0xff, 0xff, 0xff, 0xff, 0x0f];
    let mut hb = vec![PROTOCOL_VERSION, 2, 0];
    hb.extend_from_slice(&varint_u32_max);
    assert!(matches!(decode(&hb), Err(DecodeError::Malformed(_))));

    let mut hello = vec![PROTOCOL_VERSION, 0];
    hello.extend_from_slice(&varint_u32_max);
    hello.extend_from_slice(b"abc");
    assert!(matches!(decode(&hello), Err(DecodeError::Malformed(_))));

    let mut reg = vec![PROTOCOL_VERSION, 6];
    reg.extend_from_slice(&[0; 16]); // id
    reg.extend_from_slice(&[1, 0, 1, 16]); // epoch, d_rank, d_tp, num_tokens
    reg.extend_from_slice(&[0xff; 9]);
    reg.push(0x01); // u64::MAX as a varint
    assert!(matches!(decode(&reg), Err(DecodeError::Malformed(_))));
}

// ---------------------------------------------------------------------------------------------
// Size and field limits

/// A Hello whose encoding is exactly `size` bytes (its layout is padded past the field limit, which
/// only `decode` checks).
fn hello_of_encoded_size(size: usize) -> Message {
    let mut h = sample_hello();
    h.layout = vec![7; 20_000]; // a 3-byte length prefix, like the final one
    let base = encode_raw(&Message::Hello(h.clone())).len() - 20_000;
    h.layout = vec![7; size - base];
    let m = Message::Hello(h);
    assert_eq!(postcard_len(&m), size);
    m
}

fn postcard_len(m: &Message) -> usize {
    encode_raw(m).len()
}

/// Encodes without any limit check, to build what a buggy or hostile peer could send.
fn encode_raw(m: &Message) -> Vec<u8> {
    postcard::to_extend(m, vec![PROTOCOL_VERSION]).expect("serializable")
}

#[test]
fn encode_rejects_message_over_max_bytes() {
    let at_limit = hello_of_encoded_size(MAX_MESSAGE_BYTES);
    let bytes = encode_raw(&at_limit);
    assert_eq!(bytes.len(), MAX_MESSAGE_BYTES);
    // Size is fine; the oversized layout field is what decode refuses.
    assert!(matches!(
        decode(&bytes),
        Err(DecodeError::FieldTooLong {
            field: "layout",
            ..
        })
    ));

    // encode refuses what every receiver would refuse, naming the field.
    assert_eq!(
        encode(&at_limit),
        Err(EncodeError::OverLimit(DecodeError::FieldTooLong {
            field: "layout",
            len: match &at_limit {
                Message::Hello(h) => h.layout.len(),
                _ => unreachable!(),
            },
            max: MAX_BLOB_BYTES
        }))
    );
    let big_hb = Message::Heartbeat(Heartbeat {
        seq: 1,
        mode: TransferMode::Pull,
        entries: (0..4 * MAX_BATCH_ENTRIES as u64).map(entry).collect(),
    });
    assert!(matches!(
        encode(&big_hb),
        Err(EncodeError::OverLimit(DecodeError::FieldTooLong {
            field: "entries",
            ..
        }))
    ));
}

#[test]
fn decode_rejects_input_over_max_bytes() {
    let mut bytes = encode_raw(&hello_of_encoded_size(MAX_MESSAGE_BYTES));
    bytes.push(0);
    assert_eq!(
        decode(&bytes),
        Err(DecodeError::TooLarge {
            size: MAX_MESSAGE_BYTES + 1
        })
    );
    let junk = vec![PROTOCOL_VERSION; 10 * MAX_MESSAGE_BYTES];
    assert_eq!(
        decode(&junk),
        Err(DecodeError::TooLarge {
            size: 10 * MAX_MESSAGE_BYTES
        })
    );
}

#[test]
fn decode_rejects_every_other_version() {
    let bytes = encode_raw(&Message::Hello(sample_hello()));
    for v in 0..=u8::MAX {
        let mut b = bytes.clone();
        b[0] = v;
        if v == PROTOCOL_VERSION {
            assert!(decode(&b).is_ok());
        } else if versions::speaks(v) {
            // A version-8 hello is no version-7 one (it has one more field).
            assert!(matches!(decode(&b), Err(DecodeError::TrailingBytes { .. })));
        } else {
            assert_eq!(
                decode(&b),
                Err(DecodeError::UnsupportedVersion {
                    got: v,
                    newest: PROTOCOL_VERSION
                })
            );
        }
    }
}

#[test]
fn decode_rejects_trailing_bytes() {
    let m = Message::PushCancel(PushCancel {
        handoff: HandoffId::from_bytes(u128::to_le_bytes(9)),
        epoch: Epoch(3),
    });
    let mut bytes = encode_raw(&m);
    bytes.push(0);
    assert_eq!(
        decode(&bytes),
        Err(DecodeError::TrailingBytes { trailing: 1 })
    );
    // Two valid messages glued together are not one message.
    let one = encode_raw(&m);
    let mut two = one.clone();
    two.extend_from_slice(&one[1..]);
    assert_eq!(
        decode(&two),
        Err(DecodeError::TrailingBytes {
            trailing: one.len() - 1
        })
    );
}

#[test]
fn heartbeat_over_max_batch_entries_is_rejected() {
    let hb = |n: u64| {
        Message::Heartbeat(Heartbeat {
            seq: 5,
            mode: TransferMode::Pull,
            entries: (0..n).map(entry).collect(),
        })
    };
    let max = MAX_BATCH_ENTRIES as u64;
    assert!(decode(&encode_raw(&hb(max))).is_ok());
    // It still fits in the byte cap: only the entry cap stops it.
    let over = encode_raw(&hb(max + 1));
    assert_eq!(
        decode(&over),
        field_too_long("entries", MAX_BATCH_ENTRIES + 1, MAX_BATCH_ENTRIES)
    );
}

#[test]
fn grant_batch_over_max_batch_entries_is_rejected() {
    let gb = |g: u64, x: u64| {
        Message::GrantBatch(GrantBatch {
            seq: 5,
            grants: (0..g).map(grant_for).collect(),
            gone: (0..x).map(entry).collect(),
        })
    };
    let half = MAX_BATCH_ENTRIES as u64 / 2;
    assert!(decode(&encode_raw(&gb(half, half))).is_ok());
    // The cap is on grants and gone together.
    for (g, x) in [(half, half + 1), (2 * half + 1, 0), (0, 2 * half + 1)] {
        assert_eq!(
            decode(&encode_raw(&gb(g, x))),
            field_too_long("grants", (g + x) as usize, MAX_BATCH_ENTRIES),
            "{g} grants + {x} gone"
        );
    }
}

#[test]
fn push_register_with_too_many_block_ids_is_rejected() {
    let reg = |n: usize| {
        Message::PushRegister(PushRegister {
            handoff: HandoffId::from_bytes(u128::to_le_bytes(1)),
            epoch: Epoch::FIRST,
            d_rank: 0,
            d_tp: 1,
            num_tokens: 16 * n as u32,
            block_ids: (0..n as u32).collect(),
            cached_blocks: 0,
        })
    };
    assert!(decode(&encode_raw(&reg(MAX_REGISTERED_BLOCKS))).is_ok());
    assert_eq!(
        decode(&encode_raw(&reg(MAX_REGISTERED_BLOCKS + 1))),
        field_too_long(
            "block_ids",
            MAX_REGISTERED_BLOCKS + 1,
            MAX_REGISTERED_BLOCKS
        )
    );
}

#[test]
fn hello_fields_over_their_limits_are_rejected_by_name() {
    let text = MAX_TEXT_BYTES;
    let blob = MAX_BLOB_BYTES;
    type Edit = fn(&mut Hello);
    let cases: [(&str, usize, Edit); 6] = [
        ("engine_id", text, |h| {
            h.engine_id = "e".repeat(MAX_TEXT_BYTES + 1)
        }),
        ("model", text, |h| {
            h.fingerprint.model = "m".repeat(MAX_TEXT_BYTES + 1)
        }),
        ("dtype", text, |h| {
            h.fingerprint.dtype = "d".repeat(MAX_TEXT_BYTES + 1)
        }),
        ("layout", blob, |h| h.layout = vec![0; MAX_BLOB_BYTES + 1]),
        ("agent_metadata", blob, |h| {
            h.agent_metadata = vec![0; MAX_BLOB_BYTES + 1]
        }),
        ("memory", MAX_HELLO_RANKS, |h| {
            h.memory = vec![MemoryKind::Host; MAX_HELLO_RANKS + 1]
        }),
    ];
    for (field, max, edit) in cases {
        let mut h = sample_hello();
        edit(&mut h);
        let want = field_too_long(field, max + 1, max);
        assert_eq!(decode(&encode_raw(&Message::Hello(h.clone()))), want);
        let reply = Message::HelloReply(HelloReply::Accepted(h));
        assert_eq!(decode(&encode_raw(&reply)), want, "accepted reply");
    }
}

#[test]
fn reasons_over_their_limits_are_rejected() {
    let refused = |n: usize| {
        Message::HelloReply(HelloReply::Refused {
            reason: "r".repeat(n),
        })
    };
    assert!(decode(&encode_raw(&refused(MAX_REFUSED_REASON))).is_ok());
    assert_eq!(
        decode(&encode_raw(&refused(MAX_REFUSED_REASON + 1))),
        field_too_long("reason", MAX_REFUSED_REASON + 1, MAX_REFUSED_REASON)
    );
    let failed = |n: usize| {
        Message::PushFailed(PushFailed {
            handoff: HandoffId::from_bytes(u128::to_le_bytes(1)),
            epoch: Epoch::FIRST,
            p_rank: 0,
            reason: "f".repeat(n),
        })
    };
    assert!(decode(&encode_raw(&failed(MAX_TEXT_BYTES))).is_ok());
    assert_eq!(
        decode(&encode_raw(&failed(MAX_TEXT_BYTES + 1))),
        field_too_long("reason", MAX_TEXT_BYTES + 1, MAX_TEXT_BYTES)
    );
}

// ---------------------------------------------------------------------------------------------
// Batching

#[test]
fn split_heartbeat_of_100k_entries_covers_each_once_in_order() {
    // Worst-case sizes: max ids and epochs, and seqs high enough to need 10-byte varints.
    let entries: Vec<HeartbeatEntry> = (0..100_000u64)
        .map(|i| HeartbeatEntry {
            handoff: HandoffId::from_bytes(u128::to_le_bytes(u128::MAX - u128::from(i))),
            epoch: Epoch(u32::MAX - i as u32),
        })
        .collect();
    let mut next = u64::MAX - 1000;
    let batches = split_heartbeat(&entries, TransferMode::Pull, || {
        next += 1;
        next
    });
    assert_eq!(batches.len(), 100_000usize.div_ceil(MAX_BATCH_ENTRIES));
    let mut seqs: Vec<u64> = batches.iter().map(|b| b.seq).collect();
    seqs.sort_unstable();
    seqs.dedup();
    assert_eq!(seqs.len(), batches.len(), "seqs must be distinct");
    for b in &batches {
        assert!(!b.entries.is_empty() && b.entries.len() <= MAX_BATCH_ENTRIES);
        let m = Message::Heartbeat(b.clone());
        let bytes = encode(&m).expect("each heartbeat fits");
        assert!(bytes.len() <= MAX_MESSAGE_BYTES);
        assert_eq!(decode(&bytes), Ok(m));
    }
    let flat: Vec<HeartbeatEntry> = batches.into_iter().flat_map(|b| b.entries).collect();
    assert_eq!(flat, entries);
}

#[test]
fn split_heartbeat_edges() {
    let mut seq = 0;
    let mut next = || {
        seq += 1;
        seq
    };
    assert!(split_heartbeat(&[], TransferMode::Pull, &mut next).is_empty());
    let one: Vec<_> = (0..MAX_BATCH_ENTRIES as u64).map(entry).collect();
    assert_eq!(
        split_heartbeat(&one, TransferMode::Pull, &mut next).len(),
        1
    );
    let over: Vec<_> = (0..=MAX_BATCH_ENTRIES as u64).map(entry).collect();
    let b = split_heartbeat(&over, TransferMode::Pull, &mut next);
    let lens: Vec<_> = b.iter().map(|b| b.entries.len()).collect();
    assert_eq!(lens, [MAX_BATCH_ENTRIES, 1]);
    assert_eq!((b[0].seq, b[1].seq), (2, 3));
}

#[test]
fn worst_case_grant_reply_fits_in_one_message() {
    let hb_entries: Vec<HeartbeatEntry> = (0..MAX_BATCH_ENTRIES as u128)
        .map(|i| HeartbeatEntry {
            handoff: HandoffId::from_bytes(u128::to_le_bytes(u128::MAX - i)),
            epoch: Epoch(u32::MAX),
        })
        .collect();
    let grants: Vec<Grant> = hb_entries
        .iter()
        .map(|e| Grant {
            handoff: e.handoff,
            epoch: e.epoch,
            lease_ms: u32::MAX,
        })
        .collect();
    let batches = split_grants(u64::MAX, grants.clone(), vec![]);
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].grants, grants);
    let m = Message::GrantBatch(batches[0].clone());
    let bytes = encode(&m).expect("the reply to a full heartbeat fits in one message");
    assert!(bytes.len() <= MAX_MESSAGE_BYTES);
    assert_eq!(decode(&bytes), Ok(m));
    // Same when every entry is gone instead, or half and half.
    for b in [
        split_grants(u64::MAX, vec![], hb_entries.clone()),
        split_grants(
            u64::MAX,
            grants[..1000].to_vec(),
            hb_entries[1000..].to_vec(),
        ),
    ] {
        assert_eq!(b.len(), 1);
        assert_roundtrip(&Message::GrantBatch(b[0].clone()));
    }
}

#[test]
fn split_grants_with_grants_and_gone() {
    let grants: Vec<Grant> = (0..2500).map(grant_for).collect();
    let gone: Vec<HeartbeatEntry> = (10_000..11_700).map(entry).collect();
    let batches = split_grants(77, grants.clone(), gone.clone());
    let shape: Vec<(usize, usize)> = batches
        .iter()
        .map(|b| (b.grants.len(), b.gone.len()))
        .collect();
    assert_eq!(shape, [(2000, 0), (500, 1500), (0, 200)]);
    for b in &batches {
        assert_eq!(b.seq, 77, "every batch carries the heartbeat's seq");
        assert_roundtrip(&Message::GrantBatch(b.clone()));
    }
    let all_grants: Vec<Grant> = batches.iter().flat_map(|b| b.grants.clone()).collect();
    let all_gone: Vec<HeartbeatEntry> = batches.iter().flat_map(|b| b.gone.clone()).collect();
    assert_eq!(all_grants, grants);
    assert_eq!(all_gone, gone);

    assert!(split_grants(1, vec![], vec![]).is_empty());
    let only_gone = split_grants(2, vec![], gone[..3].to_vec());
    assert_eq!(only_gone.len(), 1);
    assert_eq!(only_gone[0].gone, gone[..3]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn split_grants_is_a_tight_ordered_partition(
        ng in 0u64..7000,
        nx in 0u64..7000,
        seq in any::<u64>(),
    ) {
        let grants: Vec<Grant> = (0..ng).map(grant_for).collect();
        let gone: Vec<HeartbeatEntry> = (0..nx).map(entry).collect();
        let batches = split_grants(seq, grants.clone(), gone.clone());
        let total = (ng + nx) as usize;
        prop_assert_eq!(batches.len(), total.div_ceil(MAX_BATCH_ENTRIES));
        for (i, b) in batches.iter().enumerate() {
            let n = b.grants.len() + b.gone.len();
            prop_assert_eq!(b.seq, seq);
            prop_assert!(n > 0 && n <= MAX_BATCH_ENTRIES);
            if i + 1 < batches.len() {
                prop_assert_eq!(n, MAX_BATCH_ENTRIES, "only the last batch may be short");
            }
            prop_assert!(encode(&Message::GrantBatch(b.clone())).is_ok());
        }
        let g: Vec<Grant> = batches.iter().flat_map(|b| b.grants.clone()).collect();
        let x: Vec<HeartbeatEntry> = batches.iter().flat_map(|b| b.gone.clone()).collect();
        prop_assert_eq!(g, grants);
        prop_assert_eq!(x, gone);
    }

    #[test]
    fn split_heartbeat_is_an_ordered_partition(n in 0u64..9000, first in any::<u64>()) {
        let entries: Vec<HeartbeatEntry> = (0..n).map(entry).collect();
        let mut next = first;
        let batches = split_heartbeat(&entries, TransferMode::Pull, || {
            next = next.wrapping_add(1);
            next
        });
        prop_assert_eq!(batches.len(), (n as usize).div_ceil(MAX_BATCH_ENTRIES));
        for (i, b) in batches.iter().enumerate() {
            prop_assert_eq!(b.seq, first.wrapping_add(i as u64 + 1));
            prop_assert!(!b.entries.is_empty() && b.entries.len() <= MAX_BATCH_ENTRIES);
        }
        let flat: Vec<HeartbeatEntry> = batches.into_iter().flat_map(|b| b.entries).collect();
        prop_assert_eq!(flat, entries);
    }
}

#[test]
fn block_lists_split_into_messages_a_peer_accepts() {
    let lists: Vec<BlockList> = (0..1500u32)
        .map(|i| BlockList {
            handoff: HandoffId::from_bytes((i as u128 + 1).to_le_bytes()),
            epoch: Epoch::FIRST,
            blocks: (0..(i % 40)).map(|b| b * 1_000_003).collect(),
            digest: Some(u64::MAX - i as u64),
            layers: (i % 3 == 0).then_some(u32::MAX - i),
        })
        .collect();
    let (msgs, too_long) = split_block_lists(lists.clone());
    assert!(too_long.is_empty());
    assert!(msgs.len() > 1);
    for m in &msgs {
        assert!(m.lists.len() <= MAX_LISTS_PER_MESSAGE);
        assert!(m.lists.iter().map(|l| l.blocks.len()).sum::<usize>() <= MAX_REGISTERED_BLOCKS);
        assert_roundtrip(&Message::PullBlocks(m.clone()));
    }
    let back: Vec<BlockList> = msgs.into_iter().flat_map(|m| m.lists).collect();
    assert_eq!(back, lists);
    // One list longer than a message may carry is set apart, never sent half.
    let long = BlockList {
        handoff: HandoffId::from_bytes([9; 16]),
        epoch: Epoch::FIRST,
        blocks: vec![1; MAX_REGISTERED_BLOCKS + 1],
        digest: None,
        layers: None,
    };
    let (msgs, too_long) = split_block_lists(vec![long.clone()]);
    assert!(msgs.is_empty());
    assert_eq!(too_long, vec![long]);
}
