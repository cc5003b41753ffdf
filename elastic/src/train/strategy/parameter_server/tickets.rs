//! Ticket accounting of the asynchronous mode: which steps a shard has applied
//! ([`Applied`]), which step a worker computes next ([`Dealer`]), and the staleness of the
//! pushes a server applied or refused ([`Staleness`]). Pure; table-tested.
//!
//! A ticket is a step number: the global batch of step `t` (the elastic sampler's plan at
//! that step), computed by one worker and pushed to every server. Servers apply pushes in the
//! order they arrive, so a shard may have applied ticket 9 before ticket 7; what it has
//! applied is a prefix `0..p` and a set of tickets past it.

use std::collections::{BTreeMap, BTreeSet};

/// The tickets a shard has applied: every ticket below `prefix`, and `beyond`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    prefix: u64,
    beyond: BTreeSet<u64>,
}

impl Applied {
    /// Every ticket below `prefix` and those of `beyond`.
    pub fn new(prefix: u64, beyond: impl IntoIterator<Item = u64>) -> Applied {
        let mut a = Applied {
            prefix,
            beyond: BTreeSet::new(),
        };
        for t in beyond {
            a.insert(t);
        }
        a
    }

    /// The first ticket not applied.
    pub fn prefix(&self) -> u64 {
        self.prefix
    }

    /// The tickets applied past the prefix, ascending.
    pub fn beyond(&self) -> Vec<u64> {
        self.beyond.iter().copied().collect()
    }

    /// True when `ticket` was applied.
    pub fn contains(&self, ticket: u64) -> bool {
        ticket < self.prefix || self.beyond.contains(&ticket)
    }

    /// Records `ticket` as applied; false when it already was.
    pub fn insert(&mut self, ticket: u64) -> bool {
        if self.contains(ticket) {
            return false;
        }
        self.beyond.insert(ticket);
        while self.beyond.remove(&self.prefix) {
            self.prefix += 1;
        }
        true
    }
}

/// Deals tickets to workers in increasing order, skipping those every shard has applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dealer {
    next: u64,
    skip: BTreeSet<u64>,
}

impl Dealer {
    /// A dealer whose first ticket is the first at or after `from` that some shard of `shards`
    /// has not applied.
    pub fn new(from: u64, shards: &[Applied]) -> Dealer {
        let mut candidates: BTreeSet<u64> = BTreeSet::new();
        let lowest = shards.iter().map(Applied::prefix).min().unwrap_or(from);
        for s in shards {
            candidates.extend(s.beyond.iter().copied().filter(|&t| t >= from));
            candidates.extend(lowest.max(from)..s.prefix);
        }
        let skip = candidates
            .into_iter()
            .filter(|&t| !shards.is_empty() && shards.iter().all(|s| s.contains(t)))
            .collect();
        Dealer { next: from, skip }
    }

    /// The ticket the next [`deal`](Self::deal) returns.
    pub fn peek(&mut self) -> u64 {
        while self.skip.remove(&self.next) {
            self.next += 1;
        }
        self.next
    }

    /// The next ticket.
    pub fn deal(&mut self) -> u64 {
        while self.skip.remove(&self.next) {
            self.next += 1;
        }
        let t = self.next;
        self.next += 1;
        t
    }
}

/// The staleness of the pushes a server received: versions applied to its shard between the
/// worker's pull and the push's arrival.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Staleness {
    applied: BTreeMap<u64, u64>,
    refused: u64,
}

impl Staleness {
    /// Whether a push `staleness` versions stale is applied under the bound (`None`: no bound).
    pub fn admits(staleness: u64, bound: Option<u64>) -> bool {
        bound.is_none_or(|b| staleness <= b)
    }

    /// Counts an applied push.
    pub fn applied(&mut self, staleness: u64) {
        *self.applied.entry(staleness).or_default() += 1;
    }

    /// Counts a refused push.
    pub fn refused(&mut self) {
        self.refused += 1;
    }

    /// Pushes applied.
    pub fn count(&self) -> u64 {
        self.applied.values().sum()
    }

    /// Pushes refused as too stale.
    pub fn refused_count(&self) -> u64 {
        self.refused
    }

    /// The mean staleness of the applied pushes (0 without any).
    pub fn mean(&self) -> f64 {
        let n = self.count();
        if n == 0 {
            return 0.0;
        }
        self.applied
            .iter()
            .map(|(s, c)| *s as f64 * *c as f64)
            .sum::<f64>()
            / n as f64
    }

    /// The smallest staleness at or above which a fraction `1 - q` of the applied pushes lie
    /// (`q` in `[0, 1]`; 0 without any).
    pub fn quantile(&self, q: f64) -> u64 {
        let n = self.count();
        if n == 0 {
            return 0;
        }
        let want = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (s, c) in &self.applied {
            seen += c;
            if seen >= want {
                return *s;
            }
        }
        self.max()
    }

    /// The largest staleness applied.
    pub fn max(&self) -> u64 {
        self.applied.keys().next_back().copied().unwrap_or(0)
    }

    /// Adds another server's counts.
    pub fn merge(&mut self, other: &Staleness) {
        for (s, c) in &other.applied {
            *self.applied.entry(*s).or_default() += c;
        }
        self.refused += other.refused;
    }

    /// One line: `pushes=N refused=R mean=M p50=A p90=B p99=C max=D`.
    pub fn summary(&self) -> String {
        format!(
            "pushes={} refused={} mean={:.2} p50={} p90={} p99={} max={}",
            self.count(),
            self.refused,
            self.mean(),
            self.quantile(0.5),
            self.quantile(0.9),
            self.quantile(0.99),
            self.max()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn applied_tracks_a_prefix_and_the_tickets_past_it() {
        // (inserted in this order, expected prefix, expected beyond, duplicates refused)
        let cases: [(&[u64], u64, &[u64]); 5] = [
            (&[], 0, &[]),
            (&[0, 1, 2], 3, &[]),
            (&[2, 5], 0, &[2, 5]),
            (&[2, 0, 1], 3, &[]),
            (&[1, 3, 0, 4], 2, &[3, 4]),
        ];
        for (order, prefix, beyond) in cases {
            let mut a = Applied::default();
            for &t in order {
                assert!(a.insert(t), "{order:?}: {t} is new");
                assert!(!a.insert(t), "{order:?}: {t} twice");
            }
            assert_eq!(a.prefix(), prefix, "{order:?}");
            assert_eq!(a.beyond(), beyond, "{order:?}");
            for &t in order {
                assert!(a.contains(t));
            }
        }
        let a = Applied::new(3, [1, 5, 4]);
        assert_eq!((a.prefix(), a.beyond()), (3, vec![4, 5]));
        assert!(a.contains(2) && !a.contains(3) && a.contains(5) && !a.contains(6));
        let b = Applied::new(2, [2, 3, 5]);
        assert_eq!((b.prefix(), b.beyond()), (4, vec![5]));
    }

    #[test]
    fn dealer_skips_what_every_shard_applied() {
        // (from, shards, first tickets dealt)
        let cases: Vec<(u64, Vec<Applied>, Vec<u64>)> = vec![
            (0, vec![Applied::default()], vec![0, 1, 2]),
            (5, vec![Applied::new(5, [])], vec![5, 6, 7]),
            // Ticket 7 is on both shards, 6 only on one: 6 is dealt again, 7 is not.
            (
                5,
                vec![Applied::new(5, [6, 7]), Applied::new(5, [7, 9])],
                vec![5, 6, 8, 9, 10],
            ),
            // One shard's prefix is past the other's beyond set.
            (
                4,
                vec![Applied::new(8, []), Applied::new(4, [5, 6, 9])],
                vec![4, 7, 8, 9],
            ),
            (3, vec![], vec![3, 4]),
        ];
        for (from, shards, want) in cases {
            let mut d = Dealer::new(from, &shards);
            assert_eq!(d.peek(), want[0]);
            let got: Vec<u64> = (0..want.len()).map(|_| d.deal()).collect();
            assert_eq!(got, want, "from {from}, shards {shards:?}");
        }
    }

    #[test]
    fn staleness_statistics() {
        assert!(Staleness::admits(100, None));
        assert!(Staleness::admits(3, Some(3)));
        assert!(!Staleness::admits(4, Some(3)));
        let mut s = Staleness::default();
        assert_eq!((s.mean(), s.quantile(0.5), s.max()), (0.0, 0, 0));
        for v in [0, 1, 1, 2, 2, 2, 3, 3, 3, 10] {
            s.applied(v);
        }
        s.refused();
        assert_eq!(s.count(), 10);
        assert_eq!(s.refused_count(), 1);
        assert!((s.mean() - 2.7).abs() < 1e-12);
        assert_eq!(s.quantile(0.5), 2);
        assert_eq!(s.quantile(0.9), 3);
        assert_eq!(s.quantile(0.99), 10);
        assert_eq!(s.quantile(0.0), 0);
        assert_eq!(s.max(), 10);
        let mut t = Staleness::default();
        t.applied(4);
        t.merge(&s);
        assert_eq!((t.count(), t.refused_count(), t.max()), (11, 1, 10));
        assert_eq!(
            s.summary(),
            "pushes=10 refused=1 mean=2.70 p50=2 p90=3 p99=10 max=10"
        );
    }
}
