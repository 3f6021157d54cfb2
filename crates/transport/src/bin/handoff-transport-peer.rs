//! The remote side of the cross-process conformance suite: opens a backend, registers regions
//! filled with a seeded pattern, answers notifications the moment they arrive (see
//! `conformance::Responder`) and obeys line commands on stdin:
//!
//! `LOAD <hex md>` · `HASH <region> <offset> <len>` · `NOTIFS` · `REFILL <seed>` ·
//! `SEND <peer> <hex msg>` · `EXIT`
//!
//! Usage: `handoff-transport-peer <backend> <name> <seed> <region len>...`; prints `MD <hex>`.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::sync::Arc;

use handoff_transport::conformance::{fill, fnv, from_hex, to_hex, Responder};
use handoff_transport::{open_backend, KvRegion, RegionId};

fn main() {
    if let Err(e) = run() {
        println!("ERR {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        return Err("usage: handoff-transport-peer <backend> <name> <seed> <region len>...".into());
    }
    let t = open_backend(&args[1], &args[2]).map_err(|e| e.to_string())?;
    let seed: u64 = args[3].parse().map_err(|_| "bad seed")?;
    let mut regions: HashMap<RegionId, Arc<KvRegion>> = HashMap::new();
    for (i, len) in args[4..].iter().enumerate() {
        let len: usize = len.parse().map_err(|_| "bad length")?;
        let r = Arc::new(KvRegion::new(len, 64 * 1024));
        fill(&r, seed, i as RegionId);
        t.register(i as RegionId, r.clone())
            .map_err(|e| e.to_string())?;
        regions.insert(i as RegionId, r);
    }
    let md = t.local_metadata().map_err(|e| e.to_string())?;
    let responder = Responder::start(t.clone(), regions.clone());
    let mut out = std::io::stdout().lock();
    writeln!(out, "MD {}", to_hex(&md)).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let reply = match words.as_slice() {
            ["LOAD", hex] => match from_hex(hex).map(|md| t.load_remote(&md)) {
                Some(Ok(name)) => format!("OK {name}"),
                Some(Err(e)) => format!("ERR {e}"),
                None => "ERR bad hex".into(),
            },
            ["HASH", r, o, n] => {
                let (r, o, n): (RegionId, usize, usize) = (
                    r.parse().unwrap_or(u32::MAX),
                    o.parse().unwrap_or(usize::MAX),
                    n.parse().unwrap_or(0),
                );
                match regions.get(&r) {
                    Some(region) => {
                        let mut buf = vec![0; n];
                        match region.read(o, &mut buf) {
                            Ok(()) => format!("HASH {}", fnv(&buf)),
                            Err(e) => format!("ERR {e}"),
                        }
                    }
                    None => "ERR no such region".into(),
                }
            }
            ["NOTIFS"] => {
                let seen = responder.take();
                let mut s = format!("NOTIFS {}", seen.len());
                for n in seen {
                    let check = match n.check_ok {
                        Some(true) => "ok",
                        Some(false) => "bad",
                        None => "-",
                    };
                    s.push_str(&format!("\nN {} {} {}", n.from, check, to_hex(&n.msg)));
                }
                s
            }
            ["REFILL", s] => {
                let s: u64 = s.parse().unwrap_or(0);
                for (id, r) in &regions {
                    fill(r, s, *id);
                }
                "OK".into()
            }
            ["SEND", peer, hex] => match from_hex(hex).map(|m| t.send_notification(peer, &m)) {
                Some(Ok(())) => "OK".into(),
                Some(Err(e)) => format!("ERR {e}"),
                None => "ERR bad hex".into(),
            },
            ["EXIT"] => break,
            _ => format!("ERR unknown command {line:?}"),
        };
        writeln!(out, "{reply}").map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
    }
    Ok(())
}
