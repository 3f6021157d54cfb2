//! Proof that both ends of a connection hold the cluster's key, and who each claims to be.
//!
//! Engines of one cluster share a 32-byte key ([`ClusterKey`]). Before anything else crosses a
//! connection (the side channel's hello, the tcp transport's hello), the two ends run one
//! challenge–response exchange:
//!
//! ```text
//! dialer   -> acceptor : AUTH magic, version, dialer id, dialer nonce
//! acceptor -> dialer   : acceptor id, acceptor nonce, HMAC(key, "acceptor" | transcript)
//! dialer   -> acceptor : HMAC(key, "dialer" | transcript)
//! ```
//!
//! where the transcript is the protocol label, both ids and both nonces (length-prefixed). The
//! key never crosses the wire; each proof is bound to fresh nonces of both sides (no replay)
//! and to both ids, so the connection is bound to the names the peer proved: the caller then
//! refuses a hello whose engine id or agent name is not the proven one. A key shared by the
//! whole cluster keeps outsiders out; it does not tell members apart (any holder of the key may
//! claim any member's name), which is what separate keys per engine would add.
//!
//! The exchange also gives both ends a session key (an HMAC of the transcript under the cluster
//! key). A channel that carries small control frames (the side channel) tags every frame with it
//! ([`FrameSealer`], [`FrameOpener`]: a MAC over a per-direction sequence number and the frame),
//! so a relay that passed the handshake through (say, to a P address a client chose) can neither
//! change, drop, reorder nor inject a frame afterwards.
//!
//! The whole exchange runs under one deadline: a peer that sends a byte every few seconds is cut
//! off when the deadline passes, not when a per-read timeout would.
//!
//! Bulk KV is not encrypted: a cluster that needs confidentiality on the wire runs it over a
//! network it trusts (or a VPN/IPsec underneath).

use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a [`ClusterKey`].
pub const KEY_BYTES: usize = 32;
const NONCE_BYTES: usize = 32;
const PROOF_BYTES: usize = 32;
/// Longest id (engine id or agent name) accepted in an exchange.
pub const MAX_ID_BYTES: usize = 256;
const MAGIC: [u8; 6] = *b"HOAUTH";
const VERSION: u8 = 1;
/// Default limit for the whole exchange.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(5);

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("cluster key: {0}")]
    BadKey(String),
    #[error("cannot read the cluster key file {path}: {source}")]
    KeyFile { path: String, source: io::Error },
    #[error("no randomness for a nonce: {0}")]
    Random(String),
    #[error(
        "the peer did not authenticate (no cluster key configured there, or not a handoff peer)"
    )]
    NotAuthenticating,
    #[error("authentication version {0} (this build speaks {VERSION})")]
    Version(u8),
    #[error("the peer's proof of the cluster key is wrong (a different key?)")]
    BadProof,
    #[error("the peer is {got:?}, not {expected:?}")]
    WrongPeer { expected: String, got: String },
    #[error("malformed authentication frame: {0}")]
    Malformed(&'static str),
    #[error("authentication did not finish within {0:?}")]
    Deadline(Duration),
    #[error("authentication: {0}")]
    Io(#[from] io::Error),
}

/// The key the engines of one cluster share. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterKey([u8; KEY_BYTES]);

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

impl ClusterKey {
    /// A fresh random key.
    pub fn generate() -> Result<Self, AuthError> {
        let mut k = [0u8; KEY_BYTES];
        getrandom::getrandom(&mut k).map_err(|e| AuthError::Random(e.to_string()))?;
        Ok(ClusterKey(k))
    }

    /// From 64 hex digits (surrounding whitespace ignored).
    pub fn from_hex(s: &str) -> Result<Self, AuthError> {
        let s = s.trim();
        if s.len() != KEY_BYTES * 2 {
            return Err(AuthError::BadKey(format!(
                "want {} hex digits, got {} characters",
                KEY_BYTES * 2,
                s.len()
            )));
        }
        let mut k = [0u8; KEY_BYTES];
        for (i, b) in k.iter_mut().enumerate() {
            *b = u8::from_str_radix(s.get(2 * i..2 * i + 2).unwrap_or("-"), 16)
                .map_err(|_| AuthError::BadKey("not hex".into()))?;
        }
        Ok(ClusterKey(k))
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Reads a key file written by `handoff keygen` (64 hex digits).
    pub fn load(path: &Path) -> Result<Self, AuthError> {
        let text = std::fs::read_to_string(path).map_err(|source| AuthError::KeyFile {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_hex(&text)
    }

    fn proof(&self, role: &[u8], t: &Transcript<'_>) -> [u8; PROOF_BYTES] {
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        t.feed(role, &mut mac);
        mac.finalize().into_bytes().into()
    }

    fn verify(&self, role: &[u8], t: &Transcript<'_>, proof: &[u8]) -> bool {
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        t.feed(role, &mut mac);
        // Constant time: a wrong proof tells nothing about the right one.
        mac.verify_slice(proof).is_ok()
    }
}

/// Bytes of a frame's tag ([`FrameSealer::seal`]).
pub const TAG_BYTES: usize = 16;

/// The key both ends of one authenticated connection share after the exchange.
#[derive(Clone)]
pub struct Session {
    key: [u8; 32],
    dialer: bool,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Session(..)")
    }
}

impl Session {
    /// Both ends of one session over `key`, without a handshake: the fuzz targets' way to reach
    /// the frame reader past authentication (feature `fuzzing`; not API).
    #[cfg(feature = "fuzzing")]
    pub fn pair_for_fuzzing(key: &ClusterKey) -> (Session, Session) {
        let k = key.0;
        (
            Session {
                key: k,
                dialer: true,
            },
            Session {
                key: k,
                dialer: false,
            },
        )
    }

    /// The two halves: tags for what this end sends, checks for what it receives.
    pub fn split(self) -> (FrameSealer, FrameOpener) {
        let (out, inn) = if self.dialer {
            (b"dialer->acceptor", b"acceptor->dialer")
        } else {
            (b"acceptor->dialer", b"dialer->acceptor")
        };
        (
            FrameSealer(Direction {
                key: self.key,
                label: out,
                seq: 0,
            }),
            FrameOpener(Direction {
                key: self.key,
                label: inn,
                seq: 0,
            }),
        )
    }
}

struct Direction {
    key: [u8; 32],
    label: &'static [u8; 16],
    seq: u64,
}

impl Direction {
    fn mac(&self, frame: &[u8]) -> Hmac<Sha256> {
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.key).expect("HMAC takes any key length");
        mac.update(self.label);
        mac.update(&self.seq.to_le_bytes());
        mac.update(frame);
        mac
    }
}

/// Tags the frames one end sends, in order.
pub struct FrameSealer(Direction);

impl FrameSealer {
    pub fn seal(&mut self, frame: &[u8]) -> [u8; TAG_BYTES] {
        let tag = self.0.mac(frame).finalize().into_bytes();
        self.0.seq += 1;
        let mut out = [0u8; TAG_BYTES];
        out.copy_from_slice(&tag[..TAG_BYTES]);
        out
    }
}

/// Checks the frames one end receives, in order: a changed, dropped, replayed, reordered or
/// injected frame fails.
pub struct FrameOpener(Direction);

impl FrameOpener {
    pub fn open(&mut self, frame: &[u8], tag: &[u8]) -> bool {
        let ok = self.0.mac(frame).verify_truncated_left(tag).is_ok() && tag.len() == TAG_BYTES;
        self.0.seq += 1;
        ok
    }
}

/// What both proofs are computed over.
struct Transcript<'a> {
    protocol: &'a str,
    dialer: &'a str,
    acceptor: &'a str,
    dialer_nonce: &'a [u8; NONCE_BYTES],
    acceptor_nonce: &'a [u8; NONCE_BYTES],
}

impl Transcript<'_> {
    fn session(&self, key: &ClusterKey, dialer: bool) -> Session {
        Session {
            key: key.proof(b"session", self),
            dialer,
        }
    }

    fn feed(&self, role: &[u8], mac: &mut Hmac<Sha256>) {
        for part in [
            b"handoff-auth-v1".as_slice(),
            self.protocol.as_bytes(),
            role,
            self.dialer.as_bytes(),
            self.acceptor.as_bytes(),
            self.dialer_nonce,
            self.acceptor_nonce,
        ] {
            mac.update(&(part.len() as u32).to_le_bytes());
            mac.update(part);
        }
    }
}

fn nonce() -> Result<[u8; NONCE_BYTES], AuthError> {
    let mut n = [0u8; NONCE_BYTES];
    getrandom::getrandom(&mut n).map_err(|e| AuthError::Random(e.to_string()))?;
    Ok(n)
}

/// Reads what `stream` has before `deadline`: each read's timeout is what is left, so a peer
/// that sends a byte at a time cannot stretch a handshake past it (`TimedOut` once it passed).
pub fn read_before(stream: &TcpStream, deadline: Instant, buf: &mut [u8]) -> io::Result<usize> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    stream.set_read_timeout(Some(left))?;
    let mut s = stream;
    s.read(buf)
}

/// Reads under a deadline for the whole exchange ([`read_before`]).
struct Deadlined<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
    limit: Duration,
}

impl Deadlined<'_> {
    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), AuthError> {
        let mut got = 0;
        while got < buf.len() {
            match read_before(self.stream, self.deadline, &mut buf[got..]) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(AuthError::Deadline(self.limit))
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    fn write_all(&mut self, buf: &[u8]) -> Result<(), AuthError> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(AuthError::Deadline(self.limit));
        }
        self.stream.set_write_timeout(Some(left))?;
        (&mut &*self.stream).write_all(buf)?;
        Ok(())
    }

    fn id(&mut self) -> Result<String, AuthError> {
        let mut len = [0u8; 2];
        self.read_exact(&mut len)?;
        let len = u16::from_le_bytes(len) as usize;
        if len == 0 || len > MAX_ID_BYTES {
            return Err(AuthError::Malformed("id length"));
        }
        let mut b = vec![0; len];
        self.read_exact(&mut b)?;
        String::from_utf8(b).map_err(|_| AuthError::Malformed("id is not UTF-8"))
    }

    /// What each end sends first: magic, version, its id and its nonce.
    fn greeting(&mut self) -> Result<(String, [u8; NONCE_BYTES]), AuthError> {
        let mut head = [0u8; 7];
        self.read_exact(&mut head)?;
        if head[..6] != MAGIC {
            return Err(AuthError::NotAuthenticating);
        }
        if head[6] != VERSION {
            return Err(AuthError::Version(head[6]));
        }
        let id = self.id()?;
        let mut nonce = [0u8; NONCE_BYTES];
        self.read_exact(&mut nonce)?;
        Ok((id, nonce))
    }

    fn done(self) -> Result<(), AuthError> {
        self.stream.set_read_timeout(None)?;
        self.stream.set_write_timeout(None)?;
        Ok(())
    }
}

fn put_id(out: &mut Vec<u8>, id: &str) -> Result<(), AuthError> {
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return Err(AuthError::Malformed("id length"));
    }
    out.extend_from_slice(&(id.len() as u16).to_le_bytes());
    out.extend_from_slice(id.as_bytes());
    Ok(())
}

/// Runs the dialer's half on a fresh connection: proves `me` holds `key` and checks that the
/// acceptor does and is `expect`. `protocol` names the channel ("side", "tcp") so a proof made
/// for one is worth nothing on the other. On return the stream has no timeouts set.
pub fn dial(
    stream: &TcpStream,
    key: &ClusterKey,
    protocol: &str,
    me: &str,
    expect: &str,
    limit: Duration,
) -> Result<Session, AuthError> {
    let mut s = Deadlined {
        stream,
        deadline: Instant::now() + limit,
        limit,
    };
    let dialer_nonce = nonce()?;
    let mut hello = Vec::with_capacity(64 + me.len());
    hello.extend_from_slice(&MAGIC);
    hello.push(VERSION);
    put_id(&mut hello, me)?;
    hello.extend_from_slice(&dialer_nonce);
    s.write_all(&hello)?;

    let (acceptor, acceptor_nonce) = s.greeting()?;
    let mut proof = [0u8; PROOF_BYTES];
    s.read_exact(&mut proof)?;
    let t = Transcript {
        protocol,
        dialer: me,
        acceptor: &acceptor,
        dialer_nonce: &dialer_nonce,
        acceptor_nonce: &acceptor_nonce,
    };
    if !key.verify(b"acceptor", &t, &proof) {
        return Err(AuthError::BadProof);
    }
    if acceptor != expect {
        return Err(AuthError::WrongPeer {
            expected: expect.to_string(),
            got: acceptor,
        });
    }
    s.write_all(&key.proof(b"dialer", &t))?;
    s.done()?;
    Ok(t.session(key, true))
}

/// Runs the acceptor's half: proves `me` holds `key`, checks the dialer does, and returns the
/// id it proved and the session. On return the stream has no timeouts set.
pub fn accept(
    stream: &TcpStream,
    key: &ClusterKey,
    protocol: &str,
    me: &str,
    limit: Duration,
) -> Result<(String, Session), AuthError> {
    let mut s = Deadlined {
        stream,
        deadline: Instant::now() + limit,
        limit,
    };
    let (dialer, dialer_nonce) = s.greeting()?;
    let acceptor_nonce = nonce()?;
    let t = Transcript {
        protocol,
        dialer: &dialer,
        acceptor: me,
        dialer_nonce: &dialer_nonce,
        acceptor_nonce: &acceptor_nonce,
    };
    let mut reply = Vec::with_capacity(128 + me.len());
    reply.extend_from_slice(&MAGIC);
    reply.push(VERSION);
    put_id(&mut reply, me)?;
    reply.extend_from_slice(&acceptor_nonce);
    reply.extend_from_slice(&key.proof(b"acceptor", &t));
    s.write_all(&reply)?;
    let mut proof = [0u8; PROOF_BYTES];
    s.read_exact(&mut proof)?;
    if !key.verify(b"dialer", &t, &proof) {
        return Err(AuthError::BadProof);
    }
    s.done()?;
    let session = t.session(key, false);
    Ok((dialer, session))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    fn run(
        dial_key: &ClusterKey,
        accept_key: &ClusterKey,
        expect: &str,
    ) -> (
        Result<Session, AuthError>,
        Result<(String, Session), AuthError>,
    ) {
        let (c, s) = pair();
        let k = accept_key.clone();
        let acceptor =
            std::thread::spawn(move || accept(&s, &k, "side", "P", Duration::from_secs(2)));
        let d = dial(&c, dial_key, "side", "D", expect, Duration::from_secs(2));
        drop(c);
        (d, acceptor.join().unwrap())
    }

    #[test]
    fn same_key_proves_both_ends_and_names_the_dialer() {
        let k = ClusterKey::generate().unwrap();
        let (d, a) = run(&k, &k, "P");
        let (d_seal, mut d_open) = d.unwrap().split();
        let (id, a_session) = a.unwrap();
        assert_eq!(id, "D");
        // The session tags frames both ways; each direction checks only its own.
        let (mut a_seal, mut a_open) = a_session.split();
        let mut d_seal = d_seal;
        let t1 = d_seal.seal(b"hello");
        let t2 = d_seal.seal(b"heartbeat");
        assert!(a_open.open(b"hello", &t1));
        assert!(a_open.open(b"heartbeat", &t2));
        let back = a_seal.seal(b"grant");
        assert!(d_open.open(b"grant", &back));
    }

    #[test]
    fn a_changed_replayed_reordered_or_reflected_frame_fails() {
        let k = ClusterKey::generate().unwrap();
        let (d, a) = run(&k, &k, "P");
        let (mut seal, _) = d.unwrap().split();
        let (_, a_session) = a.unwrap();
        let t1 = seal.seal(b"release 1");
        let t2 = seal.seal(b"release 2");
        let (mut a_seal, mut open) = a_session.clone().split();
        assert!(!open.open(b"release 9", &t1), "changed");
        let (_, mut open) = a_session.clone().split();
        assert!(
            !open.open(b"release 2", &t2),
            "reordered (or the first dropped)"
        );
        let (_, mut open) = a_session.clone().split();
        assert!(open.open(b"release 1", &t1));
        assert!(!open.open(b"release 1", &t1), "replayed");
        // A's own frame sent back to A (reflection) does not pass as D's.
        let mine = a_seal.seal(b"grant");
        let (_, mut open) = a_session.split();
        assert!(!open.open(b"grant", &mine), "reflected");
    }

    #[test]
    fn a_different_key_fails_on_both_sides() {
        let (d, a) = run(
            &ClusterKey::generate().unwrap(),
            &ClusterKey::generate().unwrap(),
            "P",
        );
        assert!(matches!(d, Err(AuthError::BadProof)), "{d:?}");
        assert!(a.is_err(), "the acceptor never accepts the dialer");
    }

    /// An attacker that skips checking P's proof and answers with a proof made under another
    /// key, or with P's own proof sent back, is refused by the acceptor itself (the honest
    /// dialer's own check never comes into it).
    #[test]
    fn the_acceptor_checks_the_dialers_proof_itself() {
        let k = ClusterKey::generate().unwrap();
        let wrong = ClusterKey::generate().unwrap();
        for reflect in [false, true] {
            let (c, s) = pair();
            let key = k.clone();
            let acceptor =
                std::thread::spawn(move || accept(&s, &key, "side", "P", Duration::from_secs(2)));
            let dialer_nonce = [7u8; NONCE_BYTES];
            let mut hello = MAGIC.to_vec();
            hello.push(VERSION);
            put_id(&mut hello, "D").unwrap();
            hello.extend_from_slice(&dialer_nonce);
            (&c).write_all(&hello).unwrap();
            let mut d = Deadlined {
                stream: &c,
                deadline: Instant::now() + Duration::from_secs(2),
                limit: Duration::from_secs(2),
            };
            let (id, acceptor_nonce) = d.greeting().unwrap();
            let mut ps_proof = [0u8; PROOF_BYTES];
            d.read_exact(&mut ps_proof).unwrap();
            let t = Transcript {
                protocol: "side",
                dialer: "D",
                acceptor: &id,
                dialer_nonce: &dialer_nonce,
                acceptor_nonce: &acceptor_nonce,
            };
            let answer = if reflect {
                ps_proof
            } else {
                wrong.proof(b"dialer", &t)
            };
            (&c).write_all(&answer).unwrap();
            let r = acceptor.join().unwrap();
            assert!(
                matches!(r, Err(AuthError::BadProof)),
                "reflect={reflect}: {r:?}"
            );
        }
    }

    #[test]
    fn the_dialer_refuses_an_acceptor_that_is_someone_else() {
        let k = ClusterKey::generate().unwrap();
        let (d, a) = run(&k, &k, "P2");
        assert!(matches!(d, Err(AuthError::WrongPeer { .. })), "{d:?}");
        assert!(a.is_err());
    }

    #[test]
    fn a_proof_for_another_protocol_or_session_is_refused() {
        let k = ClusterKey::generate().unwrap();
        let n1 = [1u8; NONCE_BYTES];
        let n2 = [2u8; NONCE_BYTES];
        let t = |protocol, dn| Transcript {
            protocol,
            dialer: "D",
            acceptor: "P",
            dialer_nonce: dn,
            acceptor_nonce: &n2,
        };
        let p = k.proof(b"dialer", &t("side", &n1));
        assert!(k.verify(b"dialer", &t("side", &n1), &p));
        assert!(!k.verify(b"dialer", &t("tcp", &n1), &p));
        assert!(!k.verify(b"dialer", &t("side", &n2), &p));
        assert!(!k.verify(b"acceptor", &t("side", &n1), &p));
    }

    #[test]
    fn a_dribbling_peer_is_cut_at_the_deadline() {
        let (c, s) = pair();
        let limit = Duration::from_millis(600);
        let dribble = std::thread::spawn(move || {
            for b in MAGIC.iter().chain(std::iter::repeat(&0u8)).take(40) {
                if (&c).write_all(&[*b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        let started = Instant::now();
        let k = ClusterKey::generate().unwrap();
        let r = accept(&s, &k, "side", "P", limit);
        assert!(matches!(r, Err(AuthError::Deadline(_))), "{r:?}");
        assert!(started.elapsed() < limit * 3);
        drop(s);
        dribble.join().unwrap();
    }

    #[test]
    fn keys_round_trip_through_hex_and_bad_text_is_refused() {
        let k = ClusterKey::generate().unwrap();
        assert_eq!(
            ClusterKey::from_hex(&format!(" {}\n", k.to_hex())).unwrap(),
            k
        );
        assert!(ClusterKey::from_hex("abc").is_err());
        assert!(ClusterKey::from_hex(&"zz".repeat(KEY_BYTES)).is_err());
        assert_eq!(format!("{k:?}"), "ClusterKey(..)");
    }
}
