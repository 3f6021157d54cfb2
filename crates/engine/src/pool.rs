//! The paged KV pool: block ids `0..num_blocks`, each given out once until returned.

use std::collections::{BTreeSet, HashSet};

#[derive(Debug)]
pub struct BlockPool {
    total: u32,
    /// Lowest ids first, so a request's blocks are contiguous whenever the pool allows: one
    /// descriptor moves a whole run.
    free: BTreeSet<u32>,
    used: HashSet<u32>,
    /// Frees of blocks that were not out (a bug somewhere): counted, never applied twice.
    pub double_frees: u64,
}

impl BlockPool {
    pub fn new(total: u32) -> Self {
        BlockPool {
            total,
            free: (0..total).collect(),
            used: HashSet::new(),
            double_frees: 0,
        }
    }

    pub fn total(&self) -> u32 {
        self.total
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn used_count(&self) -> usize {
        self.used.len()
    }

    /// `n` blocks, or `None` (and nothing taken) when fewer are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let out: Vec<u32> = self.free.iter().take(n).copied().collect();
        for b in &out {
            self.free.remove(b);
            self.used.insert(*b);
        }
        Some(out)
    }

    pub fn free(&mut self, blocks: &[u32]) {
        for b in blocks {
            if self.used.remove(b) {
                self.free.insert(*b);
            } else {
                self.double_frees += 1;
                tracing::error!(block = b, "block freed twice or never allocated");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_go_out_once_and_come_back_once() {
        let mut p = BlockPool::new(4);
        let a = p.alloc(3).unwrap();
        assert!(p.alloc(2).is_none());
        assert_eq!(p.free_count(), 1);
        p.free(&a);
        p.free(&a[..1]);
        assert_eq!(p.double_frees, 1);
        assert_eq!(p.free_count(), 4);
    }
}
