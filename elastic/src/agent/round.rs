//! A round as this node sees it: its place, the world size, where node 0's store is.

use crate::rendezvous::{NodeInfo, RendezvousInfo};

/// What one completed rendezvous gives this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Round {
    /// The rendezvous round (the attempt, with static rendezvous).
    pub round: u64,
    /// This node's rank in the round.
    pub node_rank: usize,
    /// Nodes in the round.
    pub nnodes: usize,
    /// The global rank of this node's local rank 0.
    pub rank_base: usize,
    /// Workers in the round.
    pub world_size: usize,
    /// Node 0's store host.
    pub master_addr: String,
    /// Node 0's store port.
    pub master_port: u16,
}

impl Round {
    /// The round of static rendezvous at `attempt`: every node has `nproc` workers.
    pub fn fixed(
        attempt: u32,
        nnodes: usize,
        node_rank: usize,
        nproc: usize,
        master: (&str, u16),
    ) -> Round {
        Round {
            round: attempt as u64,
            node_rank,
            nnodes,
            rank_base: node_rank * nproc,
            world_size: nnodes * nproc,
            master_addr: master.0.to_string(),
            master_port: master.1,
        }
    }

    /// The round a rendezvous completed, for node `me`: ranks follow the participants'
    /// order, and node 0's store is where rank 0's participant record says.
    pub fn from_info(info: &RendezvousInfo, me: &NodeInfo) -> Round {
        let rank_base = info.participants[..info.rank.min(info.participants.len())]
            .iter()
            .map(|n| n.nproc as usize)
            .sum();
        let world_size = info.participants.iter().map(|n| n.nproc as usize).sum();
        let (master_addr, master_port) = info
            .participants
            .first()
            .and_then(|n| n.store_addr.as_deref())
            .and_then(split_addr)
            .unwrap_or_else(|| (me.host.clone(), 0));
        Round {
            round: info.round,
            node_rank: info.rank,
            nnodes: info.world_size,
            rank_base,
            world_size,
            master_addr,
            master_port,
        }
    }

    /// `host:port` of node 0's store.
    pub fn master(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }
}

/// Splits `host:port` (`[v6]:port` too).
pub(crate) fn split_addr(addr: &str) -> Option<(String, u16)> {
    let (h, p) = addr.rsplit_once(':')?;
    Some((h.trim_matches(['[', ']']).to_string(), p.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, nproc: u32, store: Option<&str>) -> NodeInfo {
        NodeInfo {
            id: id.into(),
            host: format!("{id}.host"),
            nproc,
            store_addr: store.map(str::to_string),
        }
    }

    #[test]
    fn addresses_split() {
        assert_eq!(split_addr("h:12"), Some(("h".into(), 12)));
        assert_eq!(split_addr("[::1]:5"), Some(("::1".into(), 5)));
        assert_eq!(split_addr("nope"), None);
        assert_eq!(split_addr("h:99999"), None);
    }

    #[test]
    fn ranks_follow_the_participants_and_node_0_hosts_the_store() {
        let me = node("b", 3, Some("b.host:2"));
        let info = RendezvousInfo {
            job: "j".into(),
            store: std::sync::Arc::new(rekindle_runtime::store::InMemoryStore::new()),
            round: 4,
            rank: 1,
            world_size: 3,
            participants: vec![
                node("a", 2, Some("10.0.0.1:7000")),
                me.clone(),
                node("c", 1, None),
            ],
        };
        let r = Round::from_info(&info, &me);
        assert_eq!(
            r,
            Round {
                round: 4,
                node_rank: 1,
                nnodes: 3,
                rank_base: 2,
                world_size: 6,
                master_addr: "10.0.0.1".into(),
                master_port: 7000,
            }
        );
        assert_eq!(r.master(), "10.0.0.1:7000");
        let fixed = Round::fixed(2, 3, 2, 4, ("m", 9));
        assert_eq!((fixed.round, fixed.rank_base, fixed.world_size), (2, 8, 12));
    }
}
