//! `DistributedSampler` keeps torch's invariants for any dataset length and world size.

use proptest::prelude::*;
use rekindle_runtime::sampler::DistributedSampler;

proptest! {
    #[test]
    fn ranks_read_equal_shares_of_the_padded_or_cut_epoch(
        len in 0usize..200,
        world in 1usize..9,
        seed in any::<u64>(),
        epoch in 0u64..4,
        drop_last in any::<bool>(),
        shuffle in any::<bool>(),
    ) {
        let mut all = Vec::new();
        let mut num_samples = None;
        for rank in 0..world {
            let mut s = DistributedSampler::new(len, world, rank)
                .unwrap()
                .seed(seed)
                .shuffle(shuffle)
                .drop_last(drop_last);
            s.set_epoch(epoch);
            let got = s.indices();
            prop_assert_eq!(got.len(), s.num_samples());
            prop_assert_eq!(s.total_size(), s.num_samples() * world);
            prop_assert_eq!(*num_samples.get_or_insert(got.len()), got.len());
            all.extend(got);
        }
        let mut counts = vec![0usize; len];
        for &i in &all {
            prop_assert!(i < len);
            counts[i] += 1;
        }
        if drop_last {
            // Cut: no index twice, and only the tail (fewer than `world`) is missing.
            prop_assert!(counts.iter().all(|&c| c <= 1));
            prop_assert!(len - all.len() < world);
        } else if len > 0 {
            // Padded: every index at least once; the padding repeats the epoch's start, so no
            // index is read more than once more than any other.
            prop_assert!(all.len() >= len && all.len() < len + world);
            let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            prop_assert!(*min >= 1 && max - min <= 1);
        }
    }
}
