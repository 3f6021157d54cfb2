//! `decode` of arbitrary bytes must return, never panic, and whatever it accepts must survive a
//! re-encode: same message back, never longer than the input (so never over the size cap).

#![no_main]

use handoff_proto::{decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(msg) = decode(data) {
        let bytes = encode(&msg).expect("a decoded message must re-encode");
        assert!(bytes.len() <= data.len(), "re-encoding grew the message");
        assert_eq!(
            decode(&bytes),
            Ok(msg),
            "re-encoded message decodes differently"
        );
    }
});
