//! The HTTP `kv_transfer_params` parser (what engines and the proxy read from every request
//! body): arbitrary bytes must never panic it, and whatever parses must write back to JSON that
//! parses the same.

#![no_main]

use handoff_proto::KvTransferParams;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let _ = KvTransferParams::release_target(&v);
    if let Ok(p) = KvTransferParams::from_json(&v) {
        let _ = p.validate_remote_prefill();
        let _ = p.block_ids();
        assert_eq!(
            KvTransferParams::from_json(&p.to_json()),
            Ok(p),
            "parsed params write back to something else"
        );
    }
});
