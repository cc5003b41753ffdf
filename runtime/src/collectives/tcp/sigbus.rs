//! Survives a shared-memory file shrunk under its mapping.
//!
//! A ring file is mapped by two processes; either can truncate it, and an access to a mapped
//! page past the new end of the file raises SIGBUS, which would kill this process. So every
//! ring mapping is registered here, and a SIGBUS handler (installed once, chained to whatever
//! handler was there before) checks the faulting address: inside a registered mapping, it
//! replaces the whole mapping with private zero pages, so the faulting copy completes on
//! zeros, and marks the mapping faulted; the ring checks the mark before it trusts or
//! publishes anything, and reports the peer. Outside, the previous handler runs (or the
//! default action, which ends the process as it would have without this module). Wayland
//! compositors guard their clients' shared buffers the same way.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;

/// How many mappings can be guarded at once (two per same-host peer of every live group).
const SLOTS: usize = 1024;

struct Slot {
    start: AtomicUsize,
    len: AtomicUsize,
    taken: AtomicBool,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    taken: AtomicBool::new(false),
    faulted: AtomicBool::new(false),
};

static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];
static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The handler that was installed before ours (written once, before ours is installed).
static mut PREVIOUS: std::mem::MaybeUninit<libc::sigaction> = std::mem::MaybeUninit::zeroed();

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    for slot in &TABLE {
        let len = slot.len.load(Ordering::Acquire);
        let start = slot.start.load(Ordering::Acquire);
        if len != 0 && addr >= start && addr - start < len {
            // SAFETY: [start, start + len) is a live ring mapping of this process, owned by
            // the guard; replacing it with zero pages keeps every access to it valid. mmap is
            // a plain system call, safe to make in a signal handler.
            unsafe {
                libc::mmap(
                    start as *mut libc::c_void,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                );
            }
            slot.faulted.store(true, Ordering::Release);
            return;
        }
    }
    // Not ours: hand it to the previous handler, or let the default action end the process.
    // SAFETY: PREVIOUS was written before this handler was installed and never after.
    let prev = unsafe { (*std::ptr::addr_of!(PREVIOUS)).assume_init_ref() };
    let handler = prev.sa_sigaction;
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // SAFETY: restoring the default disposition; the faulting access then repeats and the
        // kernel delivers SIGBUS with the default action.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
        }
    } else if prev.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the previous handler was installed with SA_SIGINFO, so it has this signature.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(handler) };
        f(sig, info, ctx);
    } else {
        // SAFETY: a handler installed without SA_SIGINFO takes the signal number only.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
        f(sig);
    }
}

fn install() -> bool {
    INSTALL.call_once(|| {
        // SAFETY: reads the current disposition into PREVIOUS before ours replaces it; no
        // handler of ours runs before `sigaction` below returns.
        unsafe {
            let prev = (*std::ptr::addr_of_mut!(PREVIOUS)).as_mut_ptr();
            if libc::sigaction(libc::SIGBUS, std::ptr::null(), prev) != 0 {
                return;
            }
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_sigbus as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
            libc::sigemptyset(&mut act.sa_mask);
            if libc::sigaction(libc::SIGBUS, &act, std::ptr::null_mut()) == 0 {
                INSTALLED.store(true, Ordering::Release);
            }
        }
    });
    INSTALLED.load(Ordering::Acquire)
}

/// A registered mapping. Release it (drop it) before unmapping the range.
pub(crate) struct Guard {
    slot: usize,
}

impl Guard {
    /// Guards `[start, start + len)`; `None` when the handler cannot be installed or every
    /// slot is taken (the caller then does not use shared memory).
    pub(crate) fn register(start: *mut u8, len: usize) -> Option<Guard> {
        if len == 0 || !install() {
            return None;
        }
        let slot = TABLE.iter().position(|s| {
            s.taken
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        })?;
        let s = &TABLE[slot];
        s.faulted.store(false, Ordering::Release);
        s.start.store(start as usize, Ordering::Release);
        s.len.store(len, Ordering::Release);
        Some(Guard { slot })
    }

    /// True once an access to the mapping faulted (its file shrank): its contents are now
    /// zeros and nothing read from it may be trusted.
    pub(crate) fn faulted(&self) -> bool {
        TABLE[self.slot].faulted.load(Ordering::Acquire)
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let s = &TABLE[self.slot];
        s.len.store(0, Ordering::Release);
        s.start.store(0, Ordering::Release);
        s.taken.store(false, Ordering::Release);
    }
}
