//! `kv_transfer_params` (vLLM-compatible JSON), handoff ids as text, and handshake fingerprints.

mod common;

use common::*;
use handoff_proto::*;
use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use serde_json::{json, Map, Value};

const ID_HEX: &str = "0123456789abcdef0123456789abcdef";

fn parse(v: Value) -> Result<KvTransferParams, ParamsError> {
    KvTransferParams::from_json(&v)
}

/// What a handoff P returns for a pull: vLLM's keys plus handoff's own.
fn handoff_p_output() -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": "prefill-0",
        "remote_request_id": "cmpl-1-0-deadbeef",
        "remote_block_ids": [[3, 4, 5]],
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 2,
        "remote_num_tokens": 40,
        "transfer_mode": "pull",
        "handoff_id": ID_HEX,
        "lease_ms": 30000,
        "epoch": 1,
    })
}

// ---------------------------------------------------------------------------------------------
// vLLM's JSON

#[test]
fn parses_exact_toy_proxy_request_to_prefill() {
    // Byte for byte what tests/v1/kv_connector/nixl_integration/toy_proxy_server.py sends to P.
    let text = r#"{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}"#;
    let v: Value = serde_json::from_str(text).unwrap();
    let p = parse(v).unwrap();
    assert!(p.do_remote_decode);
    assert!(!p.do_remote_prefill);
    assert_eq!(p.remote_engine_id, None);
    assert_eq!(p.remote_block_ids, None);
    assert_eq!(p.remote_host, None);
    assert_eq!(p.remote_port, None);
    assert!(
        p.extra.is_empty(),
        "nulls of known keys are not unknown keys"
    );
    assert_eq!(p, KvTransferParams::for_prefill_leg());
    assert_eq!(p.mode(), TransferMode::Pull);
    assert_eq!(p.validate_remote_prefill(), Ok(()));
    // What handoff's own proxy sends instead: the same request, nulls left out.
    assert_eq!(
        KvTransferParams::for_prefill_leg().to_json(),
        json!({"do_remote_decode": true, "do_remote_prefill": false})
    );
}

#[test]
fn parses_vllm_0_33_prefill_output_per_group() {
    let v = json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": [[4, 5, 6, 7], [9]],
        "remote_engine_id": "7f3c2a9e-8d4b-4f1e-9a6c-2b1d0e5f4a3c",
        "remote_request_id": "cmpl-3b8f0c1e-0-9c1d2e3f",
        "remote_host": "10.1.2.3",
        "remote_port": 5601,
        "tp_size": 4,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 61,
        "remote_registration_generation": 0,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 16,
    });
    let p = parse(v.clone()).unwrap();
    assert!(p.do_remote_prefill && !p.do_remote_decode);
    assert_eq!(p.remote_block_ids, Some(vec![vec![4, 5, 6, 7], vec![9]]));
    assert_eq!(p.block_ids(), Some(&[4, 5, 6, 7][..]));
    assert_eq!(
        p.remote_engine_id.as_deref(),
        Some("7f3c2a9e-8d4b-4f1e-9a6c-2b1d0e5f4a3c")
    );
    assert_eq!(
        p.remote_request_id.as_deref(),
        Some("cmpl-3b8f0c1e-0-9c1d2e3f")
    );
    assert_eq!(p.remote_host.as_deref(), Some("10.1.2.3"));
    assert_eq!(p.remote_port, Some(5601));
    assert_eq!(p.tp_size, Some(4));
    assert_eq!(p.remote_num_tokens, Some(61));
    assert_eq!(p.transfer_mode, Some(TransferMode::Pull));
    assert_eq!(p.handoff_id, None);
    let extra: Vec<&str> = p.extra.keys().map(String::as_str).collect();
    assert_eq!(
        extra,
        [
            "dcp_size",
            "pp_size",
            "remote_prefill_cached_tokens",
            "remote_registration_generation"
        ]
    );
    // Written back unchanged, unknown keys included.
    assert_eq!(p.to_json(), v);
    // vLLM's P names no handoff id, so a handoff D cannot lease from it.
    assert_eq!(
        p.validate_remote_prefill(),
        Err(ParamsError::Missing("handoff_id"))
    );
}

#[test]
fn parses_flat_remote_block_ids_and_writes_per_group() {
    let p = parse(json!({"do_remote_prefill": true, "remote_block_ids": [1, 2, 3]})).unwrap();
    assert_eq!(p.remote_block_ids, Some(vec![vec![1, 2, 3]]));
    assert_eq!(p.block_ids(), Some(&[1, 2, 3][..]));
    assert_eq!(p.to_json()["remote_block_ids"], json!([[1, 2, 3]]));
    let empty_group = parse(json!({"remote_block_ids": [[]]})).unwrap();
    assert_eq!(empty_group.block_ids(), Some(&[][..]));
    for bad in [
        json!([1, [2]]),
        json!("1,2"),
        json!([-1]),
        json!([[4294967296u64]]),
    ] {
        assert!(
            matches!(
                parse(json!({"remote_block_ids": bad})),
                Err(ParamsError::Invalid(_))
            ),
            "{bad}"
        );
    }
}

#[test]
fn parses_transfer_mode_pull_and_push_only() {
    for (text, mode) in [("pull", TransferMode::Pull), ("push", TransferMode::Push)] {
        let p = parse(json!({"transfer_mode": text})).unwrap();
        assert_eq!(p.transfer_mode, Some(mode));
        assert_eq!(p.mode(), mode);
        assert_eq!(mode.as_str(), text);
        assert_eq!(
            p.to_json(),
            json!({"do_remote_prefill": false, "do_remote_decode": false, "transfer_mode": text})
        );
    }
    assert_eq!(parse(json!({})).unwrap().mode(), TransferMode::Pull);
    for bad in ["PUSH", "write", "read", ""] {
        let err = parse(json!({"transfer_mode": bad})).unwrap_err();
        assert!(matches!(err, ParamsError::Invalid(_)), "{bad}: {err}");
    }
}

#[test]
fn vllm_push_proxy_request_to_decode() {
    // What vLLM's push demo proxy sends D: no remote_block_ids. handoff needs the mode and id.
    let mut v = json!({
        "do_remote_prefill": true,
        "remote_engine_id": "prefill-0",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 2,
        "pp_size": 1,
        "remote_request_id": "5d4c3b2a-1f0e-4d9c-8b7a-6f5e4d3c2b1a",
    });
    assert_eq!(
        parse(v.clone()).unwrap().validate_remote_prefill(),
        Err(ParamsError::Missing("handoff_id"))
    );
    v["handoff_id"] = json!(ID_HEX);
    assert_eq!(
        parse(v.clone()).unwrap().validate_remote_prefill(),
        Err(ParamsError::Missing("remote_block_ids")),
        "a pull (the default mode) needs block ids"
    );
    v["transfer_mode"] = json!("push");
    let p = parse(v).unwrap();
    assert_eq!(p.validate_remote_prefill(), Ok(()));
    assert_eq!(p.extra.get("pp_size"), Some(&json!(1)));
}

#[test]
fn unknown_keys_round_trip_unchanged() {
    let v = json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_blocks_expiry_time": null,
        "kv_recompute_threshold": 0.5,
        "nested": {"a": [1, "two", null, {"b": false}]},
        "conversation_id": "c-1",
        "_p_side_truncated": true,
    });
    let p = parse(v.clone()).unwrap();
    assert_eq!(p.extra.len(), 5);
    assert_eq!(p.to_json(), v);
    let text = serde_json::to_string(&p).unwrap();
    let back: KvTransferParams = serde_json::from_str(&text).unwrap();
    assert_eq!(back, p);
}

#[test]
fn wrong_json_types_are_invalid() {
    for v in [
        json!({"remote_port": 70000}),
        json!({"remote_port": "5600"}),
        json!({"remote_port": -1}),
        json!({"tp_size": 1.5}),
        json!({"do_remote_prefill": "yes"}),
        json!({"lease_ms": 4294967296u64}),
        json!([]),
        json!("params"),
        Value::Null,
    ] {
        let err = parse(v.clone()).unwrap_err();
        assert!(matches!(err, ParamsError::Invalid(_)), "{v}: {err}");
        assert!(err
            .to_string()
            .starts_with("kv_transfer_params is not valid"));
    }
}

// ---------------------------------------------------------------------------------------------
// handoff_id

#[test]
fn handoff_id_is_32_hex_digits_in_json() {
    let p = parse(handoff_p_output()).unwrap();
    assert_eq!(
        p.handoff_id,
        Some(HandoffId::from_bytes(u128::to_le_bytes(
            0x0123_4567_89ab_cdef_0123_4567_89ab_cdef
        )))
    );
    assert_eq!(p.lease_ms, Some(30_000));
    assert_eq!(p.epoch, Some(1));
    assert!(p.extra.is_empty());
    assert_eq!(p.to_json(), handoff_p_output());
    // Upper case is accepted; lower case is written.
    let upper = parse(json!({"handoff_id": ID_HEX.to_uppercase()})).unwrap();
    assert_eq!(upper.handoff_id, p.handoff_id);
    assert_eq!(upper.to_json()["handoff_id"], json!(ID_HEX));
    // Small ids keep their leading zeros.
    assert_eq!(
        HandoffId::from_bytes(u128::to_le_bytes(1)).to_string(),
        format!("{:0>32}", "1")
    );
}

#[test]
fn bad_handoff_ids_are_rejected_with_a_clear_error() {
    let bad = [
        "",
        "0123456789abcdef0123456789abcde",   // 31 digits
        "0123456789abcdef0123456789abcdef0", // 33 digits
        "0123456789abcdef0123456789abcdeg",  // not hex
        "0x23456789abcdef0123456789abcdef",  // prefix
        "+123456789abcdef0123456789abcdef",  // sign, which from_str_radix would take
        " 123456789abcdef0123456789abcdef",
        "éééééééééééééééé", // 32 bytes, not ASCII
    ];
    for s in bad {
        let err = s.parse::<HandoffId>().unwrap_err();
        assert_eq!(err, ParseHandoffIdError(s.to_string()));
        assert!(err.to_string().contains("32 hexadecimal digits"), "{err}");
        let json_err = parse(json!({"handoff_id": s})).unwrap_err();
        let ParamsError::Invalid(msg) = &json_err else {
            panic!("{s:?}: {json_err:?}");
        };
        assert!(msg.contains("32 hexadecimal digits"), "{s:?}: {msg}");
        assert!(
            msg.contains(&format!("{s:?}")),
            "the error names the bad id: {msg}"
        );
    }
    // Non-string ids.
    for v in [json!(12345), json!([1, 2]), json!(true)] {
        assert!(matches!(
            parse(json!({"handoff_id": v})),
            Err(ParamsError::Invalid(_))
        ));
    }
    // A huge input is echoed only in part.
    let long = "z".repeat(10_000);
    let err = long.parse::<HandoffId>().unwrap_err();
    assert!(err.0.len() <= 64);
}

#[test]
fn handoff_id_from_bytes_and_debug() {
    let bytes: [u8; 16] = core::array::from_fn(|i| i as u8);
    let id = HandoffId::from_bytes(bytes);
    assert_eq!(id.to_bytes(), bytes);
    // Debug is short, but ids that differ only in their low bits must still look different.
    assert_ne!(
        format!("{:?}", HandoffId::from_bytes(u128::to_le_bytes(1))),
        format!("{:?}", HandoffId::from_bytes(u128::to_le_bytes(2)))
    );
    assert_ne!(
        format!("{id:?}"),
        format!(
            "{:?}",
            HandoffId::from_bytes(u128::to_le_bytes(
                u128::from_le_bytes(id.to_bytes()) ^ 1 << 127
            ))
        )
    );
}

proptest! {
    #[test]
    fn handoff_id_text_round_trip(id in handoff_id()) {
        let s = id.to_string();
        prop_assert_eq!(s.len(), 32);
        prop_assert!(s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        prop_assert_eq!(s.parse::<HandoffId>(), Ok(id));
        prop_assert_eq!(s.to_uppercase().parse::<HandoffId>(), Ok(id));
    }

    #[test]
    fn handoff_id_parse_never_panics(s in "\\PC{0,40}") {
        let r = s.parse::<HandoffId>();
        let valid = s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit());
        prop_assert_eq!(r.is_ok(), valid);
    }
}

// ---------------------------------------------------------------------------------------------
// validate_remote_prefill

#[test]
fn validate_remote_prefill_names_the_missing_key() {
    let full = handoff_p_output();
    assert_eq!(
        parse(full.clone()).unwrap().validate_remote_prefill(),
        Ok(())
    );
    for key in [
        "remote_engine_id",
        "remote_host",
        "remote_port",
        "handoff_id",
        "remote_block_ids",
    ] {
        for missing in [Value::Null, json!("absent")] {
            let mut v = full.clone();
            if missing.is_null() {
                v[key] = Value::Null;
            } else {
                v.as_object_mut().unwrap().remove(key);
            }
            let err = parse(v).unwrap().validate_remote_prefill().unwrap_err();
            assert_eq!(err, ParamsError::Missing(key));
            assert!(err.to_string().contains(&format!("`{key}`")), "{err}");
        }
    }
    // Push registers D's own blocks: P's block ids are not needed.
    let mut push = full.clone();
    push["transfer_mode"] = json!("push");
    push.as_object_mut().unwrap().remove("remote_block_ids");
    assert_eq!(parse(push).unwrap().validate_remote_prefill(), Ok(()));
    // Nor does a layer-wise pull: its D leg leaves before P has blocks.
    let mut layerwise = full.clone();
    layerwise["layerwise"] = json!(true);
    layerwise
        .as_object_mut()
        .unwrap()
        .remove("remote_block_ids");
    let p = parse(layerwise).unwrap();
    assert!(p.is_layerwise_pull());
    assert_eq!(p.validate_remote_prefill(), Ok(()));
    // Not a remote prefill: nothing to check.
    assert_eq!(
        parse(json!({"do_remote_prefill": false}))
            .unwrap()
            .validate_remote_prefill(),
        Ok(())
    );
    // An empty list of groups names no blocks.
    let mut no_groups = full;
    no_groups["remote_block_ids"] = json!([]);
    assert_eq!(
        parse(no_groups).unwrap().validate_remote_prefill(),
        Err(ParamsError::Missing("remote_block_ids"))
    );
}

// ---------------------------------------------------------------------------------------------
// Round trip of arbitrary params

fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        "\\PC{0,12}".prop_map(Value::String),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    json_leaf().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::Array),
            btree_map("[a-z]{1,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn params() -> impl Strategy<Value = KvTransferParams> {
    let vllm = (
        any::<bool>(),
        any::<bool>(),
        proptest::option::of("\\PC{0,20}"),
        proptest::option::of("\\PC{0,20}"),
        proptest::option::of(vec(vec(any::<u32>(), 0..6), 0..3)),
        proptest::option::of("[a-z0-9.:]{0,20}"),
        proptest::option::of(any::<u16>()),
        proptest::option::of(any::<u16>()),
        proptest::option::of(any::<u32>()),
        proptest::option::of(any::<u32>()),
        proptest::option::of(transfer_mode()),
    );
    let own = (
        proptest::option::of(handoff_id()),
        proptest::option::of(any::<u32>()),
        proptest::option::of(any::<u32>()),
        proptest::option::of(any::<bool>()),
        // Unknown keys never collide with known ones: "x_" is no known key's prefix.
        btree_map("x_[a-z_]{0,10}", json_value(), 0..4),
    );
    (vllm, own).prop_map(|(v, o)| KvTransferParams {
        do_remote_prefill: v.0,
        do_remote_decode: v.1,
        remote_engine_id: v.2,
        remote_request_id: v.3,
        remote_block_ids: v.4,
        remote_host: v.5,
        remote_port: v.6,
        tp_size: v.7,
        remote_num_tokens: v.8,
        remote_block_size: v.9,
        transfer_mode: v.10,
        handoff_id: o.0,
        lease_ms: o.1,
        epoch: o.2,
        layerwise: o.3,
        extra: o.4.into_iter().collect::<Map<String, Value>>(),
    })
}

proptest! {
    #[test]
    fn params_json_round_trip(p in params()) {
        let v = p.to_json();
        prop_assert!(v.is_object());
        prop_assert_eq!(KvTransferParams::from_json(&v), Ok(p.clone()));
        let text = serde_json::to_string(&v).unwrap();
        let reparsed: Value = serde_json::from_str(&text).unwrap();
        prop_assert_eq!(KvTransferParams::from_json(&reparsed), Ok(p));
    }

    #[test]
    fn params_from_arbitrary_json_never_panics(v in json_value()) {
        // Ok or Err, and whatever parses writes back to something that parses the same.
        if let Ok(p) = KvTransferParams::from_json(&v) {
            prop_assert_eq!(KvTransferParams::from_json(&p.to_json()), Ok(p));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Fingerprint

fn base_fingerprint() -> Fingerprint {
    Fingerprint {
        protocol_version: PROTOCOL_VERSION as u16,
        model: "Qwen/Qwen3-0.6B".into(),
        num_layers: 28,
        num_kv_heads: 8,
        head_dim: 128,
        dtype: "bfloat16".into(),
        mode: TransferMode::Pull,
    }
}

#[test]
fn fingerprint_mismatch_lists_each_differing_field_in_words() {
    let a = base_fingerprint();
    assert_eq!(a.mismatch(&a.clone()), None);
    type Edit = fn(&mut Fingerprint);
    let cases: [(Edit, &str); 7] = [
        (
            |f| f.protocol_version = PROTOCOL_VERSION as u16 + 1,
            "protocol version 9 on the peer, this engine speaks 7 to 8",
        ),
        (
            |f| f.model = "Qwen/Qwen3-8B".into(),
            r#"model "Qwen/Qwen3-0.6B" here, "Qwen/Qwen3-8B" on the peer"#,
        ),
        (|f| f.num_layers = 36, "28 layers here, 36 on the peer"),
        (|f| f.num_kv_heads = 4, "8 KV heads here, 4 on the peer"),
        (|f| f.head_dim = 64, "head dim 128 here, 64 on the peer"),
        (
            |f| f.dtype = "float16".into(),
            "dtype bfloat16 here, float16 on the peer",
        ),
        (
            |f| f.mode = TransferMode::Push,
            "transfer mode pull here, push on the peer",
        ),
    ];
    let mut all = a.clone();
    for (edit, words) in &cases {
        let mut b = a.clone();
        edit(&mut b);
        edit(&mut all);
        assert_eq!(
            a.mismatch(&b),
            Some(format!("incompatible peer: {words}")),
            "only one field differs"
        );
    }
    let every = a.mismatch(&all).unwrap();
    let words: Vec<&str> = cases.iter().map(|(_, w)| *w).collect();
    assert_eq!(every, format!("incompatible peer: {}", words.join("; ")));
}

#[test]
fn a_peer_of_the_previous_protocol_version_pairs_and_one_older_does_not() {
    let a = base_fingerprint();
    let mut previous = a.clone();
    previous.protocol_version = OLDEST_PROTOCOL_VERSION as u16;
    assert_eq!(
        a.mismatch(&previous),
        None,
        "a rolling upgrade pairs old and new"
    );
    // The old engine's own check: it sees the version its connection speaks, its own.
    assert_eq!(previous.mismatch(&previous.clone()), None);
    let mut older = a.clone();
    older.protocol_version = OLDEST_PROTOCOL_VERSION as u16 - 1;
    assert_eq!(
        a.mismatch(&older),
        Some("incompatible peer: protocol version 6 on the peer, this engine speaks 7 to 8".into())
    );
    // The compatibility key does not depend on the version, so routers pair old and new.
    assert_eq!(
        a.compat_key("head-major", false),
        previous.compat_key("head-major", false)
    );
}

proptest! {
    #[test]
    fn fingerprint_mismatch_iff_different(a in fingerprint(), b in fingerprint(), same in any::<bool>()) {
        let b = if same { a.clone() } else { b };
        // Everything but the version equal, and the peer's version one this side speaks.
        let pairs = |me: &Fingerprint, peer: &Fingerprint| {
            Fingerprint { protocol_version: me.protocol_version, ..peer.clone() } == *me
                && peer.protocol_version <= me.protocol_version
                && peer.protocol_version >= u16::from(OLDEST_PROTOCOL_VERSION)
        };
        prop_assert_eq!(a.mismatch(&b).is_none(), pairs(&a, &b));
        prop_assert_eq!(b.mismatch(&a).is_none(), pairs(&b, &a));
    }
}
