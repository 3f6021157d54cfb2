//! The side channel: one TCP connection per pair of engines carrying handoff's control messages
//! (handshake, heartbeats and grants, releases, push registrations and cancels), framed as
//! `[u32 length][proto message]`. Bulk data and the completion notifications that must follow it
//! travel over the transport instead.
//!
//! A connection that closes is a dead peer (a SIGKILLed engine's socket is closed by the kernel at
//! once), which is how P reclaims a dead D's blocks in milliseconds rather than after a lease.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use handoff_proto::{decode, encode, Message, MAX_MESSAGE_BYTES};
use parking_lot::Mutex;

/// A connection, as the driver numbers it.
pub type ConnId = u64;

/// What the side-channel threads tell the driver.
#[derive(Debug)]
pub enum SideEvent {
    /// A peer connected to us and said hello (P side): reply on `conn`.
    Inbound { conn: Conn, msg: Message },
    /// A message on an established connection.
    Message { conn: ConnId, msg: Message },
    /// We connected to `engine` (D side) and it answered our hello. `attempt` is the number
    /// the driver gave this connection attempt (see [`connect`]).
    Connected {
        engine: String,
        attempt: u64,
        conn: Conn,
        reply: Message,
    },
    /// Connection attempt `attempt` to `engine` failed.
    ConnectFailed {
        engine: String,
        attempt: u64,
        error: String,
    },
    /// The connection closed or broke.
    Closed { conn: ConnId },
    /// Something for the driver to look at now (an API call queued work).
    Wake,
}

/// The writing half of a connection; the reading half runs on its own thread.
#[derive(Debug, Clone)]
pub struct Conn {
    pub id: ConnId,
    stream: Arc<Mutex<BufWriter<TcpStream>>>,
    closed: Arc<AtomicBool>,
}

impl Conn {
    /// Sends one message; an error means the connection is gone.
    pub fn send(&self, msg: &Message) -> Result<(), String> {
        if self.closed.load(Ordering::Relaxed) {
            return Err("connection closed".into());
        }
        let bytes = encode(msg).map_err(|e| e.to_string())?;
        let mut w = self.stream.lock();
        let r = w
            .write_all(&(bytes.len() as u32).to_le_bytes())
            .and_then(|_| w.write_all(&bytes))
            .and_then(|_| w.flush());
        r.map_err(|e| {
            self.closed.store(true, Ordering::Relaxed);
            e.to_string()
        })
    }

    pub fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let _ = self
            .stream
            .lock()
            .get_ref()
            .shutdown(std::net::Shutdown::Both);
    }
}

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

fn read_frame(r: &mut impl Read) -> Result<Message, String> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).map_err(|e| e.to_string())?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_MESSAGE_BYTES {
        return Err(format!("frame of {len} bytes refused"));
    }
    let mut buf = vec![0; len];
    r.read_exact(&mut buf).map_err(|e| e.to_string())?;
    decode(&buf).map_err(|e| e.to_string())
}

fn wrap(stream: TcpStream) -> Result<(Conn, TcpStream), String> {
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    stream
        .set_write_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    let reader = stream.try_clone().map_err(|e| e.to_string())?;
    let conn = Conn {
        id: NEXT_CONN.fetch_add(1, Ordering::Relaxed),
        stream: Arc::new(Mutex::new(BufWriter::new(stream))),
        closed: Arc::new(AtomicBool::new(false)),
    };
    Ok((conn, reader))
}

/// Reads frames until the connection ends; every frame goes to the driver.
fn read_loop(conn: Conn, reader: TcpStream, events: Sender<SideEvent>) {
    let mut r = BufReader::new(reader);
    loop {
        match read_frame(&mut r) {
            Ok(msg) => {
                if events
                    .send(SideEvent::Message { conn: conn.id, msg })
                    .is_err()
                {
                    break;
                }
            }
            Err(e) => {
                tracing::debug!(conn = conn.id, error = %e, "side channel closed");
                break;
            }
        }
    }
    conn.close();
    let _ = events.send(SideEvent::Closed { conn: conn.id });
}

/// Accepts connections until `stop` is set; returns the bound address.
pub fn listen(
    bind: SocketAddr,
    events: Sender<SideEvent>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(bind)?;
    let addr = listener.local_addr()?;
    listener.set_nonblocking(true)?;
    std::thread::Builder::new()
        .name("handoff-side-accept".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let events = events.clone();
                        std::thread::spawn(move || accept_one(stream, events));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "side channel accept failed");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            }
        })?;
    Ok(addr)
}

fn accept_one(stream: TcpStream, events: Sender<SideEvent>) {
    let _ = stream.set_nonblocking(false);
    let Ok((conn, reader)) = wrap(stream) else {
        return;
    };
    // The first frame must come quickly: a silent connection must not hold a thread forever.
    let _ = reader.set_read_timeout(Some(Duration::from_secs(5)));
    let mut r = BufReader::new(reader);
    let first = match read_frame(&mut r) {
        Ok(m) => m,
        Err(e) => {
            tracing::debug!(error = %e, "side channel: no valid first frame");
            conn.close();
            return;
        }
    };
    let _ = r.get_ref().set_read_timeout(None);
    if events
        .send(SideEvent::Inbound {
            conn: conn.clone(),
            msg: first,
        })
        .is_err()
    {
        return;
    }
    let reader = r.into_inner();
    read_loop(conn, reader, events);
}

/// Connects to `addr`, says `hello`, waits for the reply (bounded), then keeps reading. The
/// outcome names `attempt`, so the driver can tell it from that of a newer attempt to the same
/// engine (an attempt can take seconds to fail, and the peer may be retried meanwhile).
pub fn connect(
    engine: String,
    attempt: u64,
    addr: String,
    hello: Message,
    events: Sender<SideEvent>,
) {
    std::thread::spawn(move || {
        let result = (|| -> Result<(Conn, TcpStream, Message), String> {
            let sock: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(&addr)
                .map_err(|e| format!("cannot resolve {addr}: {e}"))?
                .next()
                .ok_or_else(|| format!("cannot resolve {addr}"))?;
            let stream = TcpStream::connect_timeout(&sock, Duration::from_secs(3))
                .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
            let (conn, reader) = wrap(stream)?;
            conn.send(&hello)?;
            reader
                .set_read_timeout(Some(Duration::from_secs(5)))
                .map_err(|e| e.to_string())?;
            let mut r = BufReader::new(reader);
            let reply = read_frame(&mut r).map_err(|e| format!("no handshake reply: {e}"))?;
            let reader = r.into_inner();
            reader.set_read_timeout(None).map_err(|e| e.to_string())?;
            Ok((conn, reader, reply))
        })();
        match result {
            Ok((conn, reader, reply)) => {
                if events
                    .send(SideEvent::Connected {
                        engine,
                        attempt,
                        conn: conn.clone(),
                        reply,
                    })
                    .is_ok()
                {
                    read_loop(conn, reader, events);
                }
            }
            Err(error) => {
                let _ = events.send(SideEvent::ConnectFailed {
                    engine,
                    attempt,
                    error,
                });
            }
        }
    });
}

/// Sends one message to `addr` and closes: for a proxy that must tell P to release and has no
/// connection of its own.
pub fn send_once(addr: &str, msg: &Message) -> Result<(), String> {
    let sock: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .map_err(|e| e.to_string())?
        .next()
        .ok_or("cannot resolve")?;
    let stream =
        TcpStream::connect_timeout(&sock, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    let (conn, _) = wrap(stream)?;
    conn.send(msg)?;
    conn.close();
    Ok(())
}
