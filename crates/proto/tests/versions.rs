//! Rolling upgrades: this build speaks the previous release's protocol (version 7) byte for byte.
//! `fixtures/v7-frames.txt` holds frames that the previous release's own encoder wrote for the
//! messages built here (`Hello` without `memory` there); each must decode to the same message
//! here, and encoding it in version 7 here must give the same bytes.

use handoff_proto::*;

const FIXTURE: &str = include_str!("fixtures/v7-frames.txt");

fn from_hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn frames() -> Vec<(String, Vec<u8>)> {
    FIXTURE
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (name, hex) = l.split_once(' ').expect("name hex");
            (name.to_string(), from_hex(hex.trim()))
        })
        .collect()
}

fn handoff() -> HandoffId {
    "0123456789abcdef0123456789abcdef".parse().unwrap()
}

/// The messages the fixture's frames were made from, as this build builds them: a version-7
/// hello is host memory on every rank, and says version 7 in its fingerprint.
fn message(name: &str) -> Message {
    let h = handoff();
    let hello = |engine: &str| Hello {
        engine_id: engine.into(),
        rank: 1,
        tp: 2,
        fingerprint: Fingerprint {
            protocol_version: 7,
            model: "smollm2".into(),
            num_layers: 30,
            num_kv_heads: 3,
            head_dim: 64,
            dtype: "float32".into(),
            mode: TransferMode::Pull,
        },
        layout: vec![1, 2, 3],
        agent_metadata: b"127.0.0.1:4000".to_vec(),
        memory: vec![MemoryKind::Host; 2],
    };
    match name {
        "hello" => Message::Hello(hello("d-engine")),
        "hello_accepted" => Message::HelloReply(HelloReply::Accepted(hello("p-engine"))),
        "hello_refused" => Message::HelloReply(HelloReply::Refused {
            reason: "incompatible peer".into(),
        }),
        "heartbeat" => Message::Heartbeat(Heartbeat {
            seq: 5,
            mode: TransferMode::Push,
            entries: vec![HeartbeatEntry {
                handoff: h,
                epoch: Epoch(2),
            }],
        }),
        "pull_done" => Message::PullDone(PullDone {
            handoff: h,
            epoch: Epoch(2),
            p_rank: 1,
            consumer_rank: 0,
            consumers: 2,
        }),
        "push_done" => Message::PushDone(PushDone {
            handoff: h,
            epoch: Epoch(2),
            p_rank: 0,
            d_rank: 1,
            digest: Some(77),
        }),
        "release" => Message::Release(Release {
            handoff: h,
            epoch: Epoch(2),
            reason: ReleaseReason::Rejected,
        }),
        "pull_blocks" => Message::PullBlocks(PullBlocks {
            lists: vec![BlockList {
                handoff: h,
                epoch: Epoch(2),
                blocks: vec![4, 5],
                digest: Some(9),
                layers: Some(3),
            }],
        }),
        other => panic!("no message named {other} here"),
    }
}

#[test]
fn the_previous_release_s_frames_decode_here_and_encode_alike() {
    let frames = frames();
    assert_eq!(frames.len(), 8, "the fixture holds every message above");
    for (name, bytes) in frames {
        assert_eq!(bytes[0], 7, "{name}: a version-7 frame");
        let want = message(&name);
        assert_eq!(decode(&bytes), Ok(want.clone()), "{name} decodes");
        assert_eq!(
            decode_up_to(&bytes, 7),
            Ok((want.clone(), 7)),
            "{name}, pinned to 7"
        );
        assert_eq!(encode_as(&want, 7).unwrap(), bytes, "{name} encodes alike");
    }
}

#[test]
fn a_hello_in_this_version_is_not_the_previous_one() {
    // The power of the test above: this build's own hello differs from version 7's, so a
    // decoder that ignored the version byte would fail it.
    let Message::Hello(mut hello) = message("hello") else {
        unreachable!()
    };
    hello.fingerprint.protocol_version = PROTOCOL_VERSION as u16;
    let now = encode(&Message::Hello(hello.clone())).unwrap();
    let before = encode_as(&Message::Hello(hello), 7).unwrap();
    assert_ne!(now[1..], before[1..]);
    let mut relabelled = now.clone();
    relabelled[0] = 7;
    assert!(
        decode(&relabelled).is_err(),
        "a version-8 hello is no version-7 one"
    );
}

#[test]
fn an_engine_pinned_to_the_previous_version_refuses_this_one() {
    let bytes = encode(&message("pull_done")).unwrap();
    assert_eq!(
        decode_up_to(&bytes, 7),
        Err(DecodeError::UnsupportedVersion {
            got: PROTOCOL_VERSION,
            newest: 7
        })
    );
}

#[test]
fn device_memory_cannot_be_said_in_the_previous_version() {
    let Message::Hello(mut hello) = message("hello") else {
        unreachable!()
    };
    hello.memory[1] = MemoryKind::Cuda { device: 1 };
    let err = encode_as(&Message::Hello(hello.clone()), 7).unwrap_err();
    assert!(err.to_string().contains("CUDA device 1"), "{err}");
    assert!(encode_as(&Message::Hello(hello), PROTOCOL_VERSION).is_ok());
}

#[test]
fn a_version_this_build_does_not_speak_is_an_error_both_ways() {
    let m = message("release");
    assert!(encode_as(&m, 6).is_err());
    assert!(encode_as(&m, PROTOCOL_VERSION + 1).is_err());
    let mut bytes = encode(&m).unwrap();
    bytes[0] = 6;
    assert!(matches!(
        decode(&bytes),
        Err(DecodeError::UnsupportedVersion { got: 6, .. })
    ));
}

#[test]
fn the_compatibility_key_is_the_previous_release_s() {
    // What the previous release's own code (commit ba238f9) computed for this fingerprint: a
    // router that pairs by key pairs its engines with this release's.
    let Message::Hello(hello) = message("hello") else {
        unreachable!()
    };
    let mut f = hello.fingerprint;
    assert_eq!(f.compat_key("head-major", false), "a53e8b810322");
    assert_eq!(f.compat_key("token-major", true), "f0e54059d1e7");
    f.protocol_version = PROTOCOL_VERSION as u16;
    assert_eq!(f.compat_key("head-major", false), "a53e8b810322");
    // It still covers what must match: another model is another key.
    f.model = "other".into();
    assert_ne!(f.compat_key("head-major", false), "a53e8b810322");
}

#[test]
fn a_hello_under_an_over_long_variant_index_is_still_version_7_s() {
    // Postcard takes 0x80 0x00 for the variant index 0 (a hello). Read by its first byte alone,
    // such a frame was decoded as this version's hello, `memory` included (here a CUDA rank),
    // which version 7 cannot say back: the decode fuzz target's crash in CI.
    let Message::Hello(mut hello) = message("hello") else {
        unreachable!()
    };
    hello.fingerprint.protocol_version = PROTOCOL_VERSION as u16;
    hello.memory[1] = MemoryKind::Cuda { device: 1 };
    let now = encode(&Message::Hello(hello)).unwrap();
    assert_eq!(now[1], 0, "a hello's variant index");
    let mut over_long = vec![7, 0x80];
    over_long.extend_from_slice(&now[1..]);
    // Read as version 7's hello, which has no `memory`: its bytes are left over.
    assert!(
        decode_up_to(&over_long, PROTOCOL_VERSION).is_err(),
        "a version-8 hello decoded as version 7's"
    );
    // The same frame in canonical spelling is no version-7 hello either.
    let mut canonical = now.clone();
    canonical[0] = 7;
    assert!(decode(&canonical).is_err());
    // And version 7's own hello under the over-long index is read as the hello it is.
    let v7 = encode_as(&message("hello"), 7).unwrap();
    let mut v7_long = vec![7, 0x80];
    v7_long.extend_from_slice(&v7[1..]);
    assert_eq!(decode(&v7_long), Ok(message("hello")));
}
