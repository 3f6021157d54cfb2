//! The Python module `handoff_vllm._native`: thin classes over [`SchedulerSide`] and
//! [`WorkerBridge`]. Everything crosses as plain values (str, int, bytes, lists, JSON text); no
//! torch, no vLLM, no NIXL on this side. Errors become `RuntimeError` with handoff's message.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use handoff_connector::WorkerHello;
use handoff_proto::KvTransferParams;

use crate::engine_socket::Verb;
use crate::kv_tensors::KvTensorInfo;
use crate::scheduler::{Matched, SchedulerConfig, SchedulerSide, StepMeta};
use crate::worker::{WorkerBridge, WorkerConfig};

fn err(e: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

/// A client's `kv_transfer_params`. Malformed ones are logged and read as none: what a client
/// sends never raises into vLLM's scheduler (an exception there stops the engine).
fn params(json: Option<&str>) -> Option<KvTransferParams> {
    let json = json?;
    serde_json::from_str(json)
        .map_err(|e| tracing::warn!(error = %e, "malformed kv_transfer_params ignored"))
        .ok()
}

/// The scheduler side (EngineCore process).
// `unsendable`: vLLM calls every hook from its process's main thread.
#[pyclass(name = "Scheduler", module = "handoff_vllm._native", unsendable)]
struct PyScheduler {
    inner: SchedulerSide,
}

#[pymethods]
impl PyScheduler {
    /// `config_json`: [`SchedulerConfig`]; `hellos`: every worker's `hello()` bytes, by rank.
    #[new]
    fn new(config_json: &str, hellos: Vec<Vec<u8>>) -> PyResult<Self> {
        let cfg: SchedulerConfig =
            serde_json::from_str(config_json).map_err(|e| err(format!("config: {e}")))?;
        let hellos = hellos
            .iter()
            .map(|h| postcard::from_bytes::<WorkerHello>(h).map_err(|e| err(format!("hello: {e}"))))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(PyScheduler {
            inner: SchedulerSide::start(cfg, hellos).map_err(err)?,
        })
    }

    fn side_channel_port(&self) -> u16 {
        self.inner.side_channel_port()
    }

    /// vLLM's `request_finished`: whether the connector keeps the blocks, and the
    /// `kv_transfer_params` JSON for the response (P keeping blocks for a D).
    #[pyo3(signature = (request_id, params_json, blocks, num_tokens))]
    fn request_finished(
        &mut self,
        request_id: &str,
        params_json: Option<&str>,
        blocks: Vec<Vec<u32>>,
        num_tokens: u32,
    ) -> PyResult<(bool, Option<String>)> {
        let p = params(params_json);
        let (keep, out) = self
            .inner
            .request_finished(request_id, p.as_ref(), blocks, num_tokens)
            .map_err(err)?;
        let out = out
            .map(|p| serde_json::to_string(&p).map_err(err))
            .transpose()?;
        Ok((keep, out))
    }

    /// D: `(tokens, later)`: how many prompt tokens come from P (`None`: none, vLLM computes
    /// the prompt), or `later` true when vLLM must ask again at a later step (an n>1 sibling).
    fn remote_prefill_arrived(
        &mut self,
        request_id: &str,
        params_json: &str,
        prompt_tokens: u32,
    ) -> (Option<u32>, bool) {
        let p = params(Some(params_json)).unwrap_or_default();
        match self
            .inner
            .remote_prefill_arrived(request_id, &p, prompt_tokens)
        {
            Matched::Local => (None, false),
            Matched::Remote(n) => (Some(n), false),
            Matched::Later => (None, true),
        }
    }

    /// D: the request got `blocks` (one list per KV cache group, each cut to the prompt), the
    /// first `cached` of each a hit in vLLM's prefix cache; `num_tokens`: its prompt.
    #[pyo3(signature = (request_id, blocks, cached, num_tokens))]
    fn blocks_allocated(
        &mut self,
        request_id: &str,
        blocks: Vec<Vec<u32>>,
        cached: usize,
        num_tokens: u32,
    ) -> PyResult<()> {
        self.inner
            .blocks_allocated_after_cached(request_id, blocks, cached, num_tokens)
            .map_err(err)
    }

    /// vLLM computes the request's prompt itself: nothing will be loaded for it (see
    /// [`SchedulerSide::no_load`]).
    fn no_load(&mut self, request_id: &str) {
        self.inner.no_load(request_id)
    }

    /// P: the step being built completes this request's prompt; returns whether the
    /// connector holds its blocks from now on (see [`SchedulerSide::prefill_planned`]).
    fn prefill_planned(
        &mut self,
        request_id: &str,
        params_json: &str,
        blocks: Vec<Vec<u32>>,
        num_tokens: u32,
    ) -> PyResult<bool> {
        let p = params(Some(params_json)).ok_or_else(|| err("invalid kv_transfer_params"))?;
        self.inner
            .prefill_planned(request_id, &p, blocks, num_tokens)
            .map_err(err)
    }

    /// The step metadata (bytes) and, for vLLM, the request ids it settles:
    /// `(meta, finished_sending, finished_recving, failed_recving, forward)`; `forward` is true
    /// when the workers hold writes for this step's forward pass (`save_kv_layer` matters).
    #[allow(clippy::type_complexity)]
    fn build_meta<'py>(
        &mut self,
        py: Python<'py>,
    ) -> (
        Bound<'py, PyBytes>,
        Vec<String>,
        Vec<String>,
        Vec<String>,
        bool,
    ) {
        let meta = self.inner.build_meta();
        let bytes = PyBytes::new(py, &meta.to_bytes());
        (
            bytes,
            meta.finished_sending,
            meta.finished_recving,
            meta.failed_recving,
            !meta.forward.is_empty(),
        )
    }

    fn worker_reports(&mut self, reports: Vec<Vec<u8>>) -> PyResult<()> {
        self.inner.worker_reports(&reports).map_err(err)
    }

    fn has_pending_work(&self) -> bool {
        self.inner.has_pending_work()
    }

    fn shutdown(&self) {
        self.inner.shutdown();
    }
}

/// One rank's worker side (a worker process).
#[pyclass(name = "Worker", module = "handoff_vllm._native", unsendable)]
struct PyWorker {
    inner: WorkerBridge,
}

#[pymethods]
impl PyWorker {
    /// `config_json`: [`WorkerConfig`]; `tensors_json`: a list of [`KvTensorInfo`] (name,
    /// data_ptr, shape, strides, element_size), one per attention layer in layer order.
    #[new]
    fn new(config_json: &str, tensors_json: &str) -> PyResult<Self> {
        let cfg: WorkerConfig =
            serde_json::from_str(config_json).map_err(|e| err(format!("config: {e}")))?;
        let tensors: Vec<KvTensorInfo> =
            serde_json::from_str(tensors_json).map_err(|e| err(format!("tensors: {e}")))?;
        Ok(PyWorker {
            inner: WorkerBridge::register(cfg, &tensors).map_err(err)?,
        })
    }

    fn hello<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let h = self.inner.hello().map_err(err)?;
        let b = postcard::to_allocvec(&h).map_err(err)?;
        Ok(PyBytes::new(py, &b))
    }

    fn opaque_blocks(&self) -> bool {
        self.inner.opaque_blocks()
    }

    fn apply(&mut self, meta: &[u8]) -> PyResult<()> {
        let m = StepMeta::from_bytes(meta).map_err(err)?;
        self.inner.apply(&m);
        Ok(())
    }

    /// Whether a held write waits for layer `layer` of this step's forward pass.
    fn waits_for_layer(&self, layer: u32) -> bool {
        self.inner.waits_for_layer(layer)
    }

    /// vLLM `save_kv_layer`: the forward saved layer `layer`; on a GPU `stream` is the
    /// forward's CUDA stream (`torch.cuda.current_stream().cuda_stream`).
    #[pyo3(signature = (layer, stream=None))]
    fn layer_saved(&mut self, layer: u32, stream: Option<u64>) {
        self.inner.layer_saved(layer, stream);
    }

    /// vLLM `wait_for_save`: the forward pass ended (enqueued, on a GPU: see `layer_saved`).
    #[pyo3(signature = (stream=None))]
    fn forward_done(&mut self, stream: Option<u64>) {
        self.inner.forward_done(stream);
    }

    /// The report since the last call (bytes for the scheduler side), or `None`.
    fn poll<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        match self.inner.poll() {
            Some(r) => Ok(Some(PyBytes::new(
                py,
                &postcard::to_allocvec(&r).map_err(err)?,
            ))),
            None => Ok(None),
        }
    }

    fn shutdown(&mut self) {
        self.inner.shutdown();
    }
}

/// D's API server: names the params of a request vLLM refused before admission to engine
/// `engine_id`'s connector (see [`crate::engine_socket`]); returns its answer (`ok` or
/// `error: ...`). Releases the GIL while it waits (at most a second or two).
#[pyfunction]
fn tell_refusal(py: Python<'_>, engine_id: &str, params_json: &str) -> PyResult<String> {
    ask(py, engine_id, Verb::Refuse, params_json.as_bytes())
}

/// P's API server: engine `engine_id`'s handoff info as JSON (`GET /v1/handoff/info`), or
/// `error: ...`. Releases the GIL while it waits.
#[pyfunction]
fn engine_info(py: Python<'_>, engine_id: &str) -> PyResult<String> {
    ask(py, engine_id, Verb::Info, b"")
}

/// P's and D's API server: engine `engine_id`'s connector metrics in Prometheus' text format (to
/// append to vLLM's `/metrics`), or `error: ...`. Releases the GIL while it waits.
#[pyfunction]
fn engine_metrics(py: Python<'_>, engine_id: &str) -> PyResult<String> {
    ask(py, engine_id, Verb::Metrics, b"")
}

fn ask(py: Python<'_>, engine_id: &str, verb: Verb, body: &[u8]) -> PyResult<String> {
    py.detach(|| crate::engine_socket::ask(engine_id, verb, body))
        .map_err(|e| err(format!("engine socket of {engine_id}: {e}")))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // handoff's logs go to the process's stderr (vLLM's log), filtered by RUST_LOG (default:
    // warnings). A second init (another import) is a no-op.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .try_init();
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyWorker>()?;
    m.add_function(wrap_pyfunction!(tell_refusal, m)?)?;
    m.add_function(wrap_pyfunction!(engine_info, m)?)?;
    m.add_function(wrap_pyfunction!(engine_metrics, m)?)?;
    Ok(())
}
