//! Short timings for schedule simulations (feature `testing`): leases, grants and deadlines short
//! enough that partitions, slow reads and dead peers outlast them within one simulated run: the
//! connector core's simulation (`crates/core/tests/core_sim.rs`) and the ledgers' property
//! tests run on these.

use std::time::Duration;

use crate::{ConsumerConfig, FailurePolicy, ProducerConfig};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// P's and D's configurations for a simulation with `p_tp` and `d_tp` ranks.
pub fn simulation_configs(p_tp: u16, d_tp: u16) -> (ProducerConfig, ConsumerConfig) {
    let p = ProducerConfig {
        tp: p_tp,
        initial_lease: ms(3000),
        heartbeat_extension: ms(1200),
        fence_grace: ms(900),
        hard_cap: ms(20_000),
        write_margin: ms(100),
        // The simulated writes take no time for their bytes: the margin alone.
        write_floor_rate: 0,
        write_timeout: ms(200),
        heartbeat_interval: ms(250),
        staging_capacity: 64,
        staging_per_handoff: 8,
        // Small, so that the per-peer quota is reached in generated schedules.
        staging_per_peer: 32,
        staging_ttl: ms(5000),
        tombstone_capacity: 1000,
        tombstone_ttl: ms(30_000),
    };
    let d = ConsumerConfig {
        tp: d_tp,
        heartbeat_interval: ms(250),
        read_margin: ms(100),
        read_timeout: ms(1500),
        // The simulated reads take no time for their bytes: the timeout alone.
        read_floor_rate: 0,
        block_bytes: 0,
        read_grace: ms(400),
        read_fence: ms(4000),
        read_retries: 1,
        wait_deadline: ms(12_000),
        failure_policy: FailurePolicy::Recompute,
        registration_lease: ms(800),
        push_deadline: ms(6000),
        write_grace: ms(600),
        tombstone_capacity: 1000,
        tombstone_ttl: ms(30_000),
    };
    (p, d)
}
