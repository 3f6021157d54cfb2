//! Layer-wise pull: reads only of saved layers, releases and failures during the prefill, lists that go back, siblings, the staging quota, and time for a long prompt's bytes.

use super::*;

/// A layer-wise pull's D: its request arrives with the proxy's handoff id and no block ids, at
/// the moment P's prefill is about to start. Blocks [100..104] are allocated at once.
fn layerwise_d_arrives(pair: &mut Pair, id: handoff_proto::HandoffId) {
    let mut inc = pair.incoming(id, &BLOCKS, TransferMode::Pull);
    inc.p_blocks = Vec::new();
    pair.d
        .on_request_arrived(RequestId(1), inc, pair.now)
        .unwrap();
    pair.d
        .on_blocks_allocated(id, vec![100, 101, 102, 103], pair.now)
        .unwrap();
    pair.pump();
}

/// A layer-wise pull under way: D asked, P's prefill started and saved `layers` layers.
fn layerwise_reading(pair: &mut Pair, id: handoff_proto::HandoffId, layers: u32) {
    layerwise_d_arrives(pair, id);
    pair.p
        .create_filling_handoff(id, BLOCKS.to_vec(), TransferMode::Pull, pair.now)
        .unwrap();
    pair.p.layers_saved(id, layers);
    pair.pump();
}

/// The layers D has been allowed to read so far: the first read's, then every `ReadMore`'s.
fn layers_read(pair: &Pair) -> Vec<Option<u32>> {
    let mut out: Vec<Option<u32>> = pair.reads.iter().map(|r| r.layers).collect();
    out.extend(pair.read_more.iter().map(|(_, l)| *l));
    out
}

/// D asks before P's prefill starts; P answers at its start, and D reads each layer only once P
/// said it is saved. P's blocks stay out of the pool while its forward pass writes them, even
/// after D read everything; they come back when the prefill ends.
#[test]
fn a_layerwise_pull_reads_only_saved_layers_and_p_frees_after_its_prefill() {
    let mut pair = Pair::default_pair();
    let id = hid(90);
    layerwise_d_arrives(&mut pair, id);
    assert!(pair.count("D>P", "blocks_query") >= 1);
    assert!(pair.reads.is_empty());

    // P's prefill starts: the staged heartbeat and question are answered now, with no layer yet.
    pair.p
        .create_filling_handoff(id, BLOCKS.to_vec(), TransferMode::Pull, pair.now)
        .unwrap();
    pair.pump();
    assert_eq!(pair.count("P>D", "pull_blocks"), 1);
    assert!(
        pair.reads.is_empty(),
        "a read started before any layer was saved"
    );

    pair.now += ms(10);
    pair.p.layers_saved(id, 2);
    pair.pump();
    assert_eq!(layers_read(&pair), vec![Some(2)]);
    assert_eq!(pair.reads[0].src_blocks, BLOCKS.to_vec());
    // The client named no blocks: nothing was replaced.
    assert_eq!(pair.d.stats().client_blocks_replaced, 0);
    // The next stage goes on a grant that still holds.
    pair.p.layers_saved(id, 4);
    pair.pump();
    assert_eq!(layers_read(&pair), vec![Some(2), Some(4)]);
    assert!(pair.d.permit_read_more(id, pair.now));

    // D read all four layers (its last stage carried the PullDone) before P's forward ended.
    let read = pair.reads[0].clone();
    pair.complete_read(&read);
    assert_eq!(pair.outcomes.len(), 1, "{:?}", pair.outcomes);
    assert!(
        pair.p_released(id).is_none(),
        "P freed blocks its prefill still writes"
    );
    assert_eq!(pair.p.len(), 1);

    pair.p.prefill_ended(id, true, pair.now);
    pair.pump();
    let rel = pair.p_released(id).expect("freed once the prefill ended");
    assert_eq!(rel.reason, EndReason::Done);
    assert_eq!(pair.p.held_blocks(), 0);
}

/// The client leaves while P still prefills: D releases at once (no read was posted), and P
/// frees the blocks when its forward pass is done with them, not before.
#[test]
fn a_release_during_a_layerwise_prefill_takes_effect_when_it_ends() {
    let mut pair = Pair::default_pair();
    let id = hid(91);
    layerwise_d_arrives(&mut pair, id);
    pair.p
        .create_filling_handoff(id, BLOCKS.to_vec(), TransferMode::Pull, pair.now)
        .unwrap();
    pair.pump();
    pair.d
        .on_request_ended(RequestId(1), ReleaseReason::Aborted, pair.now);
    pair.pump();
    assert_eq!(pair.count("D>P", "release"), 1);
    assert!(pair.p_released(id).is_none());
    // P's next list goes to no one: the handoff is over for D.
    pair.p.layers_saved(id, 1);
    pair.pump();
    assert_eq!(pair.count("P>D", "pull_blocks"), 1);

    pair.p.prefill_ended(id, true, pair.now);
    pair.pump();
    assert_eq!(
        pair.p_released(id).map(|r| r.reason),
        Some(EndReason::Aborted)
    );
}

/// P's prefill fails after D started reading its first layers: D hears "gone" at its next
/// heartbeat, stops its read and recomputes; P frees only once D said its read ended (or after
/// the fence), never under the READ.
#[test]
fn a_failed_layerwise_prefill_stops_the_read_before_p_frees() {
    let mut pair = Pair::default_pair();
    let id = hid(92);
    layerwise_reading(&mut pair, id, 1);
    assert_eq!(pair.reads.len(), 1);

    pair.p.prefill_ended(id, false, pair.now);
    pair.pump();
    assert!(pair.p_released(id).is_none(), "freed under D's READ");
    let interval = pair.d.config().heartbeat_interval;
    pair.advance(interval);
    assert_eq!(pair.cancelled_reads, vec![id]);
    assert!(matches!(
        pair.outcomes.as_slice(),
        [Outcome::Recompute {
            reason: FailReason::HandoffGone,
            ..
        }]
    ));
    assert!(pair.p_released(id).is_none(), "freed under D's READ");
    // The cancelled READ ends; D tells P, which frees now.
    pair.d.on_read_done(id, 0, false, pair.now);
    pair.pump();
    assert!(pair.p_released(id).is_some());
    assert_eq!(pair.d.held_blocks(), 0);
}

/// A P that sends a list for fewer layers than before, or for other blocks, is not believed:
/// D never reads more than P said is saved, nor other blocks than P's first answer named.
#[test]
fn a_layerwise_list_that_goes_back_or_names_other_blocks_is_ignored() {
    let mut pair = Pair::default_pair();
    let id = hid(93);
    layerwise_reading(&mut pair, id, 2);
    let list = |blocks: Vec<u32>, layers| {
        Message::PullBlocks(handoff_proto::PullBlocks {
            lists: vec![handoff_proto::BlockList {
                handoff: id,
                epoch: Epoch::FIRST,
                blocks,
                digest: None,
                layers,
            }],
        })
    };
    let ignored = pair.d.stats().ignored;
    pair.d
        .handle_message(P_PEER, list(BLOCKS.to_vec(), Some(1)), pair.now);
    pair.d
        .handle_message(P_PEER, list(vec![500, 501, 502, 503], Some(3)), pair.now);
    pair.d
        .handle_message(P_PEER, list(BLOCKS.to_vec(), Some(2)), pair.now);
    pair.pump();
    assert_eq!(pair.d.stats().ignored, ignored + 3);
    assert_eq!(layers_read(&pair), vec![Some(2)]);
}

/// P's prefill fails while the handoff is already fencing (the proxy released it: it cannot
/// know D is reading): the fence still runs to its end, never cut short by the failure.
#[test]
fn a_failed_layerwise_prefill_keeps_a_running_fence() {
    let mut pair = Pair::default_pair();
    let id = hid(94);
    layerwise_reading(&mut pair, id, 1);
    assert_eq!(pair.reads.len(), 1, "D reads the first layer");
    pair.p.release_unclaimed(
        Release {
            handoff: id,
            epoch: Epoch::FIRST,
            reason: ReleaseReason::Aborted,
        },
        pair.now,
    );
    pair.p.prefill_ended(id, false, pair.now);
    pair.pump();
    assert!(pair.p_released(id).is_none(), "freed under D's READ");
    // D's READ never ends (its deadline runs); P frees once its fence is over, not before.
    pair.d_alive = false;
    let fence = pair.p.config().fence_grace;
    let lease = pair.p.config().initial_lease;
    pair.advance(lease);
    assert!(pair.p_released(id).is_none(), "freed before the fence");
    pair.advance(fence + ms(1));
    assert!(pair.p_released(id).is_some());
}

/// A second request naming a layer-wise handoff whose blocks P already named is told so too
/// (an engine waiting for it before admitting would otherwise wait forever).
#[test]
fn a_sibling_after_ps_first_list_is_told_p_started() {
    let mut pair = Pair::default_pair();
    let id = hid(95);
    let mut inc = pair.incoming(id, &BLOCKS, TransferMode::Pull);
    inc.p_blocks = Vec::new();
    pair.d
        .on_request_arrived(RequestId(1), inc.clone(), pair.now)
        .unwrap();
    pair.pump();
    pair.p
        .create_filling_handoff(id, BLOCKS.to_vec(), TransferMode::Pull, pair.now)
        .unwrap();
    pair.pump();
    assert_eq!(pair.d.poll_started(), Some(vec![RequestId(1)]));
    pair.d
        .on_request_arrived(RequestId(2), inc, pair.now)
        .unwrap();
    assert_eq!(pair.d.poll_started(), Some(vec![RequestId(2)]));
    assert_eq!(pair.d.poll_started(), None);
}

/// A D with many layer-wise pulls queued at P has its heartbeats and block queries staged there
/// up to its quota. Its release of one of them (the client left) still gets in, in place of a
/// question it repeats anyway: P frees that handoff when its prefill ends, not at its lease.
#[test]
fn an_early_release_gets_into_a_staging_full_of_layerwise_questions() {
    let mut pair = Pair::new(
        ProducerConfig {
            staging_per_peer: 4,
            ..ProducerConfig::default()
        },
        ConsumerConfig::default(),
    );
    let (a, b, c) = (hid(96), hid(97), hid(98));
    for (req, id) in [(1, a), (2, b), (3, c)] {
        let mut inc = pair.incoming(id, &BLOCKS, TransferMode::Pull);
        inc.p_blocks = Vec::new();
        pair.d
            .on_request_arrived(RequestId(req), inc, pair.now)
            .unwrap();
    }
    pair.pump();
    assert_eq!(
        pair.p.staged_messages(),
        4,
        "a heartbeat and a query each, to the quota"
    );
    pair.d
        .on_request_ended(RequestId(1), ReleaseReason::Aborted, pair.now);
    pair.pump();
    pair.p
        .create_filling_handoff(a, BLOCKS.to_vec(), TransferMode::Pull, pair.now)
        .unwrap();
    pair.pump();
    pair.p.prefill_ended(a, true, pair.now);
    pair.pump();
    assert_eq!(
        pair.p_released(a).map(|r| r.reason),
        Some(EndReason::Aborted),
        "the early release was dropped: P holds the blocks until its lease"
    );
}

/// A pull of `bytes_per_block` × 4 blocks on a 5 s read timeout and a 1 GB/s read floor; the
/// READ lands after 12 s (past the 10 s initial grant it started on) while P keeps granting.
/// Returns D's outcomes.
fn long_read(bytes_per_block: u64) -> Vec<Outcome> {
    let d = ConsumerConfig {
        read_timeout: Duration::from_secs(5),
        read_floor_rate: 1_000_000_000,
        block_bytes: bytes_per_block,
        ..Default::default()
    };
    let mut pair = Pair::new(ProducerConfig::default(), d);
    let id = hid(91);
    let read = start_pull(&mut pair, id, 1);
    pair.advance(ms(12_000));
    if pair.outcomes.is_empty() {
        pair.complete_read(&read);
    }
    pair.outcomes
}

#[test]
fn a_read_of_a_long_prompt_gets_time_for_its_bytes_on_top_of_the_read_timeout() {
    // 8 GB on this rank: 8 s at the floor rate, so the read may take 5 + 8 s, on the grants
    // P renewed since it started.
    let outcomes = long_read(2_000_000_000);
    assert!(
        matches!(outcomes.as_slice(), [Outcome::Ready { .. }]),
        "{outcomes:?}"
    );
    // The control: the same read of small blocks is failed at the read timeout.
    let outcomes = long_read(4096);
    assert!(
        matches!(outcomes.as_slice(), [Outcome::Recompute { .. }]),
        "{outcomes:?}"
    );
}
