//! The wire encoding of drained events: the msgpack of vLLM's `KVEventBatch.events`.
//!
//! The Python publisher wraps the array this writes into `[ts, events, data_parallel_rank]`;
//! `tests/test_events_wire.py` and the state machine in `tests/test_index_property.py` check the
//! bytes against msgspec's encoding of vLLM's structs. The format is described in
//! `docs/events.md`.

use super::KvEvent;
use crate::key::BlockKey;

/// The 64-bit form of a block key that routers use: its last 8 bytes as a big-endian integer
/// (`int.from_bytes(key, "big") & (2**64 - 1)`, vLLM's conversion of its own hashes).
#[must_use]
pub fn hash64(key: &BlockKey) -> u64 {
    let mut low = [0u8; 8];
    low.copy_from_slice(&key.0[24..]);
    u64::from_be_bytes(low)
}

/// How block hashes go on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashForm {
    /// The 64-bit form (`index::hash64`), a msgpack unsigned integer.
    Int64,
    /// The full 32-byte SHA-256 key, msgpack bin.
    Bytes,
}

/// Encodes `events` as the msgpack array vLLM's `KVEventBatch.events` is on the wire: each event
/// a map tagged `"type"`, fields in vLLM's declaration order, defaulted fields left out, every
/// value in the smallest msgpack form (msgspec's choices, so the bytes are msgspec's). The
/// Python layer wraps it into `[ts, events, data_parallel_rank]`; `tests/test_events_wire.py`
/// checks the bytes against msgspec's encoding of vLLM's structs.
#[must_use]
pub fn encode_events(
    events: &[&KvEvent],
    block_size: usize,
    hashes: HashForm,
    medium: Option<&str>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 16 * events.len());
    msgpack::array_header(&mut out, events.len());
    let hash = |out: &mut Vec<u8>, key: &BlockKey| match hashes {
        HashForm::Int64 => msgpack::uint(out, hash64(key)),
        HashForm::Bytes => msgpack::bin(out, &key.0),
    };
    let optional_str = |out: &mut Vec<u8>, value: Option<&str>| match value {
        Some(text) => msgpack::str(out, text),
        None => msgpack::nil(out),
    };
    for event in events {
        match event {
            KvEvent::Stored {
                keys,
                parent,
                token_ids,
                adapter,
                extras,
            } => {
                // Extra keys travel with the tokens: a block published by key alone reveals
                // neither.
                let with_extras = !token_ids.is_empty() && extras.iter().any(|e| !e.is_empty());
                msgpack::map_header(&mut out, if with_extras { 9 } else { 8 });
                msgpack::str(&mut out, "type");
                msgpack::str(&mut out, "BlockStored");
                msgpack::str(&mut out, "block_hashes");
                msgpack::array_header(&mut out, keys.len());
                for key in keys {
                    hash(&mut out, key);
                }
                msgpack::str(&mut out, "parent_block_hash");
                match parent {
                    Some(key) => hash(&mut out, key),
                    None => msgpack::nil(&mut out),
                }
                msgpack::str(&mut out, "token_ids");
                msgpack::array_header(&mut out, token_ids.len());
                for &token in token_ids {
                    msgpack::uint(&mut out, u64::from(token));
                }
                msgpack::str(&mut out, "block_size");
                msgpack::uint(&mut out, block_size as u64);
                msgpack::str(&mut out, "lora_id");
                msgpack::nil(&mut out);
                msgpack::str(&mut out, "medium");
                optional_str(&mut out, medium);
                msgpack::str(&mut out, "lora_name");
                let name = adapter.as_ref().map(|a| String::from_utf8_lossy(a));
                optional_str(&mut out, name.as_deref());
                if with_extras {
                    msgpack::str(&mut out, "extra_keys");
                    msgpack::array_header(&mut out, extras.len());
                    for block_extras in extras {
                        if block_extras.is_empty() {
                            msgpack::nil(&mut out);
                        } else {
                            msgpack::array_header(&mut out, 1);
                            msgpack::bin(&mut out, block_extras);
                        }
                    }
                }
            }
            KvEvent::Removed { keys } => {
                msgpack::map_header(&mut out, 3);
                msgpack::str(&mut out, "type");
                msgpack::str(&mut out, "BlockRemoved");
                msgpack::str(&mut out, "block_hashes");
                msgpack::array_header(&mut out, keys.len());
                for key in keys {
                    hash(&mut out, key);
                }
                msgpack::str(&mut out, "medium");
                optional_str(&mut out, medium);
            }
            KvEvent::Cleared => {
                msgpack::map_header(&mut out, 1);
                msgpack::str(&mut out, "type");
                msgpack::str(&mut out, "AllBlocksCleared");
            }
        }
    }
    out
}

/// The msgpack forms the events use, each in its smallest encoding (as msgspec writes them).
mod msgpack {
    pub(super) fn nil(out: &mut Vec<u8>) {
        out.push(0xc0);
    }

    pub(super) fn uint(out: &mut Vec<u8>, value: u64) {
        if value < 0x80 {
            out.push(value as u8);
        } else if value <= 0xff {
            out.extend_from_slice(&[0xcc, value as u8]);
        } else if value <= 0xffff {
            out.push(0xcd);
            out.extend_from_slice(&(value as u16).to_be_bytes());
        } else if value <= 0xffff_ffff {
            out.push(0xce);
            out.extend_from_slice(&(value as u32).to_be_bytes());
        } else {
            out.push(0xcf);
            out.extend_from_slice(&value.to_be_bytes());
        }
    }

    fn sized(out: &mut Vec<u8>, len: usize, fix: Option<(u8, usize)>, wide: [u8; 3]) {
        match fix {
            Some((tag, limit)) if len < limit => out.push(tag | len as u8),
            _ if len <= 0xff && wide[0] != 0 => out.extend_from_slice(&[wide[0], len as u8]),
            _ if len <= 0xffff => {
                out.push(wide[1]);
                out.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                out.push(wide[2]);
                out.extend_from_slice(&(len as u32).to_be_bytes());
            }
        }
    }

    pub(super) fn str(out: &mut Vec<u8>, text: &str) {
        sized(out, text.len(), Some((0xa0, 32)), [0xd9, 0xda, 0xdb]);
        out.extend_from_slice(text.as_bytes());
    }

    pub(super) fn bin(out: &mut Vec<u8>, data: &[u8]) {
        sized(out, data.len(), None, [0xc4, 0xc5, 0xc6]);
        out.extend_from_slice(data);
    }

    pub(super) fn array_header(out: &mut Vec<u8>, len: usize) {
        sized(out, len, Some((0x90, 16)), [0, 0xdc, 0xdd]);
    }

    pub(super) fn map_header(out: &mut Vec<u8>, len: usize) {
        sized(out, len, Some((0x80, 16)), [0, 0xde, 0xdf]);
    }
}
