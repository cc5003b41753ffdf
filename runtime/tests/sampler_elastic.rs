//! Every sample of an epoch is consumed exactly once by the elastic sampler, whatever the
//! schedule of world sizes, interrupted steps and restarts from a saved state.

use proptest::prelude::*;
use rekindle_runtime::sampler::{epoch_permutation, ElasticConfig, ElasticSampler, ElasticState};

/// What happens at one step of a schedule.
#[derive(Debug, Clone)]
enum Event {
    /// Every rank of a world of this size reads its share, and the step is committed.
    Step(usize),
    /// The ranks of a world of this size read their shares, then the step fails (a peer died)
    /// and is discarded.
    Interrupted(usize),
    /// Every process is replaced: a new sampler restored from the saved state (via tensors).
    Restart,
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        6 => (1usize..9).prop_map(Event::Step),
        2 => (1usize..9).prop_map(Event::Interrupted),
        1 => Just(Event::Restart),
    ]
}

/// Runs `events` (cycled) from the start of `epoch` until the epoch is done; returns the
/// committed samples in the order they were read and the number of steps committed.
fn run_epoch(
    config: &ElasticConfig,
    epoch: u64,
    events: &[Event],
    sampler: &mut ElasticSampler,
) -> (Vec<usize>, usize) {
    sampler.set_epoch(epoch);
    let mut consumed = Vec::new();
    let mut steps = 0;
    let progresses = events.iter().any(|e| matches!(e, Event::Step(_)));
    for event in events.iter().cycle() {
        if sampler.epoch_done() {
            break;
        }
        match event {
            Event::Step(world) | Event::Interrupted(world) => {
                let step = sampler.plan().expect("epoch not done");
                let mut read = Vec::new();
                for rank in 0..*world {
                    read.extend_from_slice(step.rank_indices(*world, rank).unwrap());
                }
                assert_eq!(read, step.indices(), "the ranks' shares tile the step");
                if let Event::Step(_) = event {
                    consumed.extend(read);
                    sampler.commit(&step).unwrap();
                    steps += 1;
                }
            }
            Event::Restart => {
                let tensors = sampler.state().to_tensors().unwrap();
                let state = ElasticState::from_tensors(&tensors).unwrap();
                *sampler = ElasticSampler::from_state(config.clone(), state).unwrap();
            }
        }
        // A schedule of only interruptions and restarts never finishes: force progress.
        if !progresses && !sampler.epoch_done() {
            let step = sampler.plan().unwrap();
            consumed.extend_from_slice(step.indices());
            sampler.commit(&step).unwrap();
            steps += 1;
        }
    }
    (consumed, steps)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_sample_exactly_once(
        len in 0usize..300,
        global_batch in 1usize..40,
        seed in any::<u64>(),
        drop_last in any::<bool>(),
        events in prop::collection::vec(event(), 1..30),
    ) {
        let config = ElasticConfig::new(len, global_batch).seed(seed).drop_last(drop_last);
        let mut sampler = ElasticSampler::new(config.clone()).unwrap();
        for epoch in 0..2u64 {
            let (consumed, steps) = run_epoch(&config, epoch, &events, &mut sampler);
            let perm = epoch_permutation(len, seed, epoch);
            let want = if drop_last { len - len % global_batch } else { len };
            // Read in the epoch's order, each exactly once, and nothing else.
            prop_assert_eq!(&consumed[..], &perm[..want]);
            let mut unique = consumed.clone();
            unique.sort_unstable();
            unique.dedup();
            prop_assert_eq!(unique.len(), want);
            prop_assert_eq!(steps, config.steps_per_epoch());
        }
    }

    #[test]
    fn the_order_does_not_depend_on_the_schedule(
        len in 1usize..200,
        global_batch in 1usize..32,
        seed in any::<u64>(),
        a in prop::collection::vec(event(), 1..20),
        b in prop::collection::vec(event(), 1..20),
    ) {
        let config = ElasticConfig::new(len, global_batch).seed(seed);
        let (x, _) = run_epoch(&config, 1, &a, &mut ElasticSampler::new(config.clone()).unwrap());
        let (y, _) = run_epoch(&config, 1, &b, &mut ElasticSampler::new(config.clone()).unwrap());
        prop_assert_eq!(x, y);
    }
}
