//! D's scheduler hooks (the inputs `RequestArrived`, `BlocksAllocated`, `RequestEnded`,
//! `Reject`): what D learns of a handoff from `kv_transfer_params`, checked before anything is
//! dialled, and handed to the consumer ledger.

use super::*;

impl ConnectorCore {
    /// A request naming a remote prefill arrived (before admission): start tracking it and
    /// heartbeating its P at once.
    pub(crate) fn on_request_arrived(
        &mut self,
        request: u64,
        params: &KvTransferParams,
        prompt_tokens: u32,
        now: Time,
    ) -> Result<(), CoreError> {
        if self.consumer.is_none() {
            return Err(CoreError::WrongRole("decode remote prefills"));
        }
        let mut inc = self.incoming(params, now)?;
        if inc.num_tokens == 0 {
            inc.num_tokens = prompt_tokens;
        }
        self.consumer
            .as_mut()
            .ok_or(CoreError::WrongRole("decode remote prefills"))?
            .on_request_arrived(RequestId(request), inc, now)?;
        self.pump(now);
        Ok(())
    }

    /// The request was admitted (pull) or reserved (push) and `blocks` allocated for its
    /// prompt's KV.
    #[cfg(test)]
    pub(crate) fn on_blocks_allocated(
        &mut self,
        request: u64,
        blocks: Vec<u32>,
        now: Time,
    ) -> Result<(), CoreError> {
        self.on_blocks_allocated_after_cached(request, Vec::new(), blocks, now)
    }

    /// [`ConnectorCore::on_blocks_allocated`], on an engine with a prefix cache (vLLM): the
    /// prompt's first blocks, `cached`, already hold its KV and may be shared with other
    /// requests; `blocks` are the request's own for the rest. A pull and a push fill only
    /// `blocks` (a push registers them with `PushRegister::cached_blocks`, so P writes from the
    /// first token after the hit).
    pub(crate) fn on_blocks_allocated_after_cached(
        &mut self,
        request: u64,
        cached: Vec<u32>,
        blocks: Vec<u32>,
        now: Time,
    ) -> Result<(), CoreError> {
        let c = self
            .consumer
            .as_mut()
            .ok_or(CoreError::WrongRole("decode remote prefills"))?;
        let handoff = c
            .handoff_of(RequestId(request))
            .ok_or(CoreError::UnknownRequest(request))?;
        let cached_tokens = cached.len() as u32 * self.spec.block_size;
        c.on_blocks_allocated_after_cached(handoff, cached, blocks.clone(), now)?;
        if let Some(inc) = c.incoming(handoff) {
            if inc.mode == TransferMode::Push && !self.cfg.opaque_blocks && self.groups.is_single()
            {
                // P writes whole blocks: each worker zeroes the last block's tail as the
                // PushDones arrive, before the core hears of them (see the op). A hybrid
                // model's writes stop at the prompt's last token (runs.rs).
                let num_tokens = inc.num_tokens.saturating_sub(cached_tokens);
                self.push_tails.insert(handoff);
                for rank in 0..self.spec.tp as u16 {
                    self.out.worker_ops.push((
                        rank,
                        WorkerOp::ZeroTailOnPushDone {
                            handoff,
                            blocks: blocks.clone(),
                            num_tokens,
                        },
                    ));
                }
            }
        }
        self.pump(now);
        Ok(())
    }

    /// The client went away or D refused the request after tracking it: P is told at once when
    /// no transfer is in flight.
    pub(crate) fn on_request_ended(&mut self, request: u64, reason: ReleaseReason, now: Time) {
        if let Some(c) = self.consumer.as_mut() {
            c.on_request_ended(RequestId(request), reason, now);
        }
        self.pump(now);
    }

    /// D refuses a request it never tracked (bad prompt, full queue). P is told to release,
    /// through the ledger: not when this engine is itself still tracking that handoff for
    /// another request (a retried request that hit a full queue while the first one reads),
    /// which would make P free blocks under a read in flight (rule 2).
    pub(crate) fn reject(&mut self, params: &KvTransferParams, now: Time) -> Result<(), CoreError> {
        if self.consumer.is_none() {
            return Err(CoreError::WrongRole("decode remote prefills"));
        }
        // Only who P is and which handoff: the rest of the params may be what D refused.
        let (Some(engine), Some(host), Some(port), Some(handoff)) = (
            params.remote_engine_id.as_deref(),
            params.remote_host.as_deref(),
            params.remote_port,
            params.handoff_id,
        ) else {
            return Err(CoreError::BadParams("cannot name the P to release"));
        };
        self.check_peer_host(host)?;
        let peer = self.peer_named(engine);
        self.dial_if_needed(peer, dial_addr(host, port), now);
        let inc = IncomingHandoff {
            handoff,
            epoch: params.epoch.map_or(Epoch::FIRST, Epoch),
            peer,
            p_tp: params.tp_size.unwrap_or(1),
            mode: params.mode(),
            p_blocks: Vec::new(),
            num_tokens: 0,
        };
        #[cfg(feature = "testing")]
        if self.bug == Some(crate::KnownBug::RejectWithoutLedger) {
            self.send(
                peer,
                Message::Release(handoff_proto::Release {
                    handoff,
                    epoch: inc.epoch,
                    reason: ReleaseReason::Rejected,
                }),
            );
            self.pump(now);
            return Ok(());
        }
        let told = self
            .consumer
            .as_mut()
            .ok_or(CoreError::WrongRole("decode remote prefills"))?
            .refuse(&inc, ReleaseReason::Rejected, now);
        if !told {
            self.out
                .observations
                .push(Observation::RejectOfTrackedHandoff);
        }
        self.pump(now);
        Ok(())
    }

    /// What D learns of a handoff from `kv_transfer_params`; dials its P if needed.
    pub(super) fn incoming(
        &mut self,
        params: &KvTransferParams,
        now: Time,
    ) -> Result<IncomingHandoff, CoreError> {
        params.validate_remote_prefill()?;
        let (Some(engine), Some(host), Some(port), Some(handoff)) = (
            params.remote_engine_id.as_deref(),
            params.remote_host.as_deref(),
            params.remote_port,
            params.handoff_id,
        ) else {
            return Err(CoreError::BadParams("incomplete remote prefill"));
        };
        if params.mode() != self.cfg.mode {
            return Err(CoreError::ModeMismatch {
                params: params.mode(),
                engine: self.cfg.mode,
            });
        }
        self.check_peer_host(host)?;
        let peer = self.peer_named(engine);
        self.dial_if_needed(peer, dial_addr(host, port), now);
        Ok(IncomingHandoff {
            handoff,
            epoch: params.epoch.map_or(Epoch::FIRST, Epoch),
            peer,
            p_tp: params.tp_size.unwrap_or(1),
            mode: params.mode(),
            p_blocks: params.block_ids().map(<[u32]>::to_vec).unwrap_or_default(),
            num_tokens: params.remote_num_tokens.unwrap_or(0),
        })
    }

    /// `host` is one D may dial ([`CoreConfig::peer_hosts`]).
    pub(super) fn check_peer_host(&self, host: &str) -> Result<(), CoreError> {
        let hosts = &self.cfg.peer_hosts;
        if hosts.is_empty() || hosts.iter().any(|h| h == host) {
            Ok(())
        } else {
            Err(CoreError::PeerHostNotAllowed(
                host.chars().take(256).collect(),
            ))
        }
    }
}
