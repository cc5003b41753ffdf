//! What tests, benchmarks and the chaos harness share (feature `test-etcd`): real processes,
//! a real etcd, and several hosts on one machine.
//!
//! - [`process`]: [`Proc`], a child process whose output lines are read as they come, with
//!   waits that always have a deadline, killing of the whole process tree, and the parsers of
//!   the lines this project's programs print ([`field`], [`Fingerprint`]);
//! - [`etcd`]: [`EtcdServer`], a real etcd on free ports with a temp data dir;
//! - [`netns`]: [`Network`], hosts in their own network (and mount) namespaces joined by a
//!   bridge, with partitions and slow links (root only).

pub mod etcd;
pub mod netns;
pub mod process;

pub use etcd::{EtcdServer, EtcdServerError, START_ATTEMPTS, START_TIMEOUT};
pub use netns::{is_root, HostKind, Netns, NetnsError, Network};
pub use process::{
    exit_code, field, final_fingerprint, kill, kill_tagged, new_tag, pid_alive, pid_running, run,
    tagged_pids, wait_pid_gone, wait_tagged_gone, workspace_bin, Bell, Fingerprint, Finished, Line,
    Proc, ProcError, SpawnOptions, Stream, TAG_ENV,
};
