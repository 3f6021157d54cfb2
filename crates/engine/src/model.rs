//! The deterministic synthetic model of the reference engine.
//!
//! - Tokens: the prompt's whitespace-separated words, each hashed to an id in `0..VOCAB`.
//! - KV: the bytes of token position `i`, layer `l`, plane `kv` (K or V) and head `h` are a
//!   pseudo-random function of the prefix hash up to `i` (so they depend on every earlier token),
//!   `l`, `kv` and `h`.
//! - Next token: a hash of the KV the decode step *reads back from its blocks* (all of the
//!   prompt's on the first step, then each new token's), so a single wrong or missing KV byte
//!   changes the output: "disaggregated output == monolithic output" is a real end-to-end check.

/// Size of the vocabulary.
pub const VOCAB: u32 = 32_000;

const WORDS: [&str; 64] = [
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be",
    "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have",
    "an", "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "kv", "cache", "block",
    "lease", "grant", "epoch", "prefill", "decode", "handoff", "token", "layer", "head", "rank",
    "pool", "fence",
];

pub fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

pub fn tokenize(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .map(|w| {
            let mut h = 0xcbf2_9ce4_8422_2325u64;
            for b in w.bytes() {
                h ^= b as u64;
                h = h.wrapping_mul(0x100_0000_01b3);
            }
            (mix(h) % VOCAB as u64) as u32
        })
        .collect()
}

/// The text of one generated token (a leading space, as BPE tokenizers do).
pub fn detokenize(token: u32) -> String {
    format!(" {}{}", WORDS[(token % 64) as usize], token / 64 % 10)
}

/// Prefix hashes: `p[i]` depends on tokens `0..=i`.
pub fn prefix_hashes(tokens: &[u32], seed: u64) -> Vec<u64> {
    let mut h = mix(seed ^ 0x51ed);
    tokens
        .iter()
        .map(|t| {
            h = mix(h ^ (*t as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            h
        })
        .collect()
}

/// Fills `out` (one head's row: head_dim × dtype bytes) for (prefix hash, layer, plane, head).
/// One strong mix per row, then xorshift: cheap enough that the synthetic forward pass keeps up
/// with the cost model at a real model's KV size.
pub fn kv_row(prefix: u64, layer: u32, kv: u32, head: u32, out: &mut [u8]) {
    let mut s =
        mix(prefix ^ ((layer as u64) << 40) ^ ((kv as u64) << 36) ^ ((head as u64) << 20)) | 1;
    for chunk in out.chunks_mut(8) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let b = s.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// Folds bytes into a running digest (order matters).
pub fn fold(digest: u64, bytes: &[u8]) -> u64 {
    let mut h = digest;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        h = (h ^ u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).wrapping_mul(0x100_0000_01b3);
        h = h.rotate_left(29);
    }
    for b in chunks.remainder() {
        h = (h ^ *b as u64).wrapping_mul(0x100_0000_01b3);
    }
    mix(h)
}

/// The token sampled from a KV digest for choice `choice` (n>1 siblings differ by it).
pub fn sample(digest: u64, choice: u32) -> u32 {
    (mix(digest ^ ((choice as u64 + 1) << 48)) % VOCAB as u64) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_depends_on_the_whole_prefix() {
        let a = prefix_hashes(&tokenize("a b c d"), 0);
        let b = prefix_hashes(&tokenize("x b c d"), 0);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        let mut r1 = [0u8; 16];
        let mut r2 = [0u8; 16];
        kv_row(a[3], 0, 0, 0, &mut r1);
        kv_row(a[3], 0, 0, 1, &mut r2);
        assert_ne!(r1, r2);
    }

    #[test]
    fn one_byte_changes_the_token() {
        let mut bytes = vec![7u8; 4096];
        let d1 = fold(1, &bytes);
        bytes[1234] ^= 1;
        assert_ne!(sample(d1, 0), sample(fold(1, &bytes), 0));
    }
}
