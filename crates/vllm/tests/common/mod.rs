//! The harness of the vLLM bridge tests: engines as vLLM's CPU backend lays out their KV,
//! driven as vLLM drives them, without Python.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use handoff_vllm::kv_tensors::{KvTensorInfo, ModelFacts};
use handoff_vllm::scheduler::{SchedulerConfig, SchedulerSide, StepMeta};
use handoff_vllm::worker::WorkerBridge;

pub const BLOCKS: i64 = 64;
pub const HEADS: i64 = 2;
pub const BS: i64 = 16;
pub const HD: i64 = 8;
pub const LAYERS: usize = 2;

pub fn block_bytes() -> usize {
    (HEADS * BS * 2 * HD * 4) as usize
}

/// One engine: KV tensors as vLLM's CPU backend allocates them (one buffer, a view per layer).
pub struct Engine {
    pub sched: SchedulerSide,
    pub worker: WorkerBridge,
    pub kv: KvMem,
    /// The tensor each layer's KV lives in (vLLM's hybrid manager: one tensor holds a layer
    /// of each KV cache group).
    tensor_of: Vec<usize>,
}

/// An engine's KV memory as vLLM holds it: handoff reads and writes it too (through
/// `KvRegion::from_foreign`), so the test, playing the engine's kernels, reaches it through a
/// raw pointer one access at a time and never holds a reference to it. Never freed: the
/// engine's transfers may run until the test process ends.
pub struct KvMem {
    pub ptr: *mut u8,
    len: usize,
}

#[allow(unsafe_code)]
impl KvMem {
    pub fn new(len: usize) -> KvMem {
        let ptr = Box::into_raw(vec![0u8; len].into_boxed_slice()).cast::<u8>();
        KvMem { ptr, len }
    }

    pub fn read(&self, start: usize, len: usize) -> Vec<u8> {
        assert!(start + len <= self.len);
        let mut out = vec![0u8; len];
        // SAFETY: in bounds of a live allocation (never freed); the test touches only blocks
        // no transfer moves at the time, as an engine's kernels do.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(start), out.as_mut_ptr(), len) };
        out
    }

    pub fn write(&self, start: usize, bytes: &[u8]) {
        assert!(start + bytes.len() <= self.len);
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(start), bytes.len()) };
    }
}

pub fn facts() -> ModelFacts {
    ModelFacts {
        num_kv_heads: HEADS as u32,
        head_dim: HD as u32,
        block_size: BS as u32,
        tp: 1,
        rank: 0,
        mla: false,
    }
}

pub fn engine(id: &str) -> Engine {
    engine_in(id, "pull")
}

pub fn engine_in(id: &str, mode: &str) -> Engine {
    engine_with(id, mode, true)
}

pub fn engine_with(id: &str, mode: &str, kv_digest: bool) -> Engine {
    engine_configured(id, mode, kv_digest, serde_json::json!({}))
}

/// An engine whose `kv_connector_extra_config` also holds `extra`.
pub fn engine_configured(
    id: &str,
    mode: &str,
    kv_digest: bool,
    extra: serde_json::Value,
) -> Engine {
    engine_built(id, mode, kv_digest, extra, None)
}

/// A hybrid model as vLLM's hybrid KV cache manager keeps it: layer 1 full attention, layer 0
/// a sliding window of `window` tokens, both layers' KV in one tensor (a block id belongs to
/// one group at a time).
pub fn hybrid_engine(id: &str, mode: &str, window: u32) -> Engine {
    let groups = serde_json::json!([
        {"layers": [1]},
        {"window": window, "layers": [0]},
    ]);
    engine_built(id, mode, true, serde_json::json!({}), Some(groups))
}

fn engine_built(
    id: &str,
    mode: &str,
    kv_digest: bool,
    extra: serde_json::Value,
    groups: Option<serde_json::Value>,
) -> Engine {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let layer = BLOCKS as usize * block_bytes();
    let tensor_of: Vec<usize> = match &groups {
        Some(_) => vec![0; LAYERS],
        None => (0..LAYERS).collect(),
    };
    let kv = KvMem::new((tensor_of.iter().max().unwrap_or(&0) + 1) * layer);
    let base = kv.ptr as u64;
    let tensors: Vec<KvTensorInfo> = (0..LAYERS)
        .map(|l| KvTensorInfo {
            name: format!("model.layers.{l}.self_attn.attn"),
            data_ptr: base + (tensor_of[l] * layer) as u64,
            shape: vec![BLOCKS, HEADS, BS, 2 * HD],
            strides: vec![HEADS * BS * 2 * HD, BS * 2 * HD, 2 * HD, 1],
            element_size: 4,
            device: None,
        })
        .collect();
    let worker = WorkerBridge::register(
        serde_json::from_value(serde_json::json!({
            "engine_id": id,
            "facts": facts(),
            "groups": groups.unwrap_or_else(|| serde_json::json!([])),
        }))
        .unwrap(),
        &tensors,
    )
    .unwrap();
    assert!(worker.opaque_blocks());
    let mut cfg = serde_json::json!({
        "engine_id": id,
        "model": "tiny",
        "dtype": "float32",
        "opaque_blocks": true,
        "mode": mode,
        // Every transfer here is checked end to end (unless a test says otherwise): a
        // mismatch would fail the request.
        "kv_digest": kv_digest,
    });
    for (k, v) in extra.as_object().expect("extra config is an object") {
        cfg[k] = v.clone();
    }
    let cfg: SchedulerConfig = serde_json::from_value(cfg).unwrap();
    let sched = SchedulerSide::start(cfg, vec![worker.hello().unwrap()]).unwrap();
    Engine {
        sched,
        worker,
        kv,
        tensor_of,
    }
}

impl Engine {
    /// One engine step: build_connector_meta → (pickled) → worker start_load_kv / get_finished
    /// → build_connector_worker_meta → (pickled) → update_connector_output.
    pub fn step(&mut self) -> StepMeta {
        let bytes = self.sched.build_meta().to_bytes();
        let meta = StepMeta::from_bytes(&bytes).unwrap();
        self.worker.apply(&meta);
        std::thread::sleep(Duration::from_millis(1));
        let reports: Vec<Vec<u8>> = self
            .worker
            .poll()
            .map(|r| postcard::to_allocvec(&r).unwrap())
            .into_iter()
            .collect();
        self.sched.worker_reports(&reports).unwrap();
        meta
    }

    pub fn block(&self, layer: usize, b: u32) -> Vec<u8> {
        let start = self.layer_start(layer) + b as usize * block_bytes();
        self.kv.read(start, block_bytes())
    }

    /// Where `layer`'s KV tensor starts in the engine's memory.
    pub fn layer_start(&self, layer: usize) -> usize {
        self.tensor_of[layer] * BLOCKS as usize * block_bytes()
    }
}

/// Steps both engines until D's request resumed (never failed) and P gave its blocks back (10 s
/// at most).
pub fn resumed_and_freed(p: &mut Engine, d: &mut Engine, p_req: &str, d_req: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut recved, mut sent) = (false, false);
    while !(recved && sent) {
        assert!(Instant::now() < deadline, "recved {recved} sent {sent}");
        let dm = d.step();
        assert!(dm.failed_recving.is_empty(), "{dm:?}");
        recved |= dm.finished_recving.contains(&d_req.to_string());
        sent |= p.step().finished_sending.contains(&p_req.to_string());
    }
}

/// Fills every byte of `blocks` on every layer with a pattern of its own.
pub fn fill(e: &mut Engine, blocks: &[u32], salt: usize) {
    for l in 0..LAYERS {
        fill_layer(e, blocks, salt, l);
    }
}

/// What a forward pass writes into one layer of `blocks` (never zero).
pub fn fill_layer(e: &mut Engine, blocks: &[u32], salt: usize, l: usize) {
    for (i, b) in blocks.iter().enumerate() {
        let start = e.layer_start(l) + *b as usize * block_bytes();
        let bytes: Vec<u8> = (0..block_bytes())
            .map(|j| (salt + l * 31 + i * 7 + j % 251) as u8 | 1)
            .collect();
        e.kv.write(start, &bytes);
    }
}
