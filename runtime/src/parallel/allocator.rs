//! Keeping freed tensor memory in the process, for replicas that run on threads of one process.

/// Up to this size glibc serves allocations from its heaps instead of `mmap` (its maximum).
const MMAP_THRESHOLD: i32 = 32 << 20;
/// Free memory at the top of a heap that glibc keeps instead of returning it.
const TRIM_THRESHOLD: i32 = 1 << 30;
/// Extra memory glibc takes whenever a heap grows.
const TOP_PAD: i32 = 64 << 20;

/// Makes the C allocator keep freed memory for reuse instead of returning it to the kernel;
/// returns whether it could (glibc only).
///
/// CPU tensors are plain heap buffers. By default glibc serves every buffer above a threshold
/// (dynamic, at most 32 MiB) with a fresh `mmap` and returns it with `munmap` when freed, so each
/// step of a model faults in and zeroes all its activation and gradient buffers again. In one
/// process the page faults of every thread wait on the address-space lock that each `mmap` and
/// `munmap` takes for writing, so [`DataParallel`](super::DataParallel) replicas on threads slow
/// each other down in a way that processes of their own (DDP) do not. After this call buffers up
/// to 32 MiB come from glibc's heaps and freed memory stays there for the next step. The cost is
/// memory the process keeps: about one step's worth of buffers per thread arena. Call it at the
/// start of `main`, before other threads exist; the environment variables `MALLOC_MMAP_THRESHOLD_`,
/// `MALLOC_TRIM_THRESHOLD_` and `MALLOC_TOP_PAD_` do the same from outside.
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters; it is safe to call at any time.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
                && libc::mallopt(libc::M_TOP_PAD, TOP_PAD) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_the_settings() {
        assert!(super::keep_freed_memory());
        // Memory freed and allocated again still works (the heap keeps it now).
        let a = vec![1u8; 8 << 20];
        let sum: u64 = a.iter().map(|&b| b as u64).sum();
        drop(a);
        let b = vec![2u8; 8 << 20];
        assert_eq!(sum * 2, b.iter().map(|&x| x as u64).sum::<u64>());
    }
}
