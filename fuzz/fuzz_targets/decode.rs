//! `decode` of arbitrary bytes must return, never panic, and whatever it accepts must survive a
//! re-encode in its own protocol version: same message back, never longer than the input (so
//! never over the size cap).

#![no_main]

use handoff_proto::{decode_up_to, encode_as, PROTOCOL_VERSION};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((msg, version)) = decode_up_to(data, PROTOCOL_VERSION) {
        let bytes = encode_as(&msg, version).expect("a decoded message must re-encode");
        assert!(bytes.len() <= data.len(), "re-encoding grew the message");
        assert_eq!(
            decode_up_to(&bytes, PROTOCOL_VERSION),
            Ok((msg, version)),
            "re-encoded message decodes differently"
        );
    }
});
