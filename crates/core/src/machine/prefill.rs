//! P's engine events (the inputs `PrefillStarted`, `LayersSaved`, `PrefillEnded`) and the
//! proxy's `ReleaseFromProxy`. The engine says what happened to a prompt; the flow is decided
//! here, once, from the request's params and this engine's config: a pull creates its handoff
//! when the prefill ends, a layer-wise pull holds the blocks from its start and lets D read
//! each saved layer, a push starts its handoff at once and writes each saved layer into D's
//! blocks. Every moment ends in the producer ledger, and in the `kv_transfer_params` P answers
//! with.

use super::*;
use crate::flow::{LayerReports, PrefillOutcome};
use handoff_proto::Flow;

/// A prefill between its [`Input::PrefillStarted`] and its [`Input::PrefillEnded`].
#[derive(Debug, Clone)]
pub(super) struct Prefill {
    flow: Flow,
    /// The handoff under which its blocks are (or, in a pull, will be) held.
    handoff: HandoffId,
    params: KvTransferParams,
    blocks: Vec<u32>,
    num_tokens: u32,
    /// A handoff holds the blocks since the start (push; layer-wise pull without the digest).
    held: bool,
}

impl ConnectorCore {
    /// Which flow `params` ask of this engine: a layer-wise pull only where the config takes
    /// them (the router learnt it from this engine's info; a request asking anyway is refused,
    /// since its D waits for layers this engine would never announce).
    fn flow_of(&self, params: &KvTransferParams) -> Result<Flow, CoreError> {
        if !params.do_remote_decode {
            return Err(CoreError::BadParams(
                "a prefill for remote decode needs do_remote_decode",
            ));
        }
        match params.flow() {
            Flow::LayerwisePull if !self.cfg.layerwise_pull => Err(CoreError::BadParams(
                "this engine does not serve layer-wise pulls",
            )),
            flow => Ok(flow),
        }
    }

    /// [`Input::PrefillStarted`]. Returns the handoff holding `blocks` from now on, if any.
    pub(crate) fn on_prefill_started(
        &mut self,
        request_id: String,
        params: &KvTransferParams,
        handoff: HandoffId,
        blocks: Vec<u32>,
        num_tokens: u32,
        now: Time,
    ) -> Result<Option<HandoffId>, CoreError> {
        if self.producer.is_none() {
            return Err(CoreError::WrongRole("prefill for remote decode"));
        }
        if self.prefills.contains_key(&request_id) {
            return Err(CoreError::PrefillStartedTwice(request_id));
        }
        let flow = self.flow_of(params)?;
        let (handoff, held) = match flow {
            Flow::Pull => (handoff, false),
            Flow::Push => {
                let h = self.on_push_prefill_start(params, blocks.clone(), num_tokens, now)?;
                if self.cfg.layer_reports == LayerReports::Planned {
                    if let Some(st) = self.transfers.push_mut(h) {
                        st.held_for_forward = true;
                    }
                }
                (h, true)
            }
            Flow::LayerwisePull => {
                let held = self.on_pull_prefill_start(params, blocks.clone(), now)?;
                (layerwise_handoff(params)?, held.is_some())
            }
        };
        self.prefills.insert(
            request_id,
            Prefill {
                flow,
                handoff,
                params: params.clone(),
                blocks,
                num_tokens,
                held,
            },
        );
        Ok(held.then_some(handoff))
    }

    /// [`Input::LayersSaved`]: push, the layers leave for D as soon as its grant allows;
    /// layer-wise pull, D may read them; pull, nothing until the end. An unknown request is
    /// ignored (its start was refused, and the engine was told).
    pub(crate) fn on_layers_saved(&mut self, request_id: &str, through: u32, now: Time) {
        let Some(pf) = self.prefills.get(request_id) else {
            return;
        };
        // A pull holds nothing until its end (nor a layer-wise pull under the digest).
        if !pf.held || through == 0 {
            return;
        }
        let handoff = pf.handoff;
        self.on_layer_saved(handoff, through - 1, now);
    }

    /// [`Input::PrefillEnded`]: the response's params (when it finished), and the handoff that
    /// holds the blocks. The prefill is forgotten even when this fails (the engine keeps its
    /// blocks then).
    pub(crate) fn on_prefill_ended(
        &mut self,
        request_id: &str,
        outcome: PrefillOutcome,
        now: Time,
    ) -> Result<(Option<KvTransferParams>, Option<HandoffId>), CoreError> {
        let pf = self
            .prefills
            .remove(request_id)
            .ok_or_else(|| CoreError::UnknownPrefill(request_id.to_string()))?;
        let Prefill {
            flow,
            handoff,
            params,
            blocks,
            num_tokens,
            held,
        } = pf;
        let finished = outcome != PrefillOutcome::Failed;
        let respond = outcome == PrefillOutcome::Finished;
        Ok(match flow {
            Flow::Pull if respond => {
                let out = self.on_prefill_finished(request_id, handoff, blocks, num_tokens, now)?;
                (Some(out), Some(handoff))
            }
            // Nobody will ever see the params: no D will read or release the handoff.
            Flow::Pull => (None, None),
            Flow::LayerwisePull if finished => {
                // D got its leg with P's: it reads the KV whether or not P's client waits.
                let out =
                    self.on_pull_prefill_finished(&params, request_id, blocks, num_tokens, now)?;
                (respond.then_some(out), Some(handoff))
            }
            Flow::LayerwisePull => {
                // Ends at once when no D learnt of its blocks, else after the fence.
                if held {
                    self.on_pull_prefill_failed(handoff, now);
                }
                (None, held.then_some(handoff))
            }
            Flow::Push => {
                if finished {
                    let last = self.spec.shape.num_layers.saturating_sub(1);
                    self.on_layer_saved(handoff, last, now);
                }
                // From now on the handoff's end gives the blocks back.
                if let Some(p) = self.producer.as_mut() {
                    p.prefill_ended(handoff, finished, now);
                }
                self.pump(now);
                // A failed push keeps its blocks until the handoff ends (D gives up by its
                // push deadline, the lease runs out): a WRITE may be reading them.
                let out = self.params_under_proxy_id(
                    handoff,
                    TransferMode::Push,
                    request_id,
                    blocks,
                    num_tokens,
                );
                (respond.then_some(out), Some(handoff))
            }
        })
    }

    /// A prompt's prefill ended and `blocks` hold its KV: create the handoff (one, whatever n
    /// is) under `handoff` (128 random bits from the caller) and return the
    /// `kv_transfer_params` for the response. The blocks stay out of the pool until a
    /// [`ConnectorEvent::BlocksReleased`] names them.
    fn on_prefill_finished(
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
    /// starts now. D's registration may already be waiting (staged) or come later. The blocks
    /// stay the handoff's at least until the prefill ended.
    fn on_push_prefill_start(
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
        p.create_filling_handoff(handoff, blocks.clone(), TransferMode::Push, now)?;
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
    fn on_layer_saved(&mut self, handoff: HandoffId, layer: u32, now: Time) {
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
    fn on_pull_prefill_start(
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
        p.create_filling_handoff(handoff, blocks, TransferMode::Pull, now)?;
        // A query staged before the handoff existed may come from a D that died since.
        self.redeclare_dead(now);
        self.pump(now);
        Ok(Some(handoff))
    }

    /// P, layer-wise pull: the prefill ended and every layer is saved. Returns the parameters
    /// for the response (the handoff's blocks, for the record: D has them from P already).
    fn on_pull_prefill_finished(
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
    fn on_pull_prefill_failed(&mut self, handoff: HandoffId, now: Time) {
        if let Some(p) = self.producer.as_mut() {
            p.prefill_ended(handoff, false, now);
        }
        self.pump(now);
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
