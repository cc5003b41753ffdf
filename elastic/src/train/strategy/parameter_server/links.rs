//! The sub-groups of one generation: a two-rank group per (server, worker) pair, so that each
//! pair's pushes and replies run in their own queue, independent of the others; a two-rank
//! group per server towards the server keeping its copy; and the group of the servers.
//!
//! Every rank builds the groups it belongs to in one global order (pairs by server then
//! worker, then the copy links, then the servers' group), so no two ranks wait on each other
//! in opposite orders.

use crate::train::strategy::{Group, StepError, SubGroup};

/// The role of a rank in a group of `world` ranks with `servers` servers: the first
/// `servers` ranks serve, the others work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Server `k` (rank `k`).
    Server(usize),
    /// Worker `j` (rank `servers + j`).
    Worker(usize),
}

impl Role {
    /// The role of `rank`.
    pub fn of(rank: usize, servers: usize) -> Role {
        if rank < servers {
            Role::Server(rank)
        } else {
            Role::Worker(rank - servers)
        }
    }
}

/// The server that keeps server `k`'s copy (none with a single server, or with `copies`
/// off).
pub fn copy_holder(k: usize, servers: usize, copies: bool) -> Option<usize> {
    (copies && servers > 1).then(|| (k + 1) % servers)
}

/// The server whose copy server `k` keeps (none with a single server, or with `copies` off).
pub fn copy_of(k: usize, servers: usize, copies: bool) -> Option<usize> {
    (copies && servers > 1).then(|| (k + servers - 1) % servers)
}

/// This rank's sub-groups.
#[derive(Debug, Default)]
pub struct Links {
    /// Server: one per worker, by worker index. Worker: one per server, by server index.
    /// In each, the server is rank 0 and the worker rank 1.
    pub pairs: Vec<SubGroup>,
    /// Server: the link on which it sends updates to its copy holder (it is the link's
    /// `from` rank; see [`Links::copy_out_peer`]).
    pub copy_out: Option<SubGroup>,
    /// Server: the link on which its predecessor's updates arrive.
    pub copy_in: Option<SubGroup>,
    /// Server: the group of every server.
    pub servers: Option<SubGroup>,
}

/// The rank of the other member of a two-rank sub-group.
pub fn peer(link: &SubGroup) -> usize {
    1 - link.pg().rank().min(1)
}

impl Links {
    /// Builds this rank's sub-groups of `group` (every rank calls it at the same point); the
    /// copy links only with `copies` on.
    pub fn build(group: &mut Group<'_>, servers: usize, copies: bool) -> Result<Links, StepError> {
        let me = group.rank();
        let world = group.world_size();
        let mut links = Links::default();
        for k in 0..servers {
            for w in servers..world {
                if me == k || me == w {
                    links
                        .pairs
                        .push(group.subgroup(&format!("ps.{k}.{w}"), &[k, w])?);
                }
            }
        }
        for k in 0..servers {
            let Some(h) = copy_holder(k, servers, copies) else {
                break;
            };
            if me == k || me == h {
                let mut ranks = [k, h];
                ranks.sort_unstable();
                let link = group.subgroup(&format!("copy.{k}"), &ranks)?;
                if me == k {
                    links.copy_out = Some(link);
                } else {
                    links.copy_in = Some(link);
                }
            }
        }
        if servers > 1 && me < servers {
            let all: Vec<usize> = (0..servers).collect();
            links.servers = Some(group.subgroup("servers", &all)?);
        }
        Ok(links)
    }

    /// Aborts every link (so that threads blocked on them return).
    pub fn abort(&self) {
        for l in self
            .pairs
            .iter()
            .chain(&self.copy_out)
            .chain(&self.copy_in)
            .chain(&self.servers)
        {
            l.pg().abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_and_copies() {
        assert_eq!(Role::of(0, 2), Role::Server(0));
        assert_eq!(Role::of(1, 2), Role::Server(1));
        assert_eq!(Role::of(2, 2), Role::Worker(0));
        assert_eq!(Role::of(5, 2), Role::Worker(3));
        assert_eq!(copy_holder(0, 1, true), None);
        assert_eq!(copy_of(0, 1, true), None);
        assert_eq!(
            (0..3).map(|k| copy_holder(k, 3, true)).collect::<Vec<_>>(),
            [Some(1), Some(2), Some(0)]
        );
        assert_eq!(
            (0..3).map(|k| copy_of(k, 3, true)).collect::<Vec<_>>(),
            [Some(2), Some(0), Some(1)]
        );
        assert_eq!(
            (copy_holder(0, 2, true), copy_holder(1, 2, true)),
            (Some(1), Some(0))
        );
        assert_eq!(
            (copy_holder(0, 2, false), copy_of(1, 2, false)),
            (None, None)
        );
    }
}
