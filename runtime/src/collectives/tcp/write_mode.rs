//! How a rank writes large lanes into shared-memory rings: with streaming stores, which send
//! the bytes to memory past the writer's cache, or with ordinary stores, which leave them in it
//! for the reader to pull across.
//!
//! Which is faster depends on the machine, and on a virtual machine it can change from one
//! instance to the next. On the project's 2-core VM, same-session A/B runs gave streaming 4x
//! the bandwidth of ordinary stores on one instance (2-rank all-reduce of 16 MiB: 10.9
//! against 2.2 GB/s) and 0.64x on another (3.2 against 5.1 GB/s). So each rank measures both
//! while it runs and keeps the faster, per size class of lane:
//!
//! - the first [`WARMUP`] operations of a class are not measured (the rings' pages and the
//!   caches are still cold);
//! - the next `2 * CALIBRATE` alternate between the two modes, on the same operations on every
//!   rank, since every rank counts the same sequence of collectives;
//! - then the mode with the lower cost (nanoseconds per byte: the best calibration sample, then
//!   a moving average) is used, and the other is tried again after [`FIRST_RETRY`]
//!   operations; each retry that confirms the choice doubles the interval (up to
//!   [`MAX_RETRY`]), a retry that overturns it resets it.
//!
//! With a 4x gap, the retries cost under 0.4% of the time once the interval has grown to 1024.

use std::time::Duration;

/// Lanes of fewer bytes than this are written with ordinary stores, always: they stay in cache,
/// and streaming slowed 64-256 KiB lanes by a third.
pub(crate) const MIN_LANE_BYTES: usize = 512 << 10;

/// Operations of a class that are not measured.
const WARMUP: u64 = 2;
/// Measured operations per mode before the first choice.
const CALIBRATE: u64 = 3;
/// Operations between the first choice and the first retry of the other mode.
const FIRST_RETRY: u64 = 16;
/// The longest interval between retries.
const MAX_RETRY: u64 = 1024;
/// Weight of a new sample in the moving average.
const ALPHA: f64 = 0.3;
/// Size classes: `MIN_LANE_BYTES` times 1, 2, 4, ..., the last one open-ended.
const CLASSES: usize = 10;

/// What [`WriteModes::choose`] decided for one operation; hand it back to
/// [`WriteModes::record`] with the operation's duration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Choice {
    class: usize,
    bytes: usize,
    /// Write with streaming stores.
    pub(crate) streaming: bool,
    measured: bool,
    calibrating: bool,
}

#[derive(Debug, Clone, Copy, Default)]
struct Class {
    /// Operations seen.
    ops: u64,
    /// Cost (ns per byte) of ordinary [0] and streaming [1] writes.
    cost: [Option<f64>; 2],
    /// The operation at which the other mode is tried next.
    next_retry: u64,
    /// The current interval between retries.
    interval: u64,
    /// The mode a pending retry is testing against, if one is in flight.
    retrying_against: Option<bool>,
}

impl Class {
    fn best(&self) -> bool {
        match self.cost {
            [Some(plain), Some(streaming)] => streaming < plain,
            [None, Some(_)] => true,
            _ => false,
        }
    }
}

/// The per-class measurements of one rank's group.
#[derive(Debug, Clone, Default)]
pub(crate) struct WriteModes {
    classes: [Class; CLASSES],
}

fn class_of(bytes: usize) -> usize {
    let ratio = (bytes / MIN_LANE_BYTES).max(1);
    (ratio.ilog2() as usize).min(CLASSES - 1)
}

impl WriteModes {
    /// The mode for an operation whose largest shared-memory lane moves `bytes`; `None` below
    /// [`MIN_LANE_BYTES`] (ordinary stores).
    pub(crate) fn choose(&mut self, bytes: usize) -> Option<Choice> {
        if bytes < MIN_LANE_BYTES {
            return None;
        }
        let class = class_of(bytes);
        let c = &mut self.classes[class];
        let k = c.ops;
        c.ops += 1;
        let calibrating = (WARMUP..WARMUP + 2 * CALIBRATE).contains(&k);
        let (streaming, measured) = if k < WARMUP {
            (false, false)
        } else if calibrating {
            ((k - WARMUP) % 2 == 1, true)
        } else {
            if c.interval == 0 {
                c.interval = FIRST_RETRY;
                c.next_retry = k + FIRST_RETRY;
            }
            let best = c.best();
            if k == c.next_retry {
                c.retrying_against = Some(best);
                (!best, true)
            } else {
                (best, true)
            }
        };
        Some(Choice {
            class,
            bytes,
            streaming,
            measured,
            calibrating,
        })
    }

    /// Records how long the operation of `choice` took.
    pub(crate) fn record(&mut self, choice: Choice, elapsed: Duration) {
        if !choice.measured {
            return;
        }
        let c = &mut self.classes[choice.class];
        let was = c.best();
        let sample = elapsed.as_nanos() as f64 / choice.bytes as f64;
        let slot = &mut c.cost[usize::from(choice.streaming)];
        *slot = Some(match *slot {
            // A calibration keeps each mode's best sample: one disturbed operation must not
            // decide the choice.
            Some(best) if choice.calibrating => best.min(sample),
            Some(avg) => avg + ALPHA * (sample - avg),
            None => sample,
        });
        if let [Some(plain), Some(streaming)] = c.cost {
            if c.best() != was || choice.calibrating {
                tracing::debug!(
                    lanes_from_bytes = MIN_LANE_BYTES << choice.class,
                    plain_ns_per_byte = plain,
                    streaming_ns_per_byte = streaming,
                    "shared-memory ring writes: {}",
                    if c.best() {
                        "streaming"
                    } else {
                        "ordinary stores"
                    }
                );
            }
        }
        if let Some(was_best) = c.retrying_against.take() {
            let k = c.ops;
            if c.best() == was_best {
                c.interval = (c.interval * 2).min(MAX_RETRY);
            } else {
                c.interval = FIRST_RETRY;
            }
            c.next_retry = k + c.interval;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    /// Runs `n` operations of `bytes` whose duration is `ns_per_byte(streaming)` per byte and
    /// returns the modes used.
    fn drive(
        m: &mut WriteModes,
        n: usize,
        bytes: usize,
        ns_per_byte: impl Fn(usize, bool) -> f64,
    ) -> Vec<bool> {
        (0..n)
            .map(|i| {
                let c = m.choose(bytes).unwrap();
                let ns = ns_per_byte(i, c.streaming) * bytes as f64;
                m.record(c, Duration::from_nanos(ns as u64));
                c.streaming
            })
            .collect()
    }

    #[test]
    fn small_lanes_never_stream() {
        let mut m = WriteModes::default();
        assert_eq!(m.choose(0), None);
        assert_eq!(m.choose(MIN_LANE_BYTES - 1), None);
        assert!(m.choose(MIN_LANE_BYTES).is_some());
    }

    #[test]
    fn calibration_alternates_then_keeps_the_faster_mode() {
        for streaming_faster in [true, false] {
            let mut m = WriteModes::default();
            let modes = drive(&mut m, 24, 16 * MIB, |_, s| {
                if s == streaming_faster {
                    0.1
                } else {
                    0.4
                }
            });
            // Warm-up plain, then plain/streaming alternating, then the faster one until the
            // first retry of the other at operation 8 + 16.
            let mut want = vec![false, false, false, true, false, true, false, true];
            want.extend(std::iter::repeat_n(streaming_faster, 16));
            assert_eq!(modes, want, "streaming faster: {streaming_faster}");
        }
    }

    #[test]
    fn one_disturbed_calibration_sample_does_not_decide() {
        let mut m = WriteModes::default();
        // Streaming is faster, but its first measured operation (the fourth) was disturbed.
        let modes = drive(&mut m, 12, 8 * MIB, |i, s| match (i, s) {
            (3, _) => 5.0,
            (_, true) => 0.1,
            (_, false) => 0.4,
        });
        assert!(modes[8..].iter().all(|s| *s), "{modes:?}");
    }

    #[test]
    fn confirmed_retries_back_off_and_cost_little() {
        let mut m = WriteModes::default();
        let modes = drive(&mut m, 4096, 64 * MIB, |_, s| if s { 0.1 } else { 0.4 });
        let plain_after_calibration: Vec<usize> = modes
            .iter()
            .enumerate()
            .skip((WARMUP + 2 * CALIBRATE) as usize)
            .filter(|(_, s)| !**s)
            .map(|(i, _)| i)
            .collect();
        // Retries at 8+16, then intervals 32, 64, ..., 1024, 1024.
        let mut want = vec![24usize];
        let mut interval = 32;
        while let Some(&last) = want.last() {
            let next = last + 1 + interval;
            if next >= 4096 {
                break;
            }
            want.push(next);
            interval = (interval * 2).min(MAX_RETRY as usize);
        }
        assert_eq!(plain_after_calibration, want);
    }

    #[test]
    fn a_change_of_machine_behaviour_is_followed() {
        let mut m = WriteModes::default();
        let before = drive(&mut m, 40, 4 * MIB, |_, s| if s { 0.1 } else { 0.4 });
        assert!(before[30..].iter().all(|s| *s));
        // Streaming becomes the slow one: the next retry sees plain at a quarter of the cost;
        // the moving average needs a few more operations to move past the old figure.
        let after = drive(&mut m, 200, 4 * MIB, |_, s| if s { 0.8 } else { 0.2 });
        assert!(after[150..].iter().all(|s| !*s), "{after:?}");
    }

    #[test]
    fn size_classes_are_measured_apart() {
        let mut m = WriteModes::default();
        drive(&mut m, 40, MIB, |_, s| if s { 0.1 } else { 0.4 });
        let big = drive(&mut m, 40, 256 * MIB, |_, s| if s { 0.4 } else { 0.1 });
        assert!(big[10..24].iter().all(|s| !*s), "{big:?}");
        assert_eq!(class_of(MIN_LANE_BYTES), 0);
        assert_eq!(class_of(2 * MIN_LANE_BYTES - 1), 0);
        assert_eq!(class_of(2 * MIN_LANE_BYTES), 1);
        assert_eq!(class_of(usize::MAX), CLASSES - 1);
    }
}
