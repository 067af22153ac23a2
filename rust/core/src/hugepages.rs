//! Huge pages for the core's large per-block arrays: the second place the core uses `unsafe`.
//!
//! A cache of a few hundred thousand blocks keeps tens of MiB of per-block arrays (the table's
//! slots, token rows and index, the pool's metadata), and a request touches them at random,
//! block by block. With 4 KiB pages nearly every such touch also misses the TLB: the page walk
//! comes before the cache miss, and a prefetch that misses the TLB must walk too. Mostly
//! backed by 2 MiB pages, the same arrays need a few dozen TLB entries instead of thousands
//! (`benches/PROFILE.md`, issue 24, round 16).
//!
//! Under the `transparent_hugepage` mode `madvise` (this project's test machine's, and a common
//! distribution default) Linux backs anonymous memory with huge pages only where asked
//! (`madvise(MADV_HUGEPAGE)`), at the first touch of each 2 MiB range wholly inside the advised
//! range (so up to 2 MiB at either end of an array stays on 4 KiB pages): an array is reserved,
//! advised while untouched, and filled after. Under `always` the advice changes nothing, under
//! `never` it is ignored. A hint either way: where the kernel has no huge page to give, or on
//! other systems, nothing changes but the speed.
//!
//! The cost is at construction, where the arrays are filled: each huge page is allocated and
//! cleared at its first touch. On the project's test VM that took up to ~20 ms a huge page
//! where the memory was fresh (the hypervisor backs it on first use; `/proc/vmstat` showed no
//! compaction or reclaim), so a 1M-block cache took 1.6–2.4 s to build and a 4M-block one 8–9 s,
//! against 0.15 s and 0.7–1.0 s on 4 KiB pages; where freed huge pages were at hand, 0.03–0.05 s
//! for 1M blocks, faster than on 4 KiB pages. A process that builds large caches often and
//! briefly sets `PREFIXKV_HUGE_PAGES=0` ([`ENV`]); `1`, or unset, is the default; any other
//! value is refused by name when a cache is built.

/// The environment variable that turns the advice off (`0`) or on (`1`, the default).
pub const ENV: &str = "PREFIXKV_HUGE_PAGES";

/// Arrays smaller than this are left as they are: a couple of huge pages save little, and each
/// advised range splits the allocator's mapping.
const MIN_ADVISED_BYTES: usize = 4 << 20;

/// Whether the large arrays are advised, from [`ENV`]'s value (`None`: unset); the message
/// names the variable and the value when it is neither `0` nor `1`.
pub(crate) fn parse(value: Option<&str>) -> Result<bool, String> {
    match value {
        None | Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(other) => Err(format!(
            "{ENV} must be 0 (4 KiB pages) or 1 (huge pages, the default), got {other:?}"
        )),
    }
}

/// [`parse`] of the process's environment (a value that is not Unicode is refused too).
pub(crate) fn from_env() -> Result<bool, String> {
    match std::env::var(ENV) {
        Ok(value) => parse(Some(&value)),
        Err(std::env::VarError::NotPresent) => parse(None),
        Err(std::env::VarError::NotUnicode(value)) => parse(Some(&value.to_string_lossy())),
    }
}

/// An empty `Vec` with room for exactly `len` values, its memory advised to be backed by huge
/// pages before anything is written to it unless [`ENV`] turns that off (a cache refuses a bad
/// value before it reserves anything); `None` if the allocation fails (never an abort). The
/// caller fills it (`extend`, `resize`: within the reserved capacity, no reallocation). Public
/// so that a benchmark's stand-in arrays sit in memory as the cache's do.
#[must_use]
pub fn reserve<T>(len: usize) -> Option<Vec<T>> {
    reserve_with(len, from_env().unwrap_or(true))
}

/// `len` values made by `make`, or `None` if the allocation fails (never an abort): the large
/// per-block arrays of the tables, backed by huge pages where the system allows (`reserve`).
pub(crate) fn filled<T>(len: usize, make: impl FnMut() -> T) -> Option<Box<[T]>> {
    let mut values = reserve(len)?;
    values.extend(std::iter::repeat_with(make).take(len));
    Some(values.into_boxed_slice())
}

/// `reserve` with the setting given (`huge`: advise arrays of 4 MiB or more).
fn reserve_with<T>(len: usize, huge: bool) -> Option<Vec<T>> {
    let mut values: Vec<T> = Vec::new();
    values.try_reserve_exact(len).ok()?;
    let bytes = values.capacity().saturating_mul(std::mem::size_of::<T>());
    if huge && bytes >= MIN_ADVISED_BYTES {
        advise(values.as_ptr().cast::<u8>() as usize, bytes);
    }
    Some(values)
}

/// Asks the kernel to back the whole 4 KiB pages of `[start, start + len)` with huge pages.
#[cfg(all(target_os = "linux", not(loom), not(miri)))]
fn advise(start: usize, len: usize) {
    const PAGE: usize = 4096;
    // Only pages wholly inside the range: the advice then covers no byte the caller does not
    // own (the allocator may keep other allocations in the pages at either end).
    let first = start.next_multiple_of(PAGE);
    let end = (start + len) / PAGE * PAGE;
    if end <= first {
        return;
    }
    // Safety: `madvise` with `MADV_HUGEPAGE` changes no byte of memory and no permission; it
    // only marks the pages (here all inside one live allocation of the caller's) as eligible
    // for huge pages. It fails harmlessly (EINVAL) where the kernel lacks transparent huge
    // pages; the result is ignored because the advice is only a hint.
    #[allow(unsafe_code)]
    unsafe {
        libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
    }
}

#[cfg(not(all(target_os = "linux", not(loom), not(miri))))]
fn advise(_start: usize, _len: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_gives_an_empty_vec_with_the_exact_room() {
        for len in [0, 1, 1000, (MIN_ADVISED_BYTES / 8) + 3] {
            let values: Vec<u64> = reserve(len).expect("small enough to allocate");
            assert!(values.is_empty());
            assert_eq!(values.capacity(), len);
        }
    }

    #[test]
    fn the_setting_is_0_or_1_and_anything_else_is_refused_by_name() {
        assert_eq!(parse(None), Ok(true));
        assert_eq!(parse(Some("1")), Ok(true));
        assert_eq!(parse(Some("0")), Ok(false));
        for bad in ["", "yes", "true", "01", " 1", "on"] {
            let message = parse(Some(bad)).expect_err(bad);
            assert!(
                message.contains(ENV) && message.contains(&format!("{bad:?}")),
                "{message}"
            );
        }
    }

    #[test]
    fn reserve_refuses_an_impossible_size_without_aborting() {
        assert!(reserve::<u64>(usize::MAX / 4).is_none());
    }

    /// The kernel's flags of the mapping that holds `address` (`/proc/self/smaps`'s `VmFlags`).
    #[cfg(all(target_os = "linux", not(miri)))]
    fn vm_flags_at(address: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or_default();
            if let Some((start, end)) = range.split_once('-') {
                if let (Ok(start), Ok(end)) = (
                    usize::from_str_radix(start, 16),
                    usize::from_str_radix(end, 16),
                ) {
                    inside = (start..end).contains(&address);
                    continue;
                }
            }
            if let Some(flags) = line.strip_prefix("VmFlags:").filter(|_| inside) {
                return flags.split_whitespace().map(str::to_owned).collect();
            }
        }
        panic!("no mapping holds {address:#x}");
    }

    /// The advice reaches the kernel (the mapping's `hg` flag, `MADV_HUGEPAGE`) with the setting
    /// on, not with it off, and never changes what is written. Where the kernel has no
    /// transparent huge pages at all, the advice cannot be taken: only the contents are checked.
    #[test]
    #[cfg(all(target_os = "linux", not(miri)))]
    fn the_advice_reaches_the_kernel_only_when_on_and_changes_no_value() {
        let kernel_has_thp = std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists();
        let len = 3 * MIN_ADVISED_BYTES / 8;
        for huge in [true, false] {
            let mut values: Vec<u64> = reserve_with(len, huge).expect("allocates");
            values.extend((0..len as u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
            let middle = std::ptr::from_ref(&values[len / 2]) as usize;
            if kernel_has_thp {
                let advised = vm_flags_at(middle).iter().any(|flag| flag == "hg");
                assert_eq!(advised, huge, "huge pages {huge}: the mapping's hg flag");
            }
            assert!(values
                .iter()
                .enumerate()
                .all(|(i, &v)| v == (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        }
    }
}
