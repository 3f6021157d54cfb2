//! The transfer planner of handoff: from the KV layouts of a prefill engine (P) and a decode engine
//! (D) and a request's block lists to coalesced, bounds-checked descriptor lists. Sans-IO: no
//! memory is touched, no clock read; a descriptor list is plain data that a transport executes.
//! In the book (`docs/` in the repository): `docs/src/guides/modes-and-transports.md`.
//!
//! # Byte layout
//!
//! An engine with tensor-parallel size `tp` splits the model's `num_kv_heads` KV heads into `tp`
//! equal, consecutive ranges: rank `r` owns heads `r·hpr .. (r+1)·hpr`, `hpr = num_kv_heads / tp`
//! ([`KvSpec::owned_heads`]). Each rank has a pool of `num_blocks` blocks; a block holds
//! `block_size` tokens of KV for every layer of that rank's heads, and a request's blocks carry the
//! same ids on every rank of the engine.
//!
//! One block of one layer of one rank has two **planes**, K and V, of
//! `hpr × block_size × head_dim × dtype_size` bytes each ([`KvSpec::plane_bytes`]). Inside a
//! plane, with `row = head_dim × dtype_size` bytes (one head's vector for one token):
//!
//! - [`BlockLayout::HeadMajor`] `[head][token][dim]`: (head h, token t) at `(h·block_size + t)·row`.
//!   A head's tokens are contiguous, so any head slice of a block is one range (vLLM's HND).
//! - [`BlockLayout::TokenMajor`] `[token][head][dim]`: (h, t) at `(t·hpr + h)·row` (vLLM's NHD).
//!
//! Where the planes live is per layer ([`LayerPlacement`]): block `b`'s K plane starts at
//! `k.offset + b·block_stride` in region `k.region`, its V plane likewise from `v`. That one rule
//! covers one region per layer with `[K][V]` blocks ([`RankLayout::per_layer`]), vLLM's separate
//! K and V tensors ([`RankLayout::split_kv`]) and one block-outermost region for all layers
//! ([`RankLayout::cross_layer`]), with or without padding between blocks.
//!
//! # Topology
//!
//! TP sizes must divide each other, and the heads must split evenly over each side's ranks or,
//! with more ranks than heads, be replicated evenly on them (each head on `tp / heads`
//! consecutive ranks, as vLLM does) ([`check_compatible`]). A (D rank, P rank) pair moves the
//! heads both own ([`Topology::pairs`]): with equal TP, rank r ↔ rank r, all heads; with P tp >
//! D tp a D rank gathers head slices from `P/D` P ranks; with D tp > P tp, `D/P` D ranks each read
//! their slice of one P rank, which therefore waits for [`Topology::consumers`] notifications. A
//! replicated head is read once per D rank, from the first source holding it; a source whose
//! heads were all read from another only confirms (its pair moves no byte).
//!
//! # Planning
//!
//! Tokens `0..num_tokens` are cut into runs that lie in one P block and one D block (a cut at
//! every P or D block boundary, so block sizes with any power-of-two ratio work, in either
//! direction, and token order is kept). For each pair, layer, plane and run the planner emits
//! the ranges that are contiguous on both sides: one per head for head-major; one for the whole
//! run for token-major when the pair moves all heads of both ranks, else one per token. Then it
//! sorts by source address and merges every descriptor that continues the previous one on both
//! sides, which yields exactly the maximal contiguous runs (see `finish` in the planner for why
//! this is minimal). So with equal TP and block size, a run of consecutive P blocks landing in
//! consecutive D blocks is one descriptor per layer plane (one per run for the whole model with
//! cross-layer regions); heterogeneous TP costs one descriptor per block per plane (head slices
//! are not contiguous across blocks), a block-size ratio one per head per block.
//!
//! Only the first `num_tokens` tokens move: the tail of a partially filled last block is neither
//! read nor written. [`uncovered_dst`] lists the D bytes of that block left as they were, so a
//! caller can zero them.
//!
//! Every descriptor is checked against its region (overflow-checked arithmetic), block ids must be
//! inside the pool and distinct, and planned ranges must not overlap (which catches aliasing
//! layouts); every violation is a [`PlanError`], never a panic.
//!
//! # KV cache groups and sliding windows
//!
//! A hybrid model keeps its layers in groups with block lists of their own ([`KvGroups`]); a
//! sliding-window group needs only the blocks that hold the window's tokens ([`window_blocks`]).
//! A handoff's one block list is each group's moved blocks in group order ([`KvGroups::clip`]),
//! cut back into runs by both sides ([`KvGroups::runs`]) and planned run by run
//! ([`plan_runs`]); groups whose layers share memory must name different blocks, which the
//! planner checks like any other overlap.
//!
//! # Supported and refused
//!
//! Planned: any TP pair where one divides the other and each splits or replicates the heads
//! evenly; block sizes
//! whose ratio is a power of two; head-major on both sides; token-major on both sides (equal TP
//! coalesces as well as head-major; heterogeneous TP is correct but costs a descriptor per token).
//! Refused ([`Incompatible`]): different model shape or dtype size, a TP that neither divides the
//! head count nor is a multiple of it, head-major on one side and token-major on the other (one descriptor per token per head, or a permute after
//! receipt), other block-size ratios.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod groups;
mod layout;
mod planner;
mod topology;
mod window;

pub use groups::{
    plan_runs, BlockRun, GroupError, GroupKind, GroupMismatch, KvGroup, KvGroups, RunPair,
};
pub use layout::{
    check_heads, BlockLayout, KvSpec, LayerPlacement, LayoutError, ModelShape, PlaneLoc,
    PoolLayout, RankLayout, Region, Side, SpecError,
};
pub use planner::{
    block_spans, layer_block_spans, plan, plan_layers, plan_pair, plan_pair_layers, uncovered_dst,
    Descriptor, PairPlan, Plan, PlanError, Span,
};
pub use topology::{
    check_compatible, rank_consumers, rank_pairs, rank_sources, Incompatible, RankPair, Topology,
};
pub use window::{window_blocks, window_tail, WindowError};

/// The workspace's shared test support (feature `testing`; not API).
#[cfg(any(test, feature = "testing"))]
pub mod testing;

#[cfg(test)]
mod tests;
