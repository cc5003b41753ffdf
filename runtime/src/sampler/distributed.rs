//! [`DistributedSampler`]: torch's `DistributedSampler` for a fixed world size.

use super::{check_rank, epoch_permutation, SamplerResult};

/// Rank `rank` of `world_size`'s share of a dataset of `len` samples, with the semantics of
/// `torch.utils.data.DistributedSampler`:
///
/// - `shuffle`: the epoch's order is [`epoch_permutation`]`(len, seed, epoch)` (keyed by
///   `seed + epoch` like torch; the generator is ChaCha8, not torch's Mersenne Twister, so the
///   order itself differs from torch's); otherwise `0..len`;
/// - without `drop_last`, [`num_samples`](Self::num_samples) is `ceil(len / world_size)` and the
///   order is padded to [`total_size`](Self::total_size) by repeating it from its start (as
///   many times as needed when `len` is smaller than the padding);
/// - with `drop_last`, `num_samples` is `floor(len / world_size)` (torch's
///   `ceil((len - world_size) / world_size)` when `len` is not a multiple, which is the same)
///   and the order is cut to `total_size`;
/// - rank `r` reads positions `r, r + world_size, r + 2 * world_size, ...` of the order.
///
/// Call [`set_epoch`](Self::set_epoch) before each epoch, as in torch, or every epoch has the
/// same order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    world_size: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A sampler with torch's defaults: shuffled, seed 0, no `drop_last`, epoch 0. Fails if
    /// `rank` is not below `world_size`.
    pub fn new(len: usize, world_size: usize, rank: usize) -> SamplerResult<Self> {
        check_rank(world_size, rank)?;
        Ok(DistributedSampler {
            len,
            world_size,
            rank,
            shuffle: true,
            seed: 0,
            drop_last: false,
            epoch: 0,
        })
    }

    /// Whether to shuffle (default true).
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The seed shared by every rank (default 0).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Whether to drop the tail instead of padding (default false).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Sets the epoch, which (with the seed) decides the order.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The number of indices each rank reads per epoch.
    pub fn num_samples(&self) -> usize {
        if self.drop_last {
            self.len / self.world_size
        } else {
            self.len.div_ceil(self.world_size)
        }
    }

    /// `num_samples * world_size`: the epoch's length over all ranks, padding included.
    pub fn total_size(&self) -> usize {
        self.num_samples() * self.world_size
    }

    /// This rank's indices for the current epoch, in reading order.
    pub fn indices(&self) -> Vec<usize> {
        let order = if self.shuffle {
            epoch_permutation(self.len, self.seed, self.epoch)
        } else {
            (0..self.len).collect()
        };
        if order.is_empty() {
            return Vec::new();
        }
        (self.rank..self.total_size())
            .step_by(self.world_size)
            .map(|i| order[i % order.len()])
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unshuffled(len: usize, world: usize, rank: usize, drop_last: bool) -> Vec<usize> {
        DistributedSampler::new(len, world, rank)
            .unwrap()
            .shuffle(false)
            .drop_last(drop_last)
            .indices()
    }

    /// Values worked out by hand from torch's `DistributedSampler.__iter__` (pad by
    /// `indices[:padding]` or by repeating the whole list, then `indices[rank:total:world]`).
    #[test]
    fn matches_torch_unshuffled() {
        let table: &[(usize, usize, usize, bool, &[usize])] = &[
            (10, 3, 0, false, &[0, 3, 6, 9]),
            (10, 3, 1, false, &[1, 4, 7, 0]),
            (10, 3, 2, false, &[2, 5, 8, 1]),
            (10, 3, 0, true, &[0, 3, 6]),
            (10, 3, 2, true, &[2, 5, 8]),
            (2, 5, 0, false, &[0]),
            (2, 5, 3, false, &[1]),
            (2, 5, 4, false, &[0]),
            (2, 5, 4, true, &[]),
            (8, 4, 3, false, &[3, 7]),
            (8, 4, 3, true, &[3, 7]),
            (0, 2, 1, false, &[]),
            (7, 1, 0, true, &[0, 1, 2, 3, 4, 5, 6]),
        ];
        for &(len, world, rank, drop_last, want) in table {
            assert_eq!(
                unshuffled(len, world, rank, drop_last),
                want,
                "len {len} world {world} rank {rank} drop_last {drop_last}"
            );
        }
    }

    #[test]
    fn sizes_match_torch() {
        // (len, world, drop_last) -> (num_samples, total_size)
        let table = [
            (10, 3, false, 4, 12),
            (10, 3, true, 3, 9),
            (9, 3, true, 3, 9),
            (2, 5, true, 0, 0),
            (2, 5, false, 1, 5),
            (0, 4, false, 0, 0),
        ];
        for (len, world, drop_last, n, total) in table {
            let s = DistributedSampler::new(len, world, 0)
                .unwrap()
                .drop_last(drop_last);
            assert_eq!(
                (s.num_samples(), s.total_size()),
                (n, total),
                "{len} {world}"
            );
        }
    }

    #[test]
    fn shuffled_ranks_partition_the_padded_permutation() {
        for (len, world) in [(100, 4), (101, 4), (3, 8)] {
            for epoch in 0..3 {
                let mut all = Vec::new();
                for rank in 0..world {
                    let mut s = DistributedSampler::new(len, world, rank).unwrap().seed(5);
                    s.set_epoch(epoch);
                    let got = s.indices();
                    assert_eq!(got.len(), s.num_samples());
                    all.extend(got);
                }
                let perm = epoch_permutation(len, 5, epoch);
                let padded: Vec<usize> = (0..all.len()).map(|i| perm[i % len]).collect();
                let mut a = all.clone();
                let mut b = padded;
                a.sort_unstable();
                b.sort_unstable();
                assert_eq!(a, b);
            }
        }
    }

    #[test]
    fn set_epoch_changes_the_order() {
        let mut s = DistributedSampler::new(50, 2, 0).unwrap().seed(1);
        let e0 = s.indices();
        s.set_epoch(1);
        assert_eq!(s.epoch(), 1);
        assert_ne!(s.indices(), e0);
        s.set_epoch(0);
        assert_eq!(s.indices(), e0);
    }

    #[test]
    fn bad_rank_is_an_error() {
        assert!(DistributedSampler::new(10, 2, 2).is_err());
        assert!(DistributedSampler::new(10, 0, 0).is_err());
    }
}
