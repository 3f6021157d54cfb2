//! The authenticated handshake (`auth::accept` and `auth::dial`), fed a hostile peer's bytes on
//! a fresh loopback connection: as the acceptor reads a dialer's hello and proof, and as the
//! dialer reads an acceptor's greeting and proof. Every input is refused (no one without the
//! key can prove it), none may panic or hang past the handshake's limit.

#![no_main]

use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use handoff_transport::auth::{self, ClusterKey};
use libfuzzer_sys::fuzz_target;

fn setup() -> &'static (TcpListener, ClusterKey) {
    static S: OnceLock<(TcpListener, ClusterKey)> = OnceLock::new();
    S.get_or_init(|| {
        let l = TcpListener::bind("127.0.0.1:0").expect("a loopback listener");
        let key = ClusterKey::from_hex(&"cd".repeat(32)).expect("a valid key");
        (l, key)
    })
}

fuzz_target!(|data: &[u8]| {
    // Small enough to sit in the socket buffers: nothing blocks on a reader.
    let Some((&mode, input)) = data.split_first() else {
        return;
    };
    if input.len() > 16 << 10 {
        return;
    }
    let (listener, key) = setup();
    let Ok(addr) = listener.local_addr() else {
        return;
    };
    let Ok(mut hostile) = TcpStream::connect(addr) else {
        return;
    };
    let Ok((ours, _)) = listener.accept() else {
        return;
    };
    let _ = hostile.write_all(input);
    let _ = hostile.shutdown(Shutdown::Write);
    let limit = Duration::from_millis(200);
    let r = if mode & 1 == 0 {
        auth::accept(&ours, key, "side", "fuzz-acceptor", limit).map(|_| ())
    } else {
        auth::dial(&ours, key, "side", "fuzz-dialer", "fuzz-acceptor", limit).map(|_| ())
    };
    assert!(r.is_err(), "a handshake without the key succeeded");
});
