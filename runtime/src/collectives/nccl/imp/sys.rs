//! The C types and constants of the NCCL and CUDA driver calls the backend makes, declared
//! here (`#[repr(C)]`) rather than taken from a bindings crate, so that the backend builds
//! without a CUDA toolkit and links nothing: both libraries are opened at run time (see
//! `library.rs` and `driver.rs`). Values are those of `nccl.h` (2.30) and `cuda.h` (12.x/13.x),
//! whose ABI is stable across the versions the backend accepts.

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `ncclResult_t`, taken as a plain integer: a newer library may return a code this build does
/// not know, which must not be read into a Rust enum.
pub(crate) type Status = c_int;
/// `ncclSuccess`.
pub(crate) const SUCCESS: Status = 0;
/// `ncclUnhandledCudaError`: a CUDA call inside NCCL failed.
pub(crate) const UNHANDLED_CUDA_ERROR: Status = 1;
/// `ncclSystemError`: a socket or system call failed (typically a peer that went away).
pub(crate) const SYSTEM_ERROR: Status = 2;
/// `ncclInternalError`.
pub(crate) const INTERNAL_ERROR: Status = 3;
/// `ncclInvalidArgument`.
pub(crate) const INVALID_ARGUMENT: Status = 4;
/// `ncclInvalidUsage`.
pub(crate) const INVALID_USAGE: Status = 5;
/// `ncclRemoteError`: a peer reported a failure or vanished.
pub(crate) const REMOTE_ERROR: Status = 6;
/// `ncclInProgress`: a non-blocking call is still running.
pub(crate) const IN_PROGRESS: Status = 7;
/// `ncclTimeout` (NCCL 2.30): NCCL's own network timeout fired.
pub(crate) const TIMEOUT: Status = 8;

/// NCCL's enum name of a status code, `None` for a code this build does not know.
pub(crate) fn status_enum_name(status: Status) -> Option<&'static str> {
    Some(match status {
        SUCCESS => "ncclSuccess",
        UNHANDLED_CUDA_ERROR => "ncclUnhandledCudaError",
        SYSTEM_ERROR => "ncclSystemError",
        INTERNAL_ERROR => "ncclInternalError",
        INVALID_ARGUMENT => "ncclInvalidArgument",
        INVALID_USAGE => "ncclInvalidUsage",
        REMOTE_ERROR => "ncclRemoteError",
        IN_PROGRESS => "ncclInProgress",
        TIMEOUT => "ncclTimeout",
        _ => return None,
    })
}

/// `NCCL_UNIQUE_ID_BYTES`.
pub(crate) const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: the bootstrap handle rank 0 creates and every rank passes to
/// `ncclCommInitRankConfig`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId {
    /// Opaque to callers; `bootstrap.rs` reads the root's address out of it.
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

impl UniqueId {
    /// An all-zero id (what `ncclGetUniqueId` overwrites).
    pub fn zeroed() -> UniqueId {
        UniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        }
    }

    /// The id's bytes.
    pub fn to_bytes(self) -> [u8; UNIQUE_ID_BYTES] {
        self.internal.map(|c| c as u8)
    }

    /// An id from exactly [`UNIQUE_ID_BYTES`] bytes, `None` for any other length.
    pub fn from_bytes(bytes: &[u8]) -> Option<UniqueId> {
        let bytes: &[u8; UNIQUE_ID_BYTES] = bytes.try_into().ok()?;
        Some(UniqueId {
            internal: bytes.map(|b| b as c_char),
        })
    }
}

/// The opaque `struct ncclComm`.
#[repr(C)]
pub(crate) struct CommOpaque {
    _private: [u8; 0],
}
/// `ncclComm_t`.
pub(crate) type CommHandle = *mut CommOpaque;

/// `ncclDataType_t` (a C enum, passed as an int).
pub(crate) type DataType = c_int;
pub(crate) const UINT8: DataType = 1;
pub(crate) const INT32: DataType = 2;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const UINT32: DataType = 3;
pub(crate) const INT64: DataType = 4;
pub(crate) const FLOAT16: DataType = 6;
pub(crate) const FLOAT32: DataType = 7;
pub(crate) const FLOAT64: DataType = 8;
pub(crate) const BFLOAT16: DataType = 9;

/// `ncclRedOp_t` (a C enum, passed as an int).
pub(crate) type RedOp = c_int;
pub(crate) const SUM: RedOp = 0;
pub(crate) const PROD: RedOp = 1;
pub(crate) const MAX: RedOp = 2;
pub(crate) const MIN: RedOp = 3;
/// `ncclAvg`, since NCCL 2.10.
pub(crate) const AVG: RedOp = 4;

/// `NCCL_CONFIG_UNDEF_INT`.
pub(crate) const CONFIG_UNDEF: c_int = c_int::MIN;
/// `NCCL_API_MAGIC`.
pub(crate) const CONFIG_MAGIC: c_uint = 0xcafe_beef;
/// The NCCL version whose `ncclConfig_t` layout [`Config`] follows. A library copies only
/// the prefix it knows (`size` says how much was passed) and ignores the fields newer than
/// itself; a newer library fills the fields this layout lacks with its defaults.
pub(crate) const CONFIG_VERSION: c_uint = 23000;

/// `ncclConfig_t` as of NCCL 2.30.0 (`ncclConfig_v23000` without 2.30.5's
/// `graphStreamOrdering`).
#[repr(C)]
#[allow(non_snake_case)]
pub(crate) struct Config {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub blocking: c_int,
    pub cgaClusterSize: c_int,
    pub minCTAs: c_int,
    pub maxCTAs: c_int,
    pub netName: *const c_char,
    pub splitShare: c_int,
    pub trafficClass: c_int,
    pub commName: *const c_char,
    pub collnetEnable: c_int,
    pub CTAPolicy: c_int,
    pub shrinkShare: c_int,
    pub nvlsCTAs: c_int,
    pub nChannelsPerNetPeer: c_int,
    pub nvlinkCentricSched: c_int,
    pub graphUsageMode: c_int,
    pub numRmaCtx: c_int,
    pub maxP2pPeers: c_int,
}

impl Config {
    /// A non-blocking configuration: every field `NCCL_CONFIG_INITIALIZER` leaves undefined
    /// stays undefined, except `blocking = 0`.
    pub fn nonblocking() -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: CONFIG_MAGIC,
            version: CONFIG_VERSION,
            blocking: 0,
            cgaClusterSize: CONFIG_UNDEF,
            minCTAs: CONFIG_UNDEF,
            maxCTAs: CONFIG_UNDEF,
            netName: std::ptr::null(),
            splitShare: CONFIG_UNDEF,
            trafficClass: CONFIG_UNDEF,
            commName: std::ptr::null(),
            collnetEnable: CONFIG_UNDEF,
            CTAPolicy: CONFIG_UNDEF,
            shrinkShare: CONFIG_UNDEF,
            nvlsCTAs: CONFIG_UNDEF,
            nChannelsPerNetPeer: CONFIG_UNDEF,
            nvlinkCentricSched: CONFIG_UNDEF,
            graphUsageMode: CONFIG_UNDEF,
            numRmaCtx: CONFIG_UNDEF,
            maxP2pPeers: CONFIG_UNDEF,
        }
    }
}

/// `CUresult`.
pub(crate) type CuResult = c_int;
/// `CUDA_SUCCESS`.
pub(crate) const CUDA_SUCCESS: CuResult = 0;
/// `CUDA_ERROR_NOT_READY`: the queried stream or event has work left.
pub(crate) const CUDA_ERROR_NOT_READY: CuResult = 600;
/// `CUdevice`.
pub(crate) type CuDevice = c_int;

/// The opaque `struct CUctx_st`.
#[repr(C)]
pub(crate) struct CuContextOpaque {
    _private: [u8; 0],
}
/// `CUcontext`.
pub(crate) type CuContext = *mut CuContextOpaque;

/// The opaque `struct CUstream_st`.
#[repr(C)]
pub(crate) struct CuStreamOpaque {
    _private: [u8; 0],
}
/// `CUstream` (also NCCL's `cudaStream_t`: the runtime and driver stream types are the same).
pub(crate) type CuStream = *mut CuStreamOpaque;

/// The opaque `struct CUevent_st`.
#[repr(C)]
pub(crate) struct CuEventOpaque {
    _private: [u8; 0],
}
/// `CUevent`.
pub(crate) type CuEvent = *mut CuEventOpaque;

/// `CUdeviceptr`.
pub(crate) type CuDevicePtr = u64;

/// `CU_STREAM_NON_BLOCKING`: the stream does not synchronise with the legacy default stream.
pub(crate) const CU_STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_EVENT_WAIT_DEFAULT`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const CU_EVENT_WAIT_DEFAULT: c_uint = 0;
/// `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`: `cuMemAllocAsync` works on the device.
pub(crate) const CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: c_int = 115;

/// A device pointer as the `void*` NCCL takes.
pub(crate) fn as_void(p: CuDevicePtr) -> *mut c_void {
    p as usize as *mut c_void
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_has_nccl_2_30_layout() {
        // size_t, two uints, four ints, a pointer, two ints, a pointer, nine ints: 92 bytes
        // on LP64, padded to 96 for the alignment of the size and pointers.
        assert_eq!(std::mem::size_of::<Config>(), 96);
        assert_eq!(std::mem::offset_of!(Config, netName), 32);
        assert_eq!(std::mem::offset_of!(Config, commName), 48);
        assert_eq!(std::mem::offset_of!(Config, maxP2pPeers), 88);
        let c = Config::nonblocking();
        assert_eq!((c.blocking, c.minCTAs), (0, c_int::MIN));
        assert_eq!(c.size, 96);
        assert_eq!(c.magic, 0xcafe_beef);
    }

    #[test]
    fn status_names_cover_nccl_2_30() {
        for code in 0..=8 {
            assert!(status_enum_name(code).is_some(), "{code}");
        }
        assert_eq!(status_enum_name(TIMEOUT), Some("ncclTimeout"));
        assert_eq!(status_enum_name(9), None);
        assert_eq!(status_enum_name(-1), None);
    }

    #[test]
    fn unique_ids_round_trip_through_bytes() {
        let mut id = UniqueId::zeroed();
        for (i, c) in id.internal.iter_mut().enumerate() {
            *c = (i as u8).wrapping_mul(37) as c_char;
        }
        let bytes = id.to_bytes();
        let back = UniqueId::from_bytes(&bytes).unwrap();
        assert_eq!(back.internal, id.internal);
        assert!(UniqueId::from_bytes(&bytes[..127]).is_none());
        assert!(UniqueId::from_bytes(&[0; 129]).is_none());
        assert_eq!(std::mem::size_of::<UniqueId>(), 128);
    }
}
