//! The engine's calls on a [`Connector`]: the typed [`Hooks`] of the core, each one [`Input`]
//! forwarded to the executor thread (and answered after the batch it caused went out);
//! snapshots are read-only queries, not inputs, so a trace does not record them, and a query
//! on a stopped executor is an error.

use super::*;

/// Handoffs P holds now, and how many ended per reason so far.
pub type ProducerStats = (usize, HashMap<&'static str, u64>);

impl Hooks for Connector {
    type Error = ConnectorError;

    fn give(&self, input: Input) -> Result<Answer, ConnectorError> {
        self.call(input)
    }

    /// Without waiting for the answer (see [`Connector::tell`]).
    fn tell(&self, input: Input) {
        Connector::tell(self, input)
    }
}

impl Connector {
    /// A fresh random handoff id, for a prefill whose flow may create one of P's own (pull).
    pub fn new_handoff_id() -> Result<HandoffId, ConnectorError> {
        let mut id = [0u8; 16];
        getrandom::getrandom(&mut id).map_err(|e| ConnectorError::Random(e.to_string()))?;
        Ok(HandoffId::from_bytes(id))
    }

    /// [`Hooks::prefill_started`] under a fresh random handoff id.
    pub fn prefill_started_now(
        &self,
        request_id: &str,
        params: &KvTransferParams,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<Option<HandoffId>, ConnectorError> {
        let handoff = Self::new_handoff_id()?;
        self.prefill_started(request_id, params, handoff, blocks, num_tokens)
    }

    /// Blocks held as P and as D.
    pub fn held_blocks(&self) -> Result<(usize, usize), ConnectorError> {
        self.query(|core| core.held_blocks())
    }

    pub fn staged_messages(&self) -> Result<usize, ConnectorError> {
        self.query(|core| core.staged_messages())
    }

    pub fn held_blocks_by_engine(&self) -> Result<Vec<(String, usize)>, ConnectorError> {
        self.query(|core| core.held_blocks_by_engine())
    }

    /// Handoffs P holds now, and how many ended per reason so far (none: not a P).
    pub fn producer_stats(&self) -> Result<Option<ProducerStats>, ConnectorError> {
        self.query(|core| core.producer_stats().map(|(n, s)| (n, s.ended.clone())))
    }

    pub fn memory(&self) -> Result<CoreMemory, ConnectorError> {
        self.query(|core| core.memory())
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
