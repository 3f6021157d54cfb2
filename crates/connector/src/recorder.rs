//! The trace recorder: writes every input the executor gives the core, and every batch the core
//! gives back, to a bounded set of rotating files (the format: `handoff_core::trace`).
//!
//! `handoff replay PATH` reads them back. When the file at `path` outgrows `max_bytes`, it
//! becomes `path.1` (an older `path.1` becomes `path.2`, and so on up to `files`; the oldest is
//! deleted) and a new `path` starts with a header that names its segment. A replay must start
//! where the core started, so once the first segment is deleted the trace can no longer be
//! replayed: size `max_bytes × files` for the run you want to keep (a handoff takes about 5 KB
//! on each side). An engine that starts again keeps the trace of its previous run: its files
//! get the suffix `.prev` (replacing an older `.prev` set), so the run that crashed is still
//! there after the restart. Recording never stops the engine: a write that fails is logged
//! once and recording ends.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use handoff_core::trace::{Header, Line, TRACE_VERSION};
use handoff_core::{Answer, CoreConfig, CoreError, Input, Ready, WorkerHello};
use handoff_ledger::Time;

/// The most segments a trace's files are looked for under (`files` beyond it are not kept).
const MAX_SEGMENTS: usize = 256;

/// Where and how much to record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordConfig {
    pub path: PathBuf,
    /// Bytes per file before it rotates.
    pub max_bytes: u64,
    /// Files kept, the current one included (at least 1).
    pub files: usize,
}

/// A segment's path: `path` itself for the newest, `path.N` for older ones.
pub fn segment_path(path: &Path, age: usize) -> PathBuf {
    if age == 0 {
        path.to_path_buf()
    } else {
        let mut p = path.as_os_str().to_owned();
        p.push(format!(".{age}"));
        PathBuf::from(p)
    }
}

pub struct Recorder {
    cfg: RecordConfig,
    header: Header,
    out: Option<BufWriter<File>>,
    written: u64,
    /// Inputs recorded so far (the next one's number).
    inputs: u64,
}

impl Recorder {
    /// Starts a trace of a core built from `config` and `ranks`; an earlier run's trace at the
    /// same path becomes `.prev` first.
    pub fn create(
        cfg: RecordConfig,
        config: &CoreConfig,
        ranks: &[WorkerHello],
    ) -> std::io::Result<Recorder> {
        let header = Header {
            handoff_trace: TRACE_VERSION,
            config: config.clone(),
            ranks: ranks.to_vec(),
            segment: 0,
            first_input: 0,
        };
        let mut r = Recorder {
            cfg,
            header,
            out: None,
            written: 0,
            inputs: 0,
        };
        r.keep_previous_run()?;
        r.open()?;
        Ok(r)
    }

    /// Renames the files of a previous run at this path to `….prev`, dropping older ones.
    fn keep_previous_run(&self) -> std::io::Result<()> {
        let keep = self.cfg.files.clamp(1, MAX_SEGMENTS);
        let prev = |p: PathBuf| {
            let mut s = p.into_os_string();
            s.push(".prev");
            PathBuf::from(s)
        };
        // Every segment there is, also past `keep` (an earlier run may have kept more files).
        let last = (0..MAX_SEGMENTS)
            .rev()
            .find(|&age| age < keep || segment_path(&self.cfg.path, age).exists())
            .unwrap_or(0);
        for age in 0..MAX_SEGMENTS {
            let _ = std::fs::remove_file(prev(segment_path(&self.cfg.path, age)));
        }
        for age in 0..=last {
            let p = segment_path(&self.cfg.path, age);
            if p.exists() {
                std::fs::rename(&p, prev(p.clone()))?;
            }
        }
        Ok(())
    }

    fn open(&mut self) -> std::io::Result<()> {
        let keep = self.cfg.files.clamp(1, MAX_SEGMENTS);
        // Older segments move up one; the oldest falls off.
        let _ = std::fs::remove_file(segment_path(&self.cfg.path, keep - 1));
        for age in (0..keep.saturating_sub(1)).rev() {
            let from = segment_path(&self.cfg.path, age);
            if from.exists() {
                std::fs::rename(&from, segment_path(&self.cfg.path, age + 1))?;
            }
        }
        let mut out = BufWriter::new(File::create(&self.cfg.path)?);
        let line = serde_json::to_string(&Line::Header(Box::new(self.header.clone())))?;
        writeln!(out, "{line}")?;
        out.flush()?;
        self.written = line.len() as u64 + 1;
        self.out = Some(out);
        Ok(())
    }

    /// Records input number `n` (the next one) and what the core answered.
    pub fn input(&mut self, at: Time, input: Input, answer: &Result<Answer, CoreError>) {
        let line = Line::input(self.inputs, at, input, answer);
        self.inputs += 1;
        self.write(&line, false);
    }

    /// Records a batch the executor took (without its observations), and flushes: a killed
    /// engine's trace ends with its last carried-out batch.
    pub fn batch(&mut self, ready: &Ready) {
        if ready.is_empty() || self.out.is_none() {
            return;
        }
        // Observations are not written (`Ready` skips them when serialised).
        let line = Line::Batch {
            after: self.inputs.saturating_sub(1),
            batch: ready.clone(),
        };
        self.write(&line, true);
    }

    fn write(&mut self, line: &Line, flush: bool) {
        let Some(out) = self.out.as_mut() else {
            return;
        };
        let r = serde_json::to_string(line)
            .map_err(std::io::Error::from)
            .and_then(|text| {
                writeln!(out, "{text}")?;
                if flush {
                    out.flush()?;
                }
                Ok(text.len() as u64 + 1)
            });
        let r = r.and_then(|n| {
            self.written += n;
            if self.written < self.cfg.max_bytes {
                return Ok(());
            }
            if let Some(mut out) = self.out.take() {
                out.flush()?;
            }
            self.header.segment += 1;
            self.header.first_input = self.inputs;
            self.open()
        });
        if let Err(e) = r {
            tracing::error!(path = %self.cfg.path.display(), error = %e, "cannot write the trace: recording stops");
            self.out = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_core::trace::{Replay, ReplayError};
    use handoff_core::{ConnectorCore, Role};
    use handoff_plan::{BlockLayout, KvSpec, ModelShape, RankLayout};
    use handoff_proto::{HandoffId, TransferMode};
    use std::time::Duration;

    fn core() -> (CoreConfig, Vec<WorkerHello>) {
        let spec = KvSpec {
            shape: ModelShape {
                num_layers: 2,
                num_kv_heads: 2,
                head_dim: 8,
                dtype_size: 2,
            },
            tp: 1,
            block_size: 16,
            block_layout: BlockLayout::HeadMajor,
        };
        let cfg = CoreConfig {
            engine_id: "p".into(),
            role: Role::Prefill,
            mode: TransferMode::Pull,
            model: "m".into(),
            dtype: "bf16".into(),
            advertise_host: "127.0.0.1".into(),
            side_channel_port: 1,
            producer: Default::default(),
            consumer: Default::default(),
            opaque_blocks: false,
            kv_digest: false,
            peer_hosts: Vec::new(),
            protocol_version: handoff_proto::PROTOCOL_VERSION,
            layerwise_pull: false,
            layer_reports: Default::default(),
        };
        let ranks = vec![WorkerHello {
            rank: 0,
            layout: RankLayout::cross_layer(spec, 0, 256, 0).unwrap(),
            agent: "p-r0".into(),
            metadata: vec![],
            memory: Default::default(),
            groups: Default::default(),
        }];
        (cfg, ranks)
    }

    /// Runs `n` pull prefills (started, then ended) through a recorded core, as the executor
    /// does.
    fn record(path: &Path, n: u64, max_bytes: u64, files: usize) {
        let (cfg, ranks) = core();
        let mut rec = Recorder::create(
            RecordConfig {
                path: path.to_path_buf(),
                max_bytes,
                files,
            },
            &cfg,
            &ranks,
        )
        .unwrap();
        let mut core = ConnectorCore::new(cfg, ranks).unwrap();
        for i in 0..n {
            let now = Duration::from_millis(i);
            let started = Input::PrefillStarted {
                request_id: format!("r{i}"),
                params: handoff_proto::KvTransferParams::for_prefill_leg(),
                handoff: HandoffId::from_bytes((i as u128 + 1).to_le_bytes()),
                blocks: vec![i as u32 % 200],
                num_tokens: 16,
            };
            let ended = Input::PrefillEnded {
                request_id: format!("r{i}"),
                outcome: handoff_core::PrefillOutcome::Finished,
            };
            for input in [started, ended] {
                let answer = core.handle(input.clone(), now);
                rec.input(now, input, &answer);
                let ready = core.ready();
                rec.batch(&ready);
                core.advance(ready);
            }
        }
    }

    fn replay(path: &Path, files: usize) -> Result<handoff_core::trace::ReplayReport, ReplayError> {
        let mut text = String::new();
        for age in (0..files).rev() {
            if let Ok(t) = std::fs::read_to_string(segment_path(path, age)) {
                text.push_str(&t);
            }
        }
        Replay::run(text.lines())
    }

    #[test]
    fn a_rotated_trace_replays_from_its_first_segment_and_not_without_it() {
        let dir = std::env::temp_dir().join(format!("handoff-rec-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl");
        // A few segments, all kept: the whole run replays (two inputs per prefill).
        record(&path, 20, 4000, 8);
        assert!(segment_path(&path, 2).exists(), "it rotated");
        let r = replay(&path, 8).unwrap();
        assert_eq!(r.inputs, 40);
        assert_eq!(r.divergence, None);
        assert!(r.violations.is_empty(), "{:?}", r.violations);
        // The previous run is kept aside; two files kept: the first segment is gone, and the
        // replay says so.
        record(&path, 20, 4000, 2);
        assert!(segment_path(&path, 1).exists());
        assert!(!segment_path(&path, 2).exists(), "at most two files");
        assert!(
            dir.join("t.jsonl.prev").exists(),
            "the previous run is kept"
        );
        let e = replay(&path, 2).unwrap_err();
        assert!(matches!(e, ReplayError::NotFromStart { .. }), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn segments_are_named_by_age() {
        let p = Path::new("/tmp/x/trace.jsonl");
        assert_eq!(segment_path(p, 0), PathBuf::from("/tmp/x/trace.jsonl"));
        assert_eq!(segment_path(p, 2), PathBuf::from("/tmp/x/trace.jsonl.2"));
    }
}
