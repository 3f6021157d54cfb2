//! The side channel's frame reader (`[u32 length][message][tag]`), as a connection's reader
//! thread runs it: unauthenticated (the input is the stream), and authenticated with the input's
//! pieces framed and sealed as a peer holding the key would (so hostile messages get past the
//! tag to the decoder), some with a broken tag. No input may panic.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    handoff_connector::side_channel::fuzz_read_frames(rest, mode & 1 == 1);
});
