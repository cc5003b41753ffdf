//! NCCL backend implementation (lands with the nccl feature work).
