//! The engine's calls on a [`Connector`]: each hook becomes one core [`Input`], forwarded to the
//! executor thread (and answered after the batch it caused went out); snapshots are read-only
//! queries, not inputs, so a trace does not record them.

use super::*;

impl Connector {
    /// A prompt's prefill ended: create the handoff under a fresh random id and return the
    /// `kv_transfer_params` for the response.
    pub fn on_prefill_finished(
        &self,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<KvTransferParams, ConnectorError> {
        let mut id = [0u8; 16];
        getrandom::getrandom(&mut id).map_err(|e| ConnectorError::Random(e.to_string()))?;
        self::params(self.call(Input::PrefillFinished {
            request_id: request_id.to_string(),
            handoff: HandoffId::from_bytes(id),
            blocks,
            num_tokens,
        })?)
    }

    pub fn on_push_prefill_start(
        &self,
        params: &KvTransferParams,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<HandoffId, ConnectorError> {
        handoff(self.call(Input::PushPrefillStart {
            params: params.clone(),
            blocks,
            num_tokens,
        })?)
    }

    /// See [`Input::PullPrefillStart`].
    pub fn on_pull_prefill_start(
        &self,
        params: &KvTransferParams,
        blocks: Vec<u32>,
    ) -> Result<Option<HandoffId>, ConnectorError> {
        match self.call(Input::PullPrefillStart {
            params: params.clone(),
            blocks,
        })? {
            Answer::MaybeHandoff(h) => Ok(h),
            other => Err(unexpected(other)),
        }
    }

    /// See [`Input::PullPrefillFinished`].
    pub fn on_pull_prefill_finished(
        &self,
        params: &KvTransferParams,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<KvTransferParams, ConnectorError> {
        self::params(self.call(Input::PullPrefillFinished {
            params: params.clone(),
            request_id: request_id.to_string(),
            blocks,
            num_tokens,
        })?)
    }

    /// See [`Input::PullPrefillFailed`].
    pub fn on_pull_prefill_failed(&self, handoff: HandoffId) {
        self.tell(Input::PullPrefillFailed { handoff });
    }

    /// Worker point "layer saved": the layer leaves for D as soon as its grant allows (push), or
    /// D may read it (layer-wise pull).
    pub fn on_layer_saved(&self, handoff: HandoffId, layer: u32) {
        self.tell(Input::LayerSaved { handoff, layer });
    }

    /// See [`Input::PushPrefilled`].
    pub fn on_push_prefilled(
        &self,
        params: &KvTransferParams,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<KvTransferParams, ConnectorError> {
        self::params(self.call(Input::PushPrefilled {
            params: params.clone(),
            request_id: request_id.to_string(),
            blocks,
            num_tokens,
        })?)
    }

    /// See [`Input::PushForward`].
    pub fn on_push_forward(
        &self,
        params: &KvTransferParams,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<HandoffId, ConnectorError> {
        handoff(self.call(Input::PushForward {
            params: params.clone(),
            blocks,
            num_tokens,
        })?)
    }

    pub fn on_push_prefill_finished(
        &self,
        params: &KvTransferParams,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<KvTransferParams, ConnectorError> {
        self::params(self.call(Input::PushParams {
            params: params.clone(),
            request_id: request_id.to_string(),
            blocks,
            num_tokens,
        })?)
    }

    /// The proxy says D never got the request: release at once unless a D claimed it.
    pub fn release_from_proxy(&self, params: &KvTransferParams) -> Result<(), ConnectorError> {
        self.call(Input::ReleaseFromProxy {
            params: params.clone(),
        })
        .map(drop)
    }

    pub fn on_request_arrived(
        &self,
        request: u64,
        params: &KvTransferParams,
        prompt_tokens: u32,
    ) -> Result<(), ConnectorError> {
        self.call(Input::RequestArrived {
            request,
            params: params.clone(),
            prompt_tokens,
        })
        .map(drop)
    }

    pub fn on_blocks_allocated(
        &self,
        request: u64,
        blocks: Vec<u32>,
    ) -> Result<(), ConnectorError> {
        self.on_blocks_allocated_after_cached(request, Vec::new(), blocks)
    }

    /// See [`Input::BlocksAllocated`].
    pub fn on_blocks_allocated_after_cached(
        &self,
        request: u64,
        cached: Vec<u32>,
        blocks: Vec<u32>,
    ) -> Result<(), ConnectorError> {
        self.call(Input::BlocksAllocated {
            request,
            cached,
            blocks,
        })
        .map(drop)
    }

    pub fn on_request_ended(&self, request: u64, reason: ReleaseReason) {
        self.tell(Input::RequestEnded { request, reason });
    }

    /// D refuses a request it never tracked: its P is told to release, unless this engine
    /// still tracks the handoff for another request.
    pub fn reject(&self, params: &KvTransferParams) -> Result<(), ConnectorError> {
        self.call(Input::Reject {
            params: params.clone(),
        })
        .map(drop)
    }

    pub fn held_blocks(&self) -> (usize, usize) {
        self.query(|core| core.held_blocks()).unwrap_or_default()
    }

    pub fn staged_messages(&self) -> usize {
        self.query(|core| core.staged_messages())
            .unwrap_or_default()
    }

    pub fn held_blocks_by_engine(&self) -> Vec<(String, usize)> {
        self.query(|core| core.held_blocks_by_engine())
            .unwrap_or_default()
    }

    /// Handoffs P holds now, and how many ended per reason so far.
    pub fn producer_stats(&self) -> Option<(usize, HashMap<&'static str, u64>)> {
        self.query(|core| core.producer_stats().map(|(n, s)| (n, s.ended.clone())))
            .ok()
            .flatten()
    }

    pub fn memory(&self) -> Option<CoreMemory> {
        self.query(|core| core.memory()).ok()
    }

    /// Brings the held-blocks gauges up to the ledgers' present state (before a scrape).
    pub fn refresh_metrics(&self) {
        // Any query does: the executor updates the gauges before it answers.
        let _ = self.query(|_| ());
    }

    /// Whether the connector takes work: not shut down, and its executor answers a query (the
    /// thread that owns the core, the side channel and the timers is alive).
    pub fn is_running(&self) -> bool {
        !self.stop.load(Ordering::Relaxed) && self.query(|_| ()).is_ok()
    }

    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the executor, which closes every connection and lets the workers go.
        self.tell(Input::CloseAll);
    }
}

/// The answer a hook that creates parameters gets.
fn params(a: Answer) -> Result<KvTransferParams, ConnectorError> {
    match a {
        Answer::Params(p) => Ok(p),
        other => Err(unexpected(other)),
    }
}

fn handoff(a: Answer) -> Result<HandoffId, ConnectorError> {
    match a {
        Answer::Handoff(h) => Ok(h),
        other => Err(unexpected(other)),
    }
}

/// An answer of another kind than the input's: a core bug, said rather than panicked on.
fn unexpected(a: Answer) -> ConnectorError {
    ConnectorError::UnexpectedAnswer(format!("{a:?}"))
}
