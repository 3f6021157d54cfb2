//! P's scheduler hooks (the inputs `PrefillFinished`, `PushPrefillStart`, `LayerSaved`,
//! `PullPrefillStart`, `PullPrefillFinished`, `PullPrefillFailed`, `PushPrefilled`,
//! `PushForward`, `PushParams`, `ReleaseFromProxy`): one entry per flow's moment, each handing
//! the handoff to the producer ledger, and the `kv_transfer_params` P answers with.

use super::*;

impl ConnectorCore {
    /// A prompt's prefill ended and `blocks` hold its KV: create the handoff (one, whatever n
    /// is) under `handoff` (128 random bits from the caller) and return the
    /// `kv_transfer_params` for the response. The blocks stay out of the pool until a
    /// [`ConnectorEvent::BlocksReleased`] names them.
    pub(crate) fn on_prefill_finished(
        &mut self,
        request_id: &str,
        handoff: HandoffId,
        blocks: Vec<u32>,
        num_tokens: u32,
        now: Time,
    ) -> Result<KvTransferParams, CoreError> {
        let p = self
            .producer
            .as_mut()
            .ok_or(CoreError::WrongRole("prefill for remote decode"))?;
        let grant = p.create_handoff(handoff, blocks.clone(), TransferMode::Pull, now)?;
        if self.cfg.kv_digest {
            self.prompt_tokens.insert(handoff, num_tokens);
        }
        self.redeclare_dead(now);
        self.pump(now);
        Ok(self.params_for(
            handoff,
            grant.epoch,
            request_id,
            blocks,
            num_tokens,
            grant.lease_ms,
            TransferMode::Pull,
        ))
    }

    /// P, push mode: the request (handoff id chosen by the proxy) got `blocks` and its prefill
    /// starts now. D's registration may already be waiting (staged) or come later.
    pub(crate) fn on_push_prefill_start(
        &mut self,
        params: &KvTransferParams,
        blocks: Vec<u32>,
        num_tokens: u32,
        now: Time,
    ) -> Result<HandoffId, CoreError> {
        let handoff = push_handoff(params)?;
        let p = self
            .producer
            .as_mut()
            .ok_or(CoreError::WrongRole("prefill for remote decode"))?;
        p.create_handoff(handoff, blocks.clone(), TransferMode::Push, now)?;
        self.transfers
            .start_push(handoff, blocks, num_tokens, self.cfg.kv_digest);
        // A registration staged before the handoff existed may come from a D that died since:
        // its death was reported when nothing was bound to it yet.
        self.redeclare_dead(now);
        self.pump(now);
        Ok(handoff)
    }

    /// P: layer `layer` of the handoff's KV is in its blocks. Push: it is written to D as soon
    /// as D's registration holds a valid grant. Layer-wise pull: D is told it may read it.
    pub(crate) fn on_layer_saved(&mut self, handoff: HandoffId, layer: u32, now: Time) {
        if self.transfers.layer_saved(handoff, layer) {
            self.ask_push_digest(handoff);
            self.advance_push(handoff, now);
        } else if let Some(p) = self.producer.as_mut() {
            p.layers_saved(handoff, layer.saturating_add(1));
        }
        self.pump(now);
    }

    /// P, layer-wise pull (`params.layerwise`, both legs sent at once by the proxy): the
    /// request got `blocks` and its prefill starts now. The handoff, under the proxy's id,
    /// exists from now on, and D reads each layer once [`Self::on_layer_saved`] said it is
    /// saved. With `kv_digest` the handoff is created only when the prefill ended (a digest
    /// covers the final KV): D's early questions wait for it, and it reads every layer at once.
    /// Returns the handoff when it holds `blocks` from now on (they come back only through
    /// [`ConnectorEvent::BlocksReleased`]).
    pub(crate) fn on_pull_prefill_start(
        &mut self,
        params: &KvTransferParams,
        blocks: Vec<u32>,
        now: Time,
    ) -> Result<Option<HandoffId>, CoreError> {
        let handoff = layerwise_handoff(params)?;
        let p = self
            .producer
            .as_mut()
            .ok_or(CoreError::WrongRole("prefill for remote decode"))?;
        if self.cfg.kv_digest {
            return Ok(None);
        }
        p.create_filling_handoff(handoff, blocks, now)?;
        // A query staged before the handoff existed may come from a D that died since.
        self.redeclare_dead(now);
        self.pump(now);
        Ok(Some(handoff))
    }

    /// P, layer-wise pull: the prefill ended and every layer is saved. Returns the parameters
    /// for the response (the handoff's blocks, for the record: D has them from P already).
    pub(crate) fn on_pull_prefill_finished(
        &mut self,
        params: &KvTransferParams,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
        now: Time,
    ) -> Result<KvTransferParams, CoreError> {
        let handoff = layerwise_handoff(params)?;
        let p = self
            .producer
            .as_mut()
            .ok_or(CoreError::WrongRole("prefill for remote decode"))?;
        let mut out = if p.contains(handoff) {
            p.prefill_ended(handoff, true, now);
            self.pump(now);
            self.params_under_proxy_id(handoff, TransferMode::Pull, request_id, blocks, num_tokens)
        } else {
            // Created only now (`kv_digest`), like a classic pull's.
            self.on_prefill_finished(request_id, handoff, blocks, num_tokens, now)?
        };
        out.layerwise = Some(true);
        Ok(out)
    }

    /// P, layer-wise pull: the prefill failed or was abandoned. The handoff ends: at once when
    /// no D learned of its blocks, else after the fence (D may be reading saved layers).
    pub(crate) fn on_pull_prefill_failed(&mut self, handoff: HandoffId, now: Time) {
        if let Some(p) = self.producer.as_mut() {
            p.prefill_ended(handoff, false, now);
        }
        self.pump(now);
    }

    /// P, push mode, for engines that learn of a prompt's KV only once its whole prefill ended
    /// (vLLM: `request_finished`, after chunked prefill): the handoff starts with every layer
    /// saved, so its writes go as soon as D's registration (staged if it came first) holds a
    /// grant. Returns the parameters for the response.
    pub(crate) fn on_push_prefilled(
        &mut self,
        params: &KvTransferParams,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
        now: Time,
    ) -> Result<KvTransferParams, CoreError> {
        self.on_push_forward(params, blocks.clone(), num_tokens, now)?;
        self.push_params(params, request_id, blocks, num_tokens)
    }

    /// P, push mode, for engines whose workers run a step's forward pass after the scheduler
    /// side planned it (vLLM): the step about to run computes the rest of the prompt, every
    /// layer of it. The handoff starts as if every layer were saved; the writes planned now
    /// carry their layer ([`crate::worker_protocol::PushLayer`]) and the worker holds each until the
    /// forward saved that layer, and the push digest until the forward ended.
    pub(crate) fn on_push_forward(
        &mut self,
        params: &KvTransferParams,
        blocks: Vec<u32>,
        num_tokens: u32,
        now: Time,
    ) -> Result<HandoffId, CoreError> {
        let handoff = self.on_push_prefill_start(params, blocks, num_tokens, now)?;
        if let Some(st) = self.transfers.push_mut(handoff) {
            st.held_for_forward = true;
        }
        let last = self.spec.shape.num_layers.saturating_sub(1);
        self.on_layer_saved(handoff, last, now);
        Ok(handoff)
    }

    /// P, push mode: the parameters for the response once the prefill ended.
    pub(crate) fn push_params(
        &self,
        params: &KvTransferParams,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> Result<KvTransferParams, CoreError> {
        let handoff = push_handoff(params)?;
        Ok(self.params_under_proxy_id(handoff, TransferMode::Push, request_id, blocks, num_tokens))
    }

    /// The response's parameters for a handoff under the proxy's id, created at the prefill's
    /// start (push, layer-wise pull): its first epoch, the lease it started with.
    pub(super) fn params_under_proxy_id(
        &self,
        handoff: HandoffId,
        mode: TransferMode,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
    ) -> KvTransferParams {
        self.params_for(
            handoff,
            Epoch::FIRST,
            request_id,
            blocks,
            num_tokens,
            self.cfg.producer.initial_lease.as_millis() as u32,
            mode,
        )
    }

    /// The proxy says D never got the request: P releases unless a D already claimed the
    /// handoff, in which case only the lease ends and the fence protects a read in flight.
    pub(crate) fn release_from_proxy(
        &mut self,
        params: &KvTransferParams,
        now: Time,
    ) -> Result<(), CoreError> {
        let handoff = params
            .handoff_id
            .ok_or(CoreError::BadParams("no handoff_id"))?;
        let p = self
            .producer
            .as_mut()
            .ok_or(CoreError::WrongRole("prefill for remote decode"))?;
        p.release_unclaimed(
            handoff_proto::Release {
                handoff,
                epoch: params.epoch.map_or(Epoch::FIRST, Epoch),
                reason: ReleaseReason::Aborted,
            },
            now,
        );
        self.pump(now);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn params_for(
        &self,
        handoff: HandoffId,
        epoch: Epoch,
        request_id: &str,
        blocks: Vec<u32>,
        num_tokens: u32,
        lease_ms: u32,
        mode: TransferMode,
    ) -> KvTransferParams {
        KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_engine_id: Some(self.cfg.engine_id.clone()),
            remote_request_id: Some(request_id.to_string()),
            remote_block_ids: Some(vec![blocks]),
            remote_host: Some(self.cfg.advertise_host.clone()),
            remote_port: Some(self.cfg.side_channel_port),
            tp_size: Some(self.spec.tp as u16),
            remote_num_tokens: Some(num_tokens),
            remote_block_size: Some(self.spec.block_size),
            transfer_mode: Some(mode),
            handoff_id: Some(handoff),
            lease_ms: Some(lease_ms),
            epoch: Some(epoch.0),
            layerwise: None,
            extra: Default::default(),
        }
    }
}
