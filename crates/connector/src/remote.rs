//! Worker sides in another process than the scheduler side (vLLM runs one worker process per
//! rank beside its EngineCore). The two ends speak the step metadata of [`crate::worker_protocol`] over one
//! TCP connection, framed as `[u32 length][postcard]`:
//!
//! - the worker process dials the scheduler side and says [`FromWorker::Hello`] (every rank it
//!   serves), then sends a [`FromWorker::Report`] whenever a worker has one;
//! - the scheduler side sends [`ToWorker::Step`]s.
//!
//! Closing the connection stops the workers (and the scheduler side learns nothing more from
//! them: their transfers end by the ledgers' deadlines).

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::executor::{ReportSink, WorkerLink};
use crate::worker::{self, WorkerSide};
use crate::worker_protocol::{WorkerHello, WorkerReport, WorkerStep};

/// Largest frame either end accepts.
const MAX_FRAME: usize = 64 << 20;

#[derive(Debug, Serialize, Deserialize)]
pub enum ToWorker {
    Step { rank: u16, step: WorkerStep },
}

#[derive(Debug, Serialize, Deserialize)]
pub enum FromWorker {
    Hello(Vec<WorkerHello>),
    Report(WorkerReport),
}

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("bad frame: {0}")]
    Frame(String),
    #[error("the peer did not start with a hello")]
    NoHello,
}

fn write_msg<T: Serialize>(w: &mut impl Write, msg: &T) -> Result<(), RemoteError> {
    let bytes = postcard::to_allocvec(msg).map_err(|e| RemoteError::Frame(e.to_string()))?;
    w.write_all(&(bytes.len() as u32).to_le_bytes())?;
    w.write_all(&bytes)?;
    w.flush()?;
    Ok(())
}

fn read_msg<T: for<'de> Deserialize<'de>>(r: &mut impl Read) -> Result<T, RemoteError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(RemoteError::Frame(format!("{len} bytes")));
    }
    let mut buf = vec![0; len];
    r.read_exact(&mut buf)?;
    postcard::from_bytes(&buf).map_err(|e| RemoteError::Frame(e.to_string()))
}

/// Worker process: serves `workers` for the scheduler side at `addr` until it hangs up.
pub fn serve(addr: SocketAddr, workers: Vec<WorkerSide>) -> Result<(), RemoteError> {
    let stream = TcpStream::connect(addr)?;
    stream.set_nodelay(true)?;
    let writer = Arc::new(Mutex::new(BufWriter::new(stream.try_clone()?)));
    let hellos = workers
        .iter()
        .map(WorkerSide::hello)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| RemoteError::Frame(e.to_string()))?;
    write_msg(&mut *writer.lock(), &FromWorker::Hello(hellos))?;
    let mut steps: Vec<Sender<WorkerStep>> = Vec::new();
    let mut threads = Vec::new();
    for w in workers {
        let (tx, rx) = channel();
        let writer = writer.clone();
        threads.push(worker::spawn(w, rx, move |r| {
            write_msg(&mut *writer.lock(), &FromWorker::Report(r)).is_ok()
        })?);
        steps.push(tx);
    }
    let mut r = BufReader::new(stream);
    while let Ok(ToWorker::Step { rank, step }) = read_msg::<ToWorker>(&mut r) {
        if let Some(tx) = steps.get(rank as usize) {
            let _ = tx.send(step);
        }
    }
    drop(steps);
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

/// Scheduler side: the connection of one worker process, accepted on `listener`. Returns what
/// its workers said and a [`RemoteWorkers`] to start once the connector is.
pub fn accept(listener: &TcpListener) -> Result<(Vec<WorkerHello>, RemoteWorkers), RemoteError> {
    let (stream, _) = listener.accept()?;
    stream.set_nodelay(true)?;
    let mut r = BufReader::new(stream.try_clone()?);
    let FromWorker::Hello(hellos) = read_msg::<FromWorker>(&mut r)? else {
        return Err(RemoteError::NoHello);
    };
    Ok((
        hellos,
        RemoteWorkers {
            writer: Arc::new(Mutex::new(BufWriter::new(stream))),
            reader: r,
        },
    ))
}

/// The scheduler side's end of a worker process's connection.
pub struct RemoteWorkers {
    writer: Arc<Mutex<BufWriter<TcpStream>>>,
    reader: BufReader<TcpStream>,
}

struct RemoteLink {
    rank: u16,
    writer: Arc<Mutex<BufWriter<TcpStream>>>,
}

impl WorkerLink for RemoteLink {
    fn send(&mut self, step: WorkerStep) -> bool {
        write_msg(
            &mut *self.writer.lock(),
            &ToWorker::Step {
                rank: self.rank,
                step,
            },
        )
        .is_ok()
    }
}

impl RemoteWorkers {
    /// One link per rank, and a thread that feeds the workers' reports to `sink`.
    pub fn start(self, ranks: u16, sink: &ReportSink) -> std::io::Result<Vec<Box<dyn WorkerLink>>> {
        let sink = sink.clone();
        let mut reader = self.reader;
        std::thread::Builder::new()
            .name("handoff-remote-workers".into())
            .spawn(move || {
                while let Ok(FromWorker::Report(r)) = read_msg::<FromWorker>(&mut reader) {
                    if !sink.report(r) {
                        break;
                    }
                }
            })?;
        Ok((0..ranks)
            .map(|rank| {
                Box::new(RemoteLink {
                    rank,
                    writer: self.writer.clone(),
                }) as Box<dyn WorkerLink>
            })
            .collect())
    }
}
