//! rekindle-storage: checkpoints (filled by the storage work).
