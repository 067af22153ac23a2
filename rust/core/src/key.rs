//! Block keys: what identifies a cached block, and the exact bytes that are hashed.
//!
//! A block is identified by everything that decides its KV: the block before it (so a key names
//! a whole prefix, not one block), its exact token ids, and its per-block extra keys (adapter,
//! multimodal items). The first block's parent is the *root*, which folds in the fingerprint of
//! the execution context (model, tokenizer, position encoding, dtype, ...) and an optional
//! per-request salt, so two tenants or two models never share a block.
//!
//! That identity is hashed into two keys, for two audiences:
//! - the **block key** (`BlockKey`, SHA-256 over the layout below) is the same in every process,
//!   machine and version, for anything that leaves the process (events, remote tiers, a router).
//!   SHA-256 is cryptographic, so such keys cannot be forged to collide, and with the SHA
//!   extensions of current x86 and Arm CPUs it is the fastest such hash on inputs this short.
//! - the **table key** (`TableKey`, 128-bit XXH3, seeded at random per cache) indexes the
//!   in-process table and never leaves it, so it needs no cryptographic strength: every hit is
//!   verified against the stored tokens, extras and parent (`table/mod.rs`), so a collision, even a
//!   crafted one, can only cost a miss, and the per-cache seed leaves an attacker nothing to aim
//!   at. It is several times cheaper than SHA-256, and hashing is most of what a lookup costs.
//!
//! The measured cost of both keys, and of the hashes considered instead, is in
//! `benches/RESULTS.md`, regenerated with each benchmark run.
//!
//! ## Byte layout of the block key (version 1), for components that must reproduce it
//! All integers are little-endian u32 unless noted.
//! ```text
//! context_fingerprint = SHA256("prefixkv.context.v1\0" || canonical_context_bytes)
//! root_key            = SHA256("prefixkv.root.v1\0" || context_fingerprint[32]
//!                              || u32(len(salt)) || salt)
//! block_key           = SHA256(0x00 || parent_key[32] || token[0] || ... || token[n-1])
//!                                                                     (a block without extras)
//!                     = SHA256(0x01 || parent_key[32] || u32(len(extras)) || extras
//!                              || token[0] || ... || token[n-1])     (a block with extras)
//! extras              = concatenation, in this order, of
//!                       0x01 || u32(len(adapter)) || adapter          (when an adapter is set)
//!                       0x02 || i64(item_start - block_start) || u64(item_length)
//!                            || u32(len(hash)) || hash
//!                                                  (each multimodal item overlapping the block,
//!                                                   in the order given)
//! ```
//! The block form is kept short on purpose: a 16-token block is 97 bytes, two SHA-256
//! compressions. The leading tag separates the two block forms from each other and from the
//! root form (which starts with `p`); the token count is implied by the input's length, which
//! SHA-256 commits to.
//!
//! The table key chains the same way over the same inputs (the root's table key hashes its
//! block key), but its bytes are private to the process and carry no version:
//! `XXH3-128(parent_table_key[16] || tokens || extras, seed)`. A test-only setting (`key_bits`)
//! keeps only its leading bits, so tests can force collisions and prove they never produce a
//! wrong hit.

use std::fmt;
use std::ops::Range;

use sha2::{Digest, Sha256};

/// Length of a key in bytes.
pub const KEY_BYTES: usize = 32;

const CONTEXT_DOMAIN: &[u8] = b"prefixkv.context.v1\0";
const ROOT_DOMAIN: &[u8] = b"prefixkv.root.v1\0";
const RUN_ROOT_DOMAIN: &[u8] = b"prefixkv.run-root.v1\0";
const RUN_TAG_DOMAIN: &[u8] = b"prefixkv.run-tag.v1\0";
const TAGGED_ROOT_DOMAIN: &[u8] = b"prefixkv.tagged-root.v1\0";
const BLOCK_PLAIN: u8 = 0x00;
const BLOCK_WITH_EXTRAS: u8 = 0x01;

const EXTRA_ADAPTER: u8 = 0x01;
const EXTRA_MULTIMODAL: u8 = 0x02;

/// A 256-bit key naming a block together with its whole prefix.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockKey(pub [u8; KEY_BYTES]);

impl BlockKey {
    /// Lowercase hex, the form keys take in events and logs.
    #[must_use]
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({}…)", &self.to_hex()[..12])
    }
}

/// Fingerprint of a canonical serialization of the execution context.
#[must_use]
pub fn context_fingerprint(canonical_context: &[u8]) -> BlockKey {
    let mut hasher = Sha256::new();
    hasher.update(CONTEXT_DOMAIN);
    hasher.update(canonical_context);
    BlockKey(hasher.finalize().into())
}

/// The parent key of a request's first block: context fingerprint plus optional salt.
#[must_use]
pub fn root_key(context: &BlockKey, salt: &[u8]) -> BlockKey {
    let mut hasher = Sha256::new();
    hasher.update(ROOT_DOMAIN);
    hasher.update(context.0);
    hasher.update(len_u32(salt.len()).to_le_bytes());
    hasher.update(salt);
    BlockKey(hasher.finalize().into())
}

/// Where the run cache (`run_cache`) hangs a request's first blocks: its `root_key`, or with an
/// adapter a key of root and adapter in a domain of its own. The run table matches tokens
/// under a root, so a request-wide extra must part the roots, as it parts every block key of
/// the per-block cache.
#[must_use]
pub fn run_root(root: &BlockKey, adapter: Option<&[u8]>) -> BlockKey {
    let Some(adapter) = adapter else {
        return *root;
    };
    let mut hasher = Sha256::new();
    hasher.update(RUN_ROOT_DOMAIN);
    hasher.update(root.0);
    hasher.update(len_u32(adapter.len()).to_le_bytes());
    hasher.update(adapter);
    BlockKey(hasher.finalize().into())
}

/// The run cache's tag of a block with multimodal items: a SHA-256 key of the items'
/// encoding (`RequestExtras::multimodal_for_block`), so that equal tokens with other items, or
/// none, never match. The adapter is not in it: it parts the roots (`run_root`).
#[must_use]
pub fn run_tag(items: &[u8]) -> BlockKey {
    let mut hasher = Sha256::new();
    hasher.update(RUN_TAG_DOMAIN);
    hasher.update(items);
    BlockKey(hasher.finalize().into())
}

/// Where the run cache hangs a first run whose first block is tagged (`run_tag`): a key of the
/// run root and the tag, in a domain of its own.
#[must_use]
pub fn tagged_root(root: &BlockKey, tag: &BlockKey) -> BlockKey {
    let mut hasher = Sha256::new();
    hasher.update(TAGGED_ROOT_DOMAIN);
    hasher.update(root.0);
    hasher.update(tag.0);
    BlockKey(hasher.finalize().into())
}

/// Key of one block given its parent's key, its tokens and its encoded extras.
#[must_use]
pub fn block_key(parent: &BlockKey, tokens: &[u32], extras: &[u8]) -> BlockKey {
    block_key_with(&mut Vec::new(), parent, tokens, extras)
}

/// `block_key`, reusing `buffer` so hashing a whole prompt allocates once.
pub fn block_key_with(
    buffer: &mut Vec<u8>,
    parent: &BlockKey,
    tokens: &[u32],
    extras: &[u8],
) -> BlockKey {
    // One contiguous buffer hashed in one call: no per-token calls into the hasher.
    buffer.clear();
    if extras.is_empty() {
        buffer.push(BLOCK_PLAIN);
        buffer.extend_from_slice(&parent.0);
    } else {
        buffer.push(BLOCK_WITH_EXTRAS);
        buffer.extend_from_slice(&parent.0);
        buffer.extend_from_slice(&len_u32(extras.len()).to_le_bytes());
        buffer.extend_from_slice(extras);
    }
    push_tokens(buffer, tokens);
    BlockKey(Sha256::digest(&buffer[..]).into())
}

/// Appends tokens as little-endian u32 (one pass the compiler turns into a copy on LE targets).
fn push_tokens(buffer: &mut Vec<u8>, tokens: &[u32]) {
    let start = buffer.len();
    buffer.resize(start + 4 * tokens.len(), 0);
    for (bytes, token) in buffer[start..].chunks_exact_mut(4).zip(tokens) {
        bytes.copy_from_slice(&token.to_le_bytes());
    }
}

/// Key of the in-process table (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct TableKey(pub u128);

impl TableKey {
    /// What a linked entry published without its key holds instead (`table/runs.rs`, on keys
    /// hashed only where the index needs them). Never trusted as a key: whoever needs the key
    /// of such a block hashes its own tokens. A real key equal to it is merely recomputed.
    pub const UNKNOWN: TableKey = TableKey(0);

    /// Whether this is a key, not `UNKNOWN`.
    #[must_use]
    pub fn is_known(self) -> bool {
        self != Self::UNKNOWN
    }
}

/// Computes table keys for one cache: a random seed, and the number of leading bits kept.
#[derive(Clone, Copy, Debug)]
pub struct TableHasher {
    seed: u64,
    bits: u32,
}

impl TableHasher {
    /// Bits of a table key.
    pub const BITS: u32 = 128;

    /// A hasher with a fresh random seed keeping the leading `bits` bits (128 in production).
    #[must_use]
    pub fn new(bits: u32) -> Self {
        use std::hash::BuildHasher;
        // std's RandomState is seeded from the OS once per process and varied per instance.
        let seed =
            std::collections::hash_map::RandomState::new().hash_one(0x7072_6566_6978_6b76_u64);
        Self::with_seed(bits, seed)
    }

    /// A hasher with a chosen seed, so which keys collide is reproducible (tests, model
    /// checking). Production uses `new`.
    #[must_use]
    pub fn with_seed(bits: u32, seed: u64) -> Self {
        Self {
            seed,
            bits: bits.clamp(1, Self::BITS),
        }
    }

    /// Table key of a request's root (context fingerprint and salt).
    #[must_use]
    pub fn root(&self, root: &BlockKey) -> TableKey {
        self.keep(xxhash_rust::xxh3::xxh3_128_with_seed(&root.0, self.seed))
    }

    /// Table key of a block, chained on its parent's table key.
    #[must_use]
    pub fn block(
        &self,
        buffer: &mut Vec<u8>,
        parent: TableKey,
        tokens: &[u32],
        extras: &[u8],
    ) -> TableKey {
        // The usual block (16 tokens, no extras) laid out in a fixed-size array: the same bytes
        // as below, with no resize, no zeroing and no per-token bounds, which cost about as
        // much as the hash itself (~60 of ~230 instructions a block, callgrind).
        if let (Ok(tokens), true) = (<&[u32; 16]>::try_from(tokens), extras.is_empty()) {
            let mut input = [0u8; 16 + 64];
            input[..16].copy_from_slice(&parent.0.to_le_bytes());
            for (bytes, token) in input[16..].chunks_exact_mut(4).zip(tokens) {
                bytes.copy_from_slice(&token.to_le_bytes());
            }
            return self.keep(xxhash_rust::xxh3::xxh3_128_with_seed(&input, self.seed));
        }
        self.block_in(buffer, parent, tokens, extras)
    }

    /// `block` for any block size and extras, laid out in `buffer`.
    fn block_in(
        &self,
        buffer: &mut Vec<u8>,
        parent: TableKey,
        tokens: &[u32],
        extras: &[u8],
    ) -> TableKey {
        buffer.clear();
        buffer.extend_from_slice(&parent.0.to_le_bytes());
        push_tokens(buffer, tokens);
        if !extras.is_empty() {
            // After the tokens, whose count is fixed per cache: the split stays unambiguous.
            buffer.extend_from_slice(extras);
        }
        self.keep(xxhash_rust::xxh3::xxh3_128_with_seed(buffer, self.seed))
    }

    fn keep(&self, key: u128) -> TableKey {
        if self.bits >= Self::BITS {
            TableKey(key)
        } else {
            TableKey(key & !(u128::MAX >> self.bits))
        }
    }
}

fn len_u32(len: usize) -> u32 {
    // Lengths above 4 GiB cannot occur: token blocks are small and salts/adapter names are
    // validated at the boundary. Saturate rather than wrap so a bug can't alias two lengths.
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// A multimodal item (an image, an audio clip) occupying a span of placeholder tokens.
///
/// Its placeholder tokens are identical for every image, so the item's content hash must be part
/// of the key of each block it overlaps, together with where it sits relative to the block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MultimodalItem {
    /// Position of the item's first placeholder token in the prompt.
    pub start: u64,
    /// Number of placeholder tokens.
    pub length: u64,
    /// Content hash of the item (any length; typically 32 bytes).
    pub hash: Vec<u8>,
}

/// Per-request inputs that become per-block extra keys.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestExtras {
    /// Adapter (LoRA) identity; applies to every block of the request.
    pub adapter: Option<Vec<u8>>,
    /// Multimodal items, each applied to the blocks it overlaps.
    pub multimodal: Vec<MultimodalItem>,
}

impl RequestExtras {
    /// True when no block gets any extra key (the common case, kept allocation-free).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.adapter.is_none() && self.multimodal.is_empty()
    }

    /// Encoded extras of the block covering tokens `block_start .. block_end`.
    #[must_use]
    pub fn for_block(&self, block_start: u64, block_end: u64) -> Vec<u8> {
        let mut out = Vec::new();
        if let Some(adapter) = &self.adapter {
            out.push(EXTRA_ADAPTER);
            out.extend_from_slice(&len_u32(adapter.len()).to_le_bytes());
            out.extend_from_slice(adapter);
        }
        self.encode_multimodal(block_start, block_end, &mut out);
        out
    }

    /// The multimodal part of `for_block` alone (empty when no item overlaps the block).
    #[must_use]
    pub fn multimodal_for_block(&self, block_start: u64, block_end: u64) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_multimodal(block_start, block_end, &mut out);
        out
    }

    /// The run cache's tag (`run_tag`) of every block in `blocks` (indices of blocks of
    /// `block_size` tokens) that a multimodal item overlaps, by block index, ascending. The work
    /// is bounded by `blocks` times the items, whatever the items' positions and lengths.
    #[must_use]
    pub fn run_tags(&self, blocks: Range<usize>, block_size: usize) -> Vec<(u32, BlockKey)> {
        if self.multimodal.is_empty() || blocks.is_empty() {
            return Vec::new();
        }
        let bs = block_size as u64;
        let (lo, last) = (blocks.start as u64, blocks.end as u64 - 1);
        let mut tagged: Vec<u32> = Vec::new();
        for item in &self.multimodal {
            // The blocks from the item's first token's to its end's, clamped to `blocks` before
            // they are counted (an item may end near 2^64: no arithmetic here can overflow).
            let first = (item.start / bs).max(lo);
            let end = (item.start.saturating_add(item.length) / bs).min(last);
            if first <= end {
                tagged.extend((first..=end).map(|b| b as u32));
            }
        }
        tagged.sort_unstable();
        tagged.dedup();
        // Each candidate checked by `for_block`'s own rule of overlap.
        tagged
            .into_iter()
            .filter_map(|b| {
                let start = u64::from(b) * bs;
                let items = self.multimodal_for_block(start, start + bs);
                (!items.is_empty()).then(|| (b, run_tag(&items)))
            })
            .collect()
    }

    fn encode_multimodal(&self, block_start: u64, block_end: u64, out: &mut Vec<u8>) {
        for item in &self.multimodal {
            let item_end = item.start.saturating_add(item.length);
            if item.start < block_end && item_end > block_start {
                out.push(EXTRA_MULTIMODAL);
                let offset = item.start as i64 - block_start as i64;
                out.extend_from_slice(&offset.to_le_bytes());
                // The length too: the same item encoded to a different number of placeholder
                // tokens (a different resolution) is different KV.
                out.extend_from_slice(&item.length.to_le_bytes());
                out.extend_from_slice(&len_u32(item.hash.len()).to_le_bytes());
                out.extend_from_slice(&item.hash);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stable_across_versions() {
        // Pinned vector: if this changes, keys stored by other processes stop matching.
        let context = context_fingerprint(b"{}");
        let root = root_key(&context, b"");
        let key = block_key(&root, &[1, 2, 3, 4], b"");
        assert_eq!(key, block_key(&root, &[1, 2, 3, 4], b""));
        assert_ne!(key, block_key(&root, &[1, 2, 3, 5], b""));
        assert_ne!(key, block_key(&root, &[1, 2, 3, 4], b"x"));
        assert_ne!(root, root_key(&context, b"tenant"));
    }

    #[test]
    fn table_keys_keep_leading_bits_and_chain() {
        let root = root_key(&context_fingerprint(b"{}"), b"");
        let full = TableHasher::new(128);
        let tiny = TableHasher { bits: 4, ..full };
        let mut buffer = Vec::new();
        let a = full.block(&mut buffer, full.root(&root), &[1, 2], b"");
        assert_ne!(a, full.block(&mut buffer, full.root(&root), &[1, 3], b""));
        assert_ne!(a, full.block(&mut buffer, full.root(&root), &[1, 2], b"x"));
        let t = tiny.block(&mut buffer, tiny.root(&root), &[1, 2], b"");
        assert_eq!(t.0 & (u128::MAX >> 4), 0);
        // Different caches use different seeds: table keys never mean anything outside.
        assert_ne!(full.root(&root), TableHasher::new(128).root(&root));
    }

    #[test]
    fn the_usual_block_hashes_the_same_bytes_as_any_other() {
        // `block`'s fixed-size path (16 tokens, no extras) against the general layout, over
        // ids whose every byte differs, and with a 4-bit hasher (the kept bits too).
        for bits in [128, 4] {
            let hasher = TableHasher::with_seed(bits, 0x5eed);
            let mut buffer = Vec::new();
            let mut parent = hasher.root(&root_key(&context_fingerprint(b"{}"), b""));
            for round in 0..64u32 {
                let tokens: Vec<u32> = (0..16)
                    .map(|i| (round * 16 + i).wrapping_mul(0x9E37_79B9) ^ 0x0102_0304)
                    .collect();
                let fast = hasher.block(&mut buffer, parent, &tokens, b"");
                assert_eq!(fast, hasher.block_in(&mut buffer, parent, &tokens, b""));
                parent = fast;
            }
        }
    }

    #[test]
    fn multimodal_extras_only_touch_overlapping_blocks() {
        let extras = RequestExtras {
            adapter: None,
            multimodal: vec![MultimodalItem {
                start: 20,
                length: 8,
                hash: vec![7; 4],
            }],
        };
        assert!(extras.for_block(0, 16).is_empty());
        assert!(!extras.for_block(16, 32).is_empty());
        assert!(extras.for_block(32, 48).is_empty());
        assert_ne!(extras.for_block(16, 32), extras.for_block(12, 28));
        let longer = RequestExtras {
            adapter: None,
            multimodal: vec![MultimodalItem {
                start: 20,
                length: 9,
                hash: vec![7; 4],
            }],
        };
        assert_ne!(extras.for_block(16, 32), longer.for_block(16, 32));
    }
}
