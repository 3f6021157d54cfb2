//! Which D rank exchanges KV with which P rank, and how many readers each P rank has. The
//! planner (crate `handoff-plan`) does the byte arithmetic; the ledgers only need to know who
//! must confirm a transfer before a handoff is complete.

/// The (D rank, P rank) pairs that move KV when P runs with `p_tp` ranks and D with `d_tp`.
/// Sizes must divide each other (checked at handshake); with sizes that do not, pairs are still
/// produced (every D rank pairs with P rank `d * p_tp / d_tp`) so nothing here can panic.
pub fn pairs(p_tp: u16, d_tp: u16) -> Vec<(u16, u16)> {
    let (p, d) = (p_tp.max(1), d_tp.max(1));
    let mut out = Vec::new();
    if p > d && p % d == 0 {
        let k = p / d;
        for dr in 0..d {
            for i in 0..k {
                out.push((dr, dr * k + i));
            }
        }
    } else {
        for dr in 0..d {
            out.push((dr, ((dr as u32 * p as u32) / d as u32) as u16));
        }
    }
    out
}

/// How many D ranks read P rank `p_rank` (D tp > P tp: several D ranks read slices of one P rank).
pub fn consumers(p_tp: u16, d_tp: u16, p_rank: u16) -> u16 {
    pairs(p_tp, d_tp)
        .iter()
        .filter(|(_, pr)| *pr == p_rank)
        .count() as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_tp_pairs_rank_to_rank() {
        assert_eq!(pairs(2, 2), vec![(0, 0), (1, 1)]);
        assert_eq!(consumers(2, 2, 1), 1);
    }

    #[test]
    fn d_tp_four_p_tp_two_needs_two_consumers_per_p_rank() {
        assert_eq!(pairs(2, 4), vec![(0, 0), (1, 0), (2, 1), (3, 1)]);
        assert_eq!(consumers(2, 4, 0), 2);
        assert_eq!(consumers(2, 4, 1), 2);
    }

    #[test]
    fn p_tp_four_d_tp_two_reads_two_p_ranks_per_d_rank() {
        assert_eq!(pairs(4, 2), vec![(0, 0), (0, 1), (1, 2), (1, 3)]);
        assert!((0..4).all(|r| consumers(4, 2, r) == 1));
    }
}
