//! What the workspace's simulations, property tests, conformance suite and benchmarks share
//! (feature `testing`; not API). It lives in this crate because every other crate of the
//! workspace depends on it, so one copy serves them all.

use crate::{BlockLayout, GroupKind, KvGroup, KvGroups, KvSpec, ModelShape};

/// A small deterministic generator (xorshift64*): a schedule, a descriptor list or a shuffle
/// must replay from its seed, with no dependency on a random-number crate's version. A seed of 0
/// stays 0: callers seed with anything else.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// True `pct` times in a hundred.
    pub fn pct(&mut self, pct: u8) -> bool {
        self.below(100) < u64::from(pct)
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }

    /// `0..n` in a random order (Fisher–Yates).
    pub fn shuffled(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            p.swap(i, self.below(i as u64 + 1) as usize);
        }
        p
    }
}

/// The smallest useful engine: `num_layers` layers of two KV heads of 8 fp16 values, one rank,
/// 16-token head-major blocks (a block of one layer is 2 × 2 × 16 × 8 × 2 = 1 KiB).
pub fn tiny_spec(num_layers: u32) -> KvSpec {
    KvSpec {
        shape: ModelShape {
            num_layers,
            num_kv_heads: 2,
            head_dim: 8,
            dtype_size: 2,
        },
        tp: 1,
        block_size: 16,
        block_layout: BlockLayout::HeadMajor,
    }
}

/// A hybrid model of `num_layers` layers: `full` keep every token, the rest a sliding window of
/// `window` tokens (group 0 full, group 1 the window, as vLLM orders Gemma 3's).
pub fn hybrid_groups(full: &[u32], window: u32, num_layers: u32) -> KvGroups {
    full_and(full, GroupKind::Sliding { window }, num_layers)
}

/// A hybrid SSM model's groups (Granite 4's shape): the layers in `full` full attention, every
/// other one of `num_layers` a recurrent state.
pub fn state_groups(full: &[u32], num_layers: u32) -> KvGroups {
    full_and(full, GroupKind::State, num_layers)
}

/// Group 0 the layers in `full`, group 1 the others, keeping `other`.
fn full_and(full: &[u32], other: GroupKind, num_layers: u32) -> KvGroups {
    KvGroups::new(
        vec![
            KvGroup {
                kind: GroupKind::Full,
                layers: full.to_vec(),
            },
            KvGroup {
                kind: other,
                layers: (0..num_layers).filter(|l| !full.contains(l)).collect(),
            },
        ],
        num_layers,
    )
    .expect("a full group and another of every layer")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_and_different_seeds_differ() {
        let draw = |seed| {
            let mut r = Rng(seed);
            (0..8).map(|_| r.next_u64()).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        let mut r = Rng(3);
        assert!((0..1000).all(|_| r.below(10) < 10));
        assert_eq!(r.below(0), 0);
        let mut s = r.shuffled(50);
        s.sort_unstable();
        assert_eq!(s, (0..50).collect::<Vec<_>>());
    }

    #[test]
    fn the_tiny_spec_is_valid() {
        assert!(tiny_spec(2).validate().is_ok());
    }
}
