//! Token ids as the caller's integer array holds them (1, 2, 4 or 8 bytes, signed or not)
//! narrowed to `u32` in one pass, with every value's bits outside `0 ..= u32::MAX` OR-ed
//! together on the way, so that one test at the end says whether any id was out of range.
//!
//! This pass took a sixth to a quarter of the run core's time per request on the production
//! trace (a 12.5k-token int64 prompt on average, every request). The wheel is built for
//! x86-64's baseline (SSE2, four int64 ids a step), so the same pass is compiled again for AVX2
//! (eight) and AVX-512 (sixteen, one narrowing move) and chosen at run time: a 12.5k-token
//! int64 prompt's lookup on an empty cache takes 4.0 µs portable, 3.7 with AVX2, 3.3 with
//! AVX-512 (2-core AMD EPYC VM, issue 24 round 27). AVX-512 is taken only where 512-bit vectors
//! do not lower the clock of the code that follows (`Level::runs_here`). Every build gives the
//! same ids and the same verdict (the tests).

use std::sync::OnceLock;

/// Vector units this CPU has, as a choice of `narrow`'s build. Made only by `best` (and the
/// tests' `available`), which ask the CPU (`Level::runs_here`): holding one is the proof its
/// build may run here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Units(Level);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Level {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

/// Every build, narrowest first.
const LEVELS: &[Level] = &[
    Level::Portable,
    #[cfg(target_arch = "x86_64")]
    Level::Avx2,
    #[cfg(target_arch = "x86_64")]
    Level::Avx512,
];

impl Level {
    /// Whether this CPU has what the build needs.
    fn runs_here(self) -> bool {
        match self {
            Level::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            // VBMI2 too, though the pass does not use it: it marks the CPUs whose 512-bit
            // vectors do not lower the clock (Ice Lake and later, Zen 4). Skylake-SP and
            // Cascade Lake Xeons, where they do for the code that follows, get AVX2.
            Level::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("avx512vbmi2")
            }
        }
    }
}

impl Units {
    /// The widest units this CPU has, asked once.
    pub fn best() -> Self {
        static BEST: OnceLock<Units> = OnceLock::new();
        *BEST.get_or_init(|| {
            let widest = LEVELS.iter().rev().find(|level| level.runs_here());
            Self(widest.copied().unwrap_or(Level::Portable))
        })
    }

    /// Every choice this CPU can run, narrowest first (the portable build always): what the
    /// tests compare.
    #[cfg(test)]
    pub fn available() -> impl Iterator<Item = Self> {
        LEVELS
            .iter()
            .copied()
            .filter(|level| level.runs_here())
            .map(Self)
    }
}

/// The ids appended to `out` and whether all were in range, or how many could not be reserved.
type Narrowed = Result<(Vec<u32>, bool), usize>;

/// `data`'s ids (`width` bytes each, little-endian, `signed` or not) narrowed and appended to
/// `out`, and whether every one was in range (when not, the values kept are meaningless and
/// the caller finds the first bad one to name it). `Err(count)`: `count` ids could not be
/// reserved (an array of small ids can widen past memory: refused, not an abort).
pub fn narrow(units: Units, data: &[u8], width: usize, signed: bool, out: Vec<u32>) -> Narrowed {
    match units.0 {
        Level::Portable => narrow_any(data, width, signed, out),
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)] // the binding's third `unsafe`: a pass built for AVX2
        // Safety: `narrow_avx2` is safe Rust compiled with AVX2 enabled; calling it is sound
        // when the CPU has AVX2, which `Level::runs_here` checked to make this `Units`.
        Level::Avx2 => unsafe { narrow_avx2(data, width, signed, out) },
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)] // the same, for AVX-512
        // Safety: as above; `Level::runs_here` checked AVX-512 F, BW and VL, and AVX2 (the
        // features this build enables), besides VBMI2.
        Level::Avx512 => unsafe { narrow_avx512(data, width, signed, out) },
    }
}

/// `narrow_any` compiled with the target features named: sound to call only where the CPU has
/// them (`Level::runs_here`).
macro_rules! built_for {
    ($name:ident, $features:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        fn $name(data: &[u8], width: usize, signed: bool, out: Vec<u32>) -> Narrowed {
            narrow_any(data, width, signed, out)
        }
    };
}

built_for!(narrow_avx2, "avx2");
built_for!(narrow_avx512, "avx512f,avx512bw,avx512vl,avx2");

/// Every width's pass; inlined into each build above, so each is compiled for its units.
#[inline(always)]
fn narrow_any(data: &[u8], width: usize, signed: bool, out: Vec<u32>) -> Narrowed {
    match (width, signed) {
        // A negative i64 read as u64 has its high bits set: one test covers both signs.
        (8, _) => pass::<8>(data, out, |b| {
            let v = u64::from_le_bytes(b);
            (v as u32, v >> 32)
        }),
        (4, true) => pass::<4>(data, out, |b| {
            let v = u32::from_le_bytes(b);
            (v, u64::from(v >> 31))
        }),
        (4, false) => pass::<4>(data, out, |b| (u32::from_le_bytes(b), 0)),
        (2, true) => pass::<2>(data, out, |b| {
            let v = u16::from_le_bytes(b);
            (u32::from(v), u64::from(v >> 15))
        }),
        (2, false) => pass::<2>(data, out, |b| (u32::from(u16::from_le_bytes(b)), 0)),
        (_, true) => pass::<1>(data, out, |b| (u32::from(b[0]), u64::from(b[0] >> 7))),
        (_, false) => pass::<1>(data, out, |b| (u32::from(b[0]), 0)),
    }
}

// The ids usually come cold from DRAM (an engine's prompt array, written long before), and
// the hardware prefetcher stops at every 4 KiB page: it must see new misses on each page
// before it streams it. So each 512-byte piece asks for the piece one page ahead first.
// A 12k-token int64 prompt read cold: 11.5 -> 8.4-9.6 µs a call (an empty cache's lookup,
// the production trace; 1, 8 or 16 KiB ahead read the same within the noise).
const PIECE: usize = 512;
const PREFETCH_AHEAD: usize = 4096;

/// One width's pass. `out` is taken and handed back by value, not borrowed: a loop extending
/// a borrowed vector ran 5% slower on a warm 12k-token prompt (the vector's fields reloaded).
#[inline(always)]
fn pass<const W: usize>(
    data: &[u8],
    mut out: Vec<u32>,
    read: impl Fn([u8; W]) -> (u32, u64),
) -> Narrowed {
    // Reserved fallibly (an array of small ids can widen past memory: refused, not an
    // abort), then extended from an exact-length iterator: no zeroing first and no
    // capacity check per token. Against a `push` loop with a range check per value: 13 ->
    // 3.25 instructions a token for int64 ids (callgrind; CHANGELOG, issue 24 fifth round).
    // Amortised (`try_reserve`): a batch's buffer grows geometrically prompt after prompt;
    // an empty vector gets exactly `count` all the same.
    let count = data.len() / W;
    if out.try_reserve(count).is_err() {
        return Err(out.len() + count);
    }
    let mut stray = 0u64;
    let whole = &data[..count * W];
    for (index, piece) in whole.chunks(PIECE).enumerate() {
        if let Some(ahead) = whole.get(index * PIECE + PREFETCH_AHEAD..) {
            for line in ahead.chunks(64).take(PIECE / 64) {
                prefixkv_core::prefetch::prefetch(&line[0]);
            }
        }
        out.extend(piece.chunks_exact(W).map(|chunk| {
            let (value, bits) = read(chunk.try_into().unwrap_or([0; W]));
            stray |= bits;
            value
        }));
    }
    Ok((out, stray == 0))
}

#[cfg(test)]
mod tests {
    use super::{narrow, Units};

    /// A small deterministic generator (xorshift): the tests need varied bytes, not quality.
    fn bytes(seed: u64, len: usize) -> Vec<u8> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            })
            .collect()
    }

    /// `count` ids of `width` bytes, all in range.
    fn ids(seed: u64, count: usize, width: usize, signed: bool) -> Vec<u8> {
        let mut data = bytes(seed, count * width);
        for id in data.chunks_exact_mut(width) {
            // Clear each id's top bit (and, for 8 bytes, its high half) to put it in range.
            if width == 8 {
                id[4..].fill(0);
            } else if signed {
                id[width - 1] &= 0x7F;
            }
        }
        data
    }

    /// How an id is put out of range.
    #[derive(Clone, Copy, Debug)]
    enum Bad {
        /// Its top bit: negative if signed, past `u32` if 8 bytes wide.
        TopBit,
        /// 8 bytes wide, its bit 32 alone: `u32::MAX + 1` or a small id plus `2^32` (a build
        /// testing only the sign bit would pass it).
        Bit32,
    }

    /// Each input that must be refused: one bad id (last, middle or first), alone.
    fn refusals(count: usize, width: usize, signed: bool) -> Vec<(usize, Bad)> {
        if count == 0 {
            return vec![];
        }
        let positions = [count - 1, count / 2, 0];
        let mut cases = vec![];
        if signed || width == 8 {
            cases.extend(positions.iter().map(|&p| (p, Bad::TopBit)));
        }
        if width == 8 {
            cases.extend(positions.iter().map(|&p| (p, Bad::Bit32)));
        }
        cases
    }

    #[test]
    fn every_build_narrows_alike_and_flags_the_same_ids() {
        let units: Vec<Units> = Units::available().collect();
        assert_eq!(Some(&Units::best()), units.last());
        // Lengths around a vector step (16), a piece (512 bytes) and the prefetch distance.
        let lengths = [
            0, 1, 3, 15, 16, 17, 63, 64, 65, 511, 512, 513, 4095, 4097, 12_500,
        ];
        for width in [1, 2, 4, 8] {
            for signed in [false, true] {
                for (n, &count) in lengths.iter().enumerate() {
                    let data = ids((width * 1000 + n) as u64, count, width, signed);
                    let expected: Vec<u32> = data
                        .chunks_exact(width)
                        .map(|id| {
                            let mut word = [0u8; 8];
                            word[..width].copy_from_slice(id);
                            u64::from_le_bytes(word) as u32
                        })
                        .collect();
                    let mut inputs = vec![(data.clone(), None)];
                    for (position, bad) in refusals(count, width, signed) {
                        let mut spoiled = data.clone();
                        let id = &mut spoiled[position * width..(position + 1) * width];
                        match bad {
                            Bad::TopBit => id[width - 1] |= 0x80,
                            Bad::Bit32 => id[4] |= 0x01,
                        }
                        inputs.push((spoiled, Some((position, bad))));
                    }
                    for (input, spoiled) in &inputs {
                        for &unit in &units {
                            // Appended after what `out` already holds (a batch's buffer).
                            let (got, valid) = narrow(unit, input, width, signed, vec![7, 8])
                                .expect("small inputs fit in memory");
                            let case = format!(
                                "{unit:?} width {width} signed {signed} n {count} {spoiled:?}"
                            );
                            assert_eq!(valid, spoiled.is_none(), "{case}");
                            assert_eq!(got[..2], [7, 8], "{case}");
                            assert_eq!(got.len(), 2 + count, "{case}");
                            if valid {
                                assert_eq!(got[2..], expected[..], "{case}");
                            }
                        }
                    }
                }
            }
        }
    }
}
