//! The `rekindle ckpt` commands.
