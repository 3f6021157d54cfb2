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

/// Bytes of one layer's block on each rank of an engine of `tp` ranks.
pub fn rank_block_bytes(tp: usize) -> usize {
    head_bytes() * HEADS as usize / tp
}

/// Bytes of one head's chunk of a block (its K and V rows, as the kernel keeps them).
pub fn head_bytes() -> usize {
    (BS * 2 * HD * 4) as usize
}

/// One engine: per rank, a worker and KV tensors as vLLM's CPU backend allocates them (one
/// buffer, a view per layer), the rank holding `HEADS / tp` of the heads.
pub struct Engine {
    pub sched: SchedulerSide,
    pub workers: Vec<WorkerBridge>,
    pub kvs: Vec<KvMem>,
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
    facts_of(1, 0)
}

pub fn facts_of(tp: u32, rank: u32) -> ModelFacts {
    ModelFacts {
        num_kv_heads: HEADS as u32,
        head_dim: HD as u32,
        block_size: BS as u32,
        tp,
        rank,
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
    engine_built(id, mode, kv_digest, extra, None, (1, BS))
}

/// An engine of `tp` ranks (each a worker with `HEADS / tp` heads), digests compared.
pub fn engine_tp(id: &str, mode: &str, tp: usize) -> Engine {
    engine_built(id, mode, true, serde_json::json!({}), None, (tp, BS))
}

/// [`engine_tp`] with blocks of `block_size` tokens (its KV never filled: the helpers that
/// fill and read blocks take `BS`).
pub fn engine_tp_bs(id: &str, mode: &str, tp: usize, block_size: i64) -> Engine {
    engine_built(
        id,
        mode,
        true,
        serde_json::json!({}),
        None,
        (tp, block_size),
    )
}

/// A hybrid model as vLLM's hybrid KV cache manager keeps it: layer 1 full attention, layer 0
/// a sliding window of `window` tokens, both layers' KV in one tensor (a block id belongs to
/// one group at a time).
pub fn hybrid_engine(id: &str, mode: &str, window: u32) -> Engine {
    let groups = serde_json::json!([
        {"layers": [1]},
        {"window": window, "layers": [0]},
    ]);
    engine_built(id, mode, true, serde_json::json!({}), Some(groups), (1, BS))
}

fn engine_built(
    id: &str,
    mode: &str,
    kv_digest: bool,
    extra: serde_json::Value,
    groups: Option<serde_json::Value>,
    (tp, bs): (usize, i64),
) -> Engine {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let layer = BLOCKS as usize * rank_block_bytes(tp) * bs as usize / BS as usize;
    let heads = HEADS / tp as i64;
    let tensor_of: Vec<usize> = match &groups {
        Some(_) => vec![0; LAYERS],
        None => (0..LAYERS).collect(),
    };
    let groups = groups.unwrap_or_else(|| serde_json::json!([]));
    let (mut workers, mut kvs) = (Vec::new(), Vec::new());
    for rank in 0..tp {
        let kv = KvMem::new((tensor_of.iter().max().unwrap_or(&0) + 1) * layer);
        let base = kv.ptr as u64;
        let tensors: Vec<KvTensorInfo> = (0..LAYERS)
            .map(|l| KvTensorInfo {
                name: format!("model.layers.{l}.self_attn.attn"),
                data_ptr: base + (tensor_of[l] * layer) as u64,
                shape: vec![BLOCKS, heads, bs, 2 * HD],
                strides: vec![heads * bs * 2 * HD, bs * 2 * HD, 2 * HD, 1],
                element_size: 4,
                device: None,
            })
            .collect();
        let worker = WorkerBridge::register(
            serde_json::from_value(serde_json::json!({
                "engine_id": id,
                "facts": ModelFacts {
                    block_size: bs as u32,
                    ..facts_of(tp as u32, rank as u32)
                },
                "groups": groups,
            }))
            .unwrap(),
            &tensors,
        )
        .unwrap();
        assert!(worker.opaque_blocks());
        workers.push(worker);
        kvs.push(kv);
    }
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
    let hellos = workers.iter().map(|w| w.hello().unwrap()).collect();
    let sched = SchedulerSide::start(cfg, hellos).unwrap();
    Engine {
        sched,
        workers,
        kvs,
        tensor_of,
    }
}

impl Engine {
    /// One engine step: build_connector_meta → (pickled) → worker start_load_kv / get_finished
    /// → build_connector_worker_meta → (pickled) → update_connector_output.
    pub fn step(&mut self) -> StepMeta {
        let bytes = self.sched.build_meta().to_bytes();
        let meta = StepMeta::from_bytes(&bytes).unwrap();
        for w in &mut self.workers {
            w.apply(&meta);
        }
        std::thread::sleep(Duration::from_millis(1));
        let reports: Vec<Vec<u8>> = self
            .workers
            .iter_mut()
            .filter_map(|w| w.poll())
            .map(|r| postcard::to_allocvec(&r).unwrap())
            .collect();
        self.sched.worker_reports(&reports).unwrap();
        meta
    }

    /// Rank 0's block `b` of `layer`.
    pub fn block(&self, layer: usize, b: u32) -> Vec<u8> {
        let start = self.layer_start(layer) + b as usize * self.block_bytes();
        self.kvs[0].read(start, self.block_bytes())
    }

    /// Global KV head `head`'s chunk of block `b` of `layer`, from the rank that holds it.
    pub fn head_chunk(&self, layer: usize, b: u32, head: usize) -> Vec<u8> {
        let per_rank = HEADS as usize / self.kvs.len();
        let (rank, local) = (head / per_rank, head % per_rank);
        let start =
            self.layer_start(layer) + b as usize * self.block_bytes() + local * head_bytes();
        self.kvs[rank].read(start, head_bytes())
    }

    /// Bytes of one layer's block on each of this engine's ranks.
    pub fn block_bytes(&self) -> usize {
        rank_block_bytes(self.kvs.len())
    }

    /// Where `layer`'s KV tensor starts in each rank's memory.
    pub fn layer_start(&self, layer: usize) -> usize {
        self.tensor_of[layer] * BLOCKS as usize * self.block_bytes()
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

/// Fills every byte of `blocks` on every layer of rank 0 with a pattern of its own.
pub fn fill(e: &mut Engine, blocks: &[u32], salt: usize) {
    for l in 0..LAYERS {
        fill_layer(e, blocks, salt, l);
    }
}

/// What a forward pass writes into one layer of `blocks` (never zero).
pub fn fill_layer(e: &mut Engine, blocks: &[u32], salt: usize, l: usize) {
    for (i, b) in blocks.iter().enumerate() {
        let start = e.layer_start(l) + *b as usize * e.block_bytes();
        let bytes: Vec<u8> = (0..e.block_bytes())
            .map(|j| (salt + l * 31 + i * 7 + j % 251) as u8 | 1)
            .collect();
        e.kvs[0].write(start, &bytes);
    }
}

/// Fills every byte of each head's chunk of `blocks`, on every layer, with a pattern of the
/// chunk's own (layer, head, block index, byte), on whichever rank holds the head.
pub fn fill_heads(e: &mut Engine, blocks: &[u32], salt: usize) {
    let per_rank = HEADS as usize / e.kvs.len();
    for l in 0..LAYERS {
        for (i, b) in blocks.iter().enumerate() {
            for head in 0..HEADS as usize {
                let (rank, local) = (head / per_rank, head % per_rank);
                let start = e.layer_start(l) + *b as usize * e.block_bytes() + local * head_bytes();
                let bytes: Vec<u8> = (0..head_bytes())
                    .map(|j| (salt + l * 31 + head * 13 + i * 7 + j % 251) as u8 | 1)
                    .collect();
                e.kvs[rank].write(start, &bytes);
            }
        }
    }
}
