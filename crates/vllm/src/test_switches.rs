//! Fault injection for the vLLM suite's negative controls, switched by environment variables
//! (feature `test-switches`). The release wheel is built without the feature: none of this is
//! in it, and the variables do nothing there. The suite's wheel turns it on
//! (`scripts/test-vllm`, `scripts/gpu-check --prepare`).

use std::path::PathBuf;
use std::sync::Arc;

use handoff_connector::{WorkerOp, WorkerStep};
use handoff_transport::device::fake::FakeDevice;
use handoff_transport::faulty::{FaultPlan, FaultyTransport};
use handoff_transport::Transport;

use crate::kv_tensors::KvTensorInfo;

/// When this environment variable names a file, and while that file exists, every READ posted
/// lands with one byte changed (the transport reports it done), as a transfer that damaged its
/// blocks would; the KV digest must catch it.
pub const CORRUPT_SWITCH: &str = "HANDOFF_VLLM_TEST_CORRUPT_FILE";

/// When this environment variable names a file, and while that file exists, transfers the
/// scheduler side asks for are held back (posted once the file is gone), so a test can kill an
/// engine while its request waits for its KV.
pub const HOLD_SWITCH: &str = "HANDOFF_VLLM_TEST_HOLD_FILE";

/// When this environment variable is set, a KV cache in host memory is registered as the memory
/// of a fake CUDA device 0 that aliases it (`handoff_transport::device::fake`): every transfer,
/// tail zeroing and digest goes through device copies, and any host slice of it would fault.
/// How CI drives vLLM's hooks over "device" memory without a GPU.
pub const FAKE_DEVICE_SWITCH: &str = "HANDOFF_VLLM_TEST_FAKE_DEVICE";

/// The switches one worker read at registration.
#[derive(Default)]
pub struct Switches {
    corrupt: Option<(PathBuf, Arc<FaultyTransport>)>,
    hold: Option<(PathBuf, Vec<WorkerOp>)>,
    /// The KV is host memory posing as a fake device's: the forward's kernels ran on the host
    /// before each hook returned, so a layer needs no fence (vLLM's CPU runner gives no stream).
    pub host_kernels: bool,
}

impl Switches {
    /// With [`FAKE_DEVICE_SWITCH`] set and the KV on the host: the tensors re-addressed into a
    /// fake device that aliases them, and that device.
    pub fn fake_device(tensors: &[KvTensorInfo]) -> Option<(Vec<KvTensorInfo>, Arc<FakeDevice>)> {
        let on_host = tensors.first().is_some_and(|t| t.device.is_none());
        if !on_host || std::env::var_os(FAKE_DEVICE_SWITCH).is_none() {
            return None;
        }
        let fake = FakeDevice::new(0);
        let aliased = tensors
            .iter()
            .map(|t| {
                let mut t = t.clone();
                // SAFETY: vLLM keeps its KV cache for the process's life (as for
                // `KvRegion::from_foreign`); the fake device lives in this worker's regions.
                #[allow(unsafe_code)]
                let alias = unsafe { fake.adopt(t.data_ptr as usize, t.span_bytes()) };
                t.data_ptr = alias as u64;
                t.device = Some(0);
                t
            })
            .collect();
        tracing::warn!(
            "test switch {FAKE_DEVICE_SWITCH}: host KV registered as fake device memory"
        );
        Some((aliased, fake))
    }

    /// Reads [`CORRUPT_SWITCH`] and [`HOLD_SWITCH`]; with the first, `transport` comes back
    /// wrapped in a transport that can damage what it lands.
    pub fn read(transport: Arc<dyn Transport>) -> (Arc<dyn Transport>, Self) {
        let mut transport = transport;
        let corrupt = std::env::var_os(CORRUPT_SWITCH).map(|f| {
            let faulty = FaultyTransport::new(transport.clone(), FaultPlan::default());
            transport = faulty.clone();
            (PathBuf::from(f), faulty)
        });
        let switches = Switches {
            corrupt,
            hold: std::env::var_os(HOLD_SWITCH).map(|f| (f.into(), Vec::new())),
            host_kernels: false,
        };
        (transport, switches)
    }

    /// A step's ops as the switches let them through: READs damaged while the corrupt file
    /// exists, posts held back while the hold file exists (and let go once it is gone).
    pub fn filter(&mut self, mut step: WorkerStep) -> WorkerStep {
        if let Some((file, faulty)) = &self.corrupt {
            faulty.set_corrupt_read_pct(if file.exists() { 100 } else { 0 });
        }
        let Some((file, held)) = self.hold.as_mut() else {
            return step;
        };
        let (posts, rest): (Vec<_>, Vec<_>) = step
            .ops
            .into_iter()
            .partition(|op| matches!(op, WorkerOp::Post(_)));
        held.extend(posts);
        step.ops = Vec::with_capacity(rest.len());
        for op in rest {
            // A held job the scheduler side aborts ends (failed) without moving a byte: posted
            // with nothing to move, then aborted.
            if let WorkerOp::Abort { job } = &op {
                if let Some(i) = held
                    .iter()
                    .position(|h| matches!(h, WorkerOp::Post(t) if t.job == *job))
                {
                    if let WorkerOp::Post(mut t) = held.remove(i) {
                        t.parts.clear();
                        step.ops.push(WorkerOp::Post(t));
                    }
                }
            }
            step.ops.push(op);
        }
        if !file.exists() {
            step.ops.append(held);
        }
        step
    }
}
