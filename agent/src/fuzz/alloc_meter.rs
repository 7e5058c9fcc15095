//! Heap bytes live on the current thread, for "bounded memory per
//! connection": the test binary's global allocator counts what each thread
//! allocates and frees (a thread-local `Cell`, const-initialised: no
//! allocation, no destructor, safe inside the allocator).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Meter;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counting touches only thread-local cells.
unsafe impl GlobalAlloc for Meter {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) };
        note(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            note(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static METER: Meter = Meter;

/// Runs `f` and returns its result with the most heap bytes it held live
/// at once on this thread beyond what was live before.
pub fn peak_growth<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let start = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let r = f();
    let peak = PEAK.with(Cell::get);
    (r, usize::try_from(peak - start).unwrap_or(0))
}

#[test]
fn counts_what_this_thread_holds() {
    let (v, grew) = peak_growth(|| vec![0u8; 1 << 20]);
    assert!(grew >= 1 << 20, "{grew}");
    drop(v);
    let ((), grew) = peak_growth(|| {
        for _ in 0..100 {
            drop(vec![0u8; 4096]);
        }
    });
    assert!(
        (4096..8192).contains(&grew),
        "one 4 KiB block at a time: {grew}"
    );
}
