//! Sliding-window layer groups: which of a request's blocks a handoff still has to move.
//!
//! A layer with a sliding window of `w` tokens (Gemma 3's local layers, gpt-oss's) attends, when
//! it computes token `t`, to tokens `t - w + 1 ..= t` only. After a prefill of `n` tokens the
//! first token D computes is token `n`, so of the prompt's KV in such a layer D needs tokens
//! `max(0, n - w + 1) .. n` and nothing before them. vLLM's hybrid KV cache manager frees the
//! blocks that lie wholly before that point and puts its null block in their place, so P's block
//! list for such a group starts with null blocks, and moving them would read (or write) nothing
//! anyone needs; a full-attention group needs every block.
//!
//! This module answers the question for one group and checks a peer's list against it: the
//! blocks a handoff moves for a window are the tail of the list from the block that holds the
//! first needed token, at most `ceil(w / block_size) + 1` of them, and none of them may be the
//! null block (a P that freed KV D still needs has nothing to send for it).

use std::ops::Range;

/// Why a block list cannot serve a sliding-window group.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WindowError {
    /// A window or block size of zero tokens.
    #[error("a sliding window needs a window and a block size of at least one token")]
    Empty,
    /// The list is shorter than the prompt's blocks.
    #[error(
        "{num_tokens} tokens in blocks of {block_size} need {need} blocks, the list has {have}"
    )]
    TooShort {
        /// Tokens of the prompt.
        num_tokens: u32,
        /// Tokens per block.
        block_size: u32,
        /// Blocks the prompt fills.
        need: u32,
        /// Blocks in the list.
        have: u32,
    },
    /// A block the window still needs is the null block: its KV was freed.
    #[error("block {index} of the list is inside the window but is the null block")]
    NullInWindow {
        /// Its index in the list.
        index: u32,
    },
}

/// The blocks (indices into the request's block list) that hold the KV a layer with a sliding
/// window of `window` tokens still needs after a prefill of `num_tokens` tokens, with
/// `block_size` tokens per block: from the block of token `max(0, num_tokens - window + 1)` to
/// the last block the prompt fills. Empty for an empty prompt.
pub fn window_blocks(
    num_tokens: u32,
    block_size: u32,
    window: u32,
) -> Result<Range<u32>, WindowError> {
    if block_size == 0 || window == 0 {
        return Err(WindowError::Empty);
    }
    let end = num_tokens.div_ceil(block_size);
    let first_needed = num_tokens.saturating_sub(window - 1);
    if first_needed >= num_tokens {
        // A window of one token: D's next token attends to itself alone.
        return Ok(end..end);
    }
    Ok(first_needed / block_size..end)
}

/// The part of `blocks` (a request's block ids for one sliding-window group, `null` wherever the
/// engine freed a block) that a handoff moves, with its first index in `blocks`. The list must
/// cover the prompt; blocks past the prompt's last (room for tokens to come) are not moved.
pub fn window_tail(
    blocks: &[u32],
    num_tokens: u32,
    block_size: u32,
    window: u32,
    null: Option<u32>,
) -> Result<(u32, &[u32]), WindowError> {
    let range = window_blocks(num_tokens, block_size, window)?;
    let have = u32::try_from(blocks.len()).unwrap_or(u32::MAX);
    if have < range.end {
        return Err(WindowError::TooShort {
            num_tokens,
            block_size,
            need: range.end,
            have,
        });
    }
    let tail = &blocks[range.start as usize..range.end as usize];
    if let Some(null) = null {
        if let Some(i) = tail.iter().position(|&b| b == null) {
            return Err(WindowError::NullInWindow {
                index: range.start + i as u32,
            });
        }
    }
    Ok((range.start, tail))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `range` holds every token a window of `window` still needs after `num_tokens` tokens, and
    /// no block wholly outside it: the check the property below runs, kept apart so its power
    /// can be shown.
    fn covers_exactly(
        range: &Range<u32>,
        num_tokens: u32,
        block_size: u32,
        window: u32,
    ) -> Result<(), String> {
        let needed = num_tokens.saturating_sub(window - 1)..num_tokens;
        for t in needed.clone() {
            if !range.contains(&(t / block_size)) {
                return Err(format!("token {t} (block {}) left out", t / block_size));
            }
        }
        for b in range.clone() {
            let tokens = b * block_size..(b + 1) * block_size;
            if !tokens.clone().any(|t| needed.contains(&t)) {
                return Err(format!("block {b} holds no needed token"));
            }
        }
        Ok(())
    }

    #[test]
    fn the_window_blocks_are_exactly_those_holding_a_needed_token() {
        for block_size in [1, 2, 3, 16] {
            for window in 1..70 {
                for num_tokens in 0..200 {
                    let r = window_blocks(num_tokens, block_size, window).unwrap();
                    covers_exactly(&r, num_tokens, block_size, window).unwrap_or_else(|e| {
                        panic!("n={num_tokens} bs={block_size} w={window}: {e}")
                    });
                    assert!(r.len() as u32 <= window.div_ceil(block_size) + 1);
                }
            }
        }
    }

    #[test]
    fn the_check_finds_a_window_one_token_off_either_way() {
        // Gemma 3's window of 512 in blocks of 16, a prompt of 1,500 tokens: tokens 989..1500
        // are needed, blocks 61..94.
        let r = window_blocks(1500, 16, 512).unwrap();
        assert_eq!(r, 61..94);
        assert!(covers_exactly(&r, 1500, 16, 512).is_ok());
        // At a block boundary (the first needed token, 976, opens block 61; a window counted
        // one token too wide would start in block 60), a range one block wider or narrower at
        // either end fails the check.
        let edge = 976 + 511;
        let r = window_blocks(edge, 16, 512).unwrap();
        assert!(covers_exactly(&r, edge, 16, 512).is_ok());
        assert!(covers_exactly(&(r.start + 1..r.end), edge, 16, 512).is_err());
        assert!(covers_exactly(&(r.start.saturating_sub(1)..r.end), edge, 16, 512).is_err());
        assert!(covers_exactly(&(r.start..r.end - 1), edge, 16, 512).is_err());
    }

    #[test]
    fn a_window_longer_than_the_prompt_needs_every_block() {
        assert_eq!(window_blocks(300, 16, 512).unwrap(), 0..19);
        assert_eq!(window_blocks(0, 16, 512).unwrap(), 0..0);
        // A window of one token needs no cached token, not even the last block's.
        assert_eq!(window_blocks(40, 16, 1).unwrap(), 3..3);
        assert_eq!(window_blocks(10, 0, 512), Err(WindowError::Empty));
        assert_eq!(window_blocks(10, 16, 0), Err(WindowError::Empty));
    }

    #[test]
    fn a_peers_list_is_checked_before_its_tail_is_moved() {
        // 40 tokens in blocks of 4 with a window of 9: tokens 32..40, blocks 8 and 9.
        let mut blocks: Vec<u32> = (100..112).collect();
        for b in &mut blocks[..8] {
            *b = 0;
        }
        assert_eq!(
            window_tail(&blocks, 40, 4, 9, Some(0)),
            Ok((8, &blocks[8..10]))
        );
        // Without a null block to look for, the same tail.
        assert_eq!(
            window_tail(&blocks, 40, 4, 9, None),
            Ok((8, &blocks[8..10]))
        );
        // A wider window reaches a freed block: refused, not moved as if it held KV.
        assert_eq!(
            window_tail(&blocks, 40, 4, 12, Some(0)),
            Err(WindowError::NullInWindow { index: 7 })
        );
        // A list that does not cover the prompt.
        assert_eq!(
            window_tail(&blocks[..9], 40, 4, 9, Some(0)),
            Err(WindowError::TooShort {
                num_tokens: 40,
                block_size: 4,
                need: 10,
                have: 9
            })
        );
    }
}
