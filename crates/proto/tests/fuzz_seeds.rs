//! The decoder fuzz target starts from `fuzz/seeds/decode/`: one valid encoding of every message
//! kind, in this build's protocol version. Stale seeds only exercise the version check, so this
//! test fails when a seed no longer decodes or a kind has none.
//! `HANDOFF_WRITE_FUZZ_SEEDS=1 cargo test -p handoff-proto --test fuzz_seeds` writes them anew.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;

use common::sample_hello;
use handoff_proto::*;

fn seeds_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/decode")
}

/// One plausible message of every kind (two for the hello reply's two shapes).
fn samples() -> Vec<(&'static str, Message)> {
    let id = HandoffId::from_bytes(u128::to_le_bytes(0x0011_2233_4455_6677_8899_aabb_ccdd_eeff));
    let e = Epoch(3);
    let entry = HeartbeatEntry {
        handoff: id,
        epoch: e,
    };
    vec![
        ("hello", Message::Hello(sample_hello())),
        (
            "hello_reply_accepted",
            Message::HelloReply(HelloReply::Accepted(sample_hello())),
        ),
        (
            "hello_reply_refused",
            Message::HelloReply(HelloReply::Refused {
                reason: "model differs".into(),
            }),
        ),
        (
            "heartbeat",
            Message::Heartbeat(Heartbeat {
                seq: 7,
                mode: TransferMode::Pull,
                entries: vec![entry],
            }),
        ),
        (
            "grant_batch",
            Message::GrantBatch(GrantBatch {
                seq: 7,
                grants: vec![Grant {
                    handoff: id,
                    epoch: e,
                    lease_ms: 30_000,
                }],
                gone: vec![entry],
            }),
        ),
        (
            "pull_done",
            Message::PullDone(PullDone {
                handoff: id,
                epoch: e,
                p_rank: 1,
                consumer_rank: 0,
                consumers: 2,
            }),
        ),
        (
            "release",
            Message::Release(Release {
                handoff: id,
                epoch: e,
                reason: ReleaseReason::Aborted,
            }),
        ),
        (
            "push_register",
            Message::PushRegister(PushRegister {
                handoff: id,
                epoch: e,
                d_rank: 0,
                d_tp: 2,
                num_tokens: 40,
                block_ids: vec![12, 13],
                cached_blocks: 1,
            }),
        ),
        (
            "push_done",
            Message::PushDone(PushDone {
                handoff: id,
                epoch: e,
                p_rank: 0,
                d_rank: 1,
                digest: Some(0xfeed),
            }),
        ),
        (
            "push_failed",
            Message::PushFailed(PushFailed {
                handoff: id,
                epoch: e,
                p_rank: 0,
                reason: "write failed".into(),
            }),
        ),
        (
            "push_cancel",
            Message::PushCancel(PushCancel {
                handoff: id,
                epoch: e,
            }),
        ),
        (
            "push_cancel_ack",
            Message::PushCancelAck(PushCancelAck {
                handoff: id,
                epoch: e,
                p_rank: 0,
            }),
        ),
        (
            "blocks_query",
            Message::BlocksQuery(BlocksQuery {
                entries: vec![entry],
            }),
        ),
        (
            "pull_blocks",
            Message::PullBlocks(PullBlocks {
                lists: vec![BlockList {
                    handoff: id,
                    epoch: e,
                    blocks: vec![5, 6, 9],
                    digest: None,
                    layers: None,
                }],
            }),
        ),
    ]
}

#[test]
fn every_fuzz_seed_decodes_and_every_kind_has_one() {
    let dir = seeds_dir();
    if std::env::var_os("HANDOFF_WRITE_FUZZ_SEEDS").is_some() {
        for entry in std::fs::read_dir(&dir).expect("the seeds folder") {
            std::fs::remove_file(entry.expect("a seed").path()).expect("stale seed removed");
        }
        for (name, msg) in samples() {
            std::fs::write(dir.join(name), encode(&msg).expect("encodes")).expect("seed written");
        }
    }
    let mut kinds = BTreeSet::new();
    for entry in std::fs::read_dir(&dir).expect("the seeds folder") {
        let path = entry.expect("a seed").path();
        let bytes = std::fs::read(&path).expect("readable");
        match decode(&bytes) {
            Ok(m) => kinds.insert(m.kind()),
            Err(e) => panic!(
                "{} does not decode ({e}): rewrite the seeds with HANDOFF_WRITE_FUZZ_SEEDS=1",
                path.display()
            ),
        };
    }
    let want: BTreeSet<_> = samples().iter().map(|(_, m)| m.kind()).collect();
    assert_eq!(kinds, want, "a message kind without a fuzz seed");
}
