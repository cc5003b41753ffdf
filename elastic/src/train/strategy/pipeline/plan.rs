//! Where each layer's state comes from when a pipeline group forms: a pure function of what
//! every rank holds, table-tested.
//!
//! The group settles on one step `T`: the highest step a rank's loop reached. A layer is
//! available at `T` from a rank that holds it (as a live stage or as a neighbour's copy) at
//! `T`, or at `T - 1` with the step's complete gradients pending (the rank saw every stage
//! finish the step's backward passes but not the step's end: it applies the update first).
//! Each rank needs the layers of its new stage and of the copy it keeps; it takes each from
//! itself, else from the lowest rank holding it live, else from the lowest rank holding a
//! copy, else from the newest checkpoint when that checkpoint is of step `T`. If a layer is
//! nowhere at `T`, the whole state rolls back to the newest checkpoint.

use std::ops::Range;

use serde_json::{json, Value};

/// What one rank holds, as published in its generation record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Holding {
    /// The step the held layers are at.
    pub step: u64,
    /// Whether the complete gradients of step `step` are held, not yet applied.
    pub pending: bool,
    /// The layers of its stage.
    pub live: Option<Range<usize>>,
    /// The layers of the neighbour's copy it keeps.
    pub copy: Option<Range<usize>>,
}

fn range_json(r: &Option<Range<usize>>) -> Value {
    match r {
        Some(r) => json!([r.start, r.end]),
        None => Value::Null,
    }
}

fn range_from(v: &Value) -> Option<Range<usize>> {
    let a = v.as_array()?;
    let s = a.first()?.as_u64()? as usize;
    let e = a.get(1)?.as_u64()? as usize;
    (s < e).then_some(s..e)
}

impl Holding {
    /// The JSON of [`Member::holds`](crate::train::form::Member::holds).
    pub fn to_json(&self) -> Value {
        json!({
            "step": self.step,
            "pending": self.pending,
            "live": range_json(&self.live),
            "copy": range_json(&self.copy),
        })
    }

    /// Reads [`Holding::to_json`]'s output; `None` for anything else (a rank that holds
    /// nothing publishes null).
    pub fn from_json(v: &Value) -> Option<Holding> {
        Some(Holding {
            step: v.get("step")?.as_u64()?,
            pending: v.get("pending")?.as_bool()?,
            live: v.get("live").and_then(range_from),
            copy: v.get("copy").and_then(range_from),
        })
    }

    fn has(&self, layer: usize) -> bool {
        self.live.as_ref().is_some_and(|r| r.contains(&layer))
            || self.copy.as_ref().is_some_and(|r| r.contains(&layer))
    }

    /// Whether this holding can serve layers at step `t`.
    pub fn at(&self, t: u64) -> bool {
        self.step == t || (self.pending && self.step + 1 == t)
    }
}

/// Where a rank takes one layer from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// It holds the layer itself.
    Local,
    /// Another rank sends it.
    Rank(usize),
    /// The newest checkpoint.
    Checkpoint,
    /// The model's initial values (nothing was trained yet).
    Init,
}

/// Where the loop state comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    /// The layers are at the step this rank's loop reached.
    Rank(usize),
    /// Everything rolls back (or forward) to the newest checkpoint.
    Checkpoint,
}

/// The decision of one sync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Whose loop state everyone adopts.
    pub target: Target,
    /// The step every layer is brought to (the checkpoint's for [`Target::Checkpoint`]).
    pub step: u64,
    /// Per rank, each needed layer with its source, in layer order.
    pub sources: Vec<Vec<(usize, Source)>>,
    /// `(from, to, layers)`, ordered by `(from, to)`: the order every rank issues them in.
    pub transfers: Vec<(usize, usize, Vec<usize>)>,
}

/// What [`plan`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The plan.
    Planned(Plan),
    /// Some layer is held by no rank at the step: ask for the newest checkpoint (a
    /// collective) and plan again with its step.
    NeedCheckpoint,
    /// Layers held by no rank at `step`, and there is no checkpoint.
    Lost {
        /// The step.
        step: u64,
        /// The layers.
        layers: Vec<usize>,
    },
}

/// Decides where each rank's `needs` (layer indices, ascending) come from. `holdings[r]` is
/// rank `r`'s [`Holding`] (`None`: it holds nothing), `loop_steps[r]` the step its loop
/// reached (`None`: it has no state), `checkpoint` the newest checkpoint's step once known
/// (`Some(None)`: there is none).
pub(crate) fn plan(
    holdings: &[Option<Holding>],
    loop_steps: &[Option<u64>],
    needs: &[Vec<usize>],
    checkpoint: Option<Option<u64>>,
) -> Outcome {
    let world = needs.len();
    let newest = loop_steps.iter().flatten().copied().max();
    let all = |source: Source| -> Vec<Vec<(usize, Source)>> {
        needs
            .iter()
            .map(|n| n.iter().map(|&l| (l, source)).collect())
            .collect()
    };
    let step = match newest {
        // Nothing was trained: every rank builds its layers from the model's initial values.
        None | Some(0) => {
            let src = loop_steps.iter().position(Option::is_some).unwrap_or(0);
            return Outcome::Planned(Plan {
                target: Target::Rank(src),
                step: 0,
                sources: all(Source::Init),
                transfers: Vec::new(),
            });
        }
        Some(t) => t,
    };
    let holding = |r: usize| holdings.get(r).and_then(Option::as_ref);
    let serves = |r: usize, layer: usize, live: bool| {
        holding(r).is_some_and(|h| {
            h.at(step)
                && if live {
                    h.live.as_ref().is_some_and(|x| x.contains(&layer))
                } else {
                    h.copy.as_ref().is_some_and(|x| x.contains(&layer))
                }
        })
    };
    let mut sources = Vec::with_capacity(world);
    let mut missing = Vec::new();
    for (r, need) in needs.iter().enumerate() {
        let mut mine = Vec::with_capacity(need.len());
        for &layer in need {
            let source = if holding(r).is_some_and(|h| h.at(step) && h.has(layer)) {
                Some(Source::Local)
            } else if let Some(q) = (0..holdings.len()).find(|&q| serves(q, layer, true)) {
                Some(Source::Rank(q))
            } else {
                (0..holdings.len())
                    .find(|&q| serves(q, layer, false))
                    .map(Source::Rank)
            };
            match source {
                Some(s) => mine.push((layer, s)),
                None => {
                    missing.push(layer);
                    mine.push((layer, Source::Checkpoint));
                }
            }
        }
        sources.push(mine);
    }
    let src = loop_steps
        .iter()
        .position(|s| *s == Some(step))
        .unwrap_or(0);
    if !missing.is_empty() {
        missing.sort_unstable();
        missing.dedup();
        match checkpoint {
            None => return Outcome::NeedCheckpoint,
            Some(Some(c)) if c == step => {}
            Some(Some(c)) => {
                return Outcome::Planned(Plan {
                    target: Target::Checkpoint,
                    step: c,
                    sources: all(Source::Checkpoint),
                    transfers: Vec::new(),
                })
            }
            Some(None) => {
                return Outcome::Lost {
                    step,
                    layers: missing,
                }
            }
        }
    }
    let mut transfers: Vec<(usize, usize, Vec<usize>)> = Vec::new();
    for (to, mine) in sources.iter().enumerate() {
        for &(layer, s) in mine {
            if let Source::Rank(from) = s {
                match transfers.iter_mut().find(|t| t.0 == from && t.1 == to) {
                    Some(t) => t.2.push(layer),
                    None => transfers.push((from, to, vec![layer])),
                }
            }
        }
    }
    transfers.sort_by_key(|t| (t.0, t.1));
    Outcome::Planned(Plan {
        target: Target::Rank(src),
        step,
        sources,
        transfers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use Source::{Checkpoint as C, Init as I, Local as L, Rank as R};

    fn h(
        step: u64,
        pending: bool,
        live: Range<usize>,
        copy: Option<Range<usize>>,
    ) -> Option<Holding> {
        Some(Holding {
            step,
            pending,
            live: Some(live),
            copy,
        })
    }

    fn planned(o: Outcome) -> Plan {
        match o {
            Outcome::Planned(p) => p,
            other => panic!("not planned: {other:?}"),
        }
    }

    fn with(needs: &[Vec<usize>], srcs: &[&[Source]]) -> Vec<Vec<(usize, Source)>> {
        needs
            .iter()
            .zip(srcs)
            .map(|(n, s)| n.iter().copied().zip(s.iter().copied()).collect())
            .collect()
    }

    #[test]
    fn json_round_trip() {
        let x = Holding {
            step: 7,
            pending: true,
            live: Some(2..4),
            copy: None,
        };
        assert_eq!(Holding::from_json(&x.to_json()), Some(x));
        assert_eq!(Holding::from_json(&Value::Null), None);
    }

    #[test]
    fn a_fresh_group_builds_from_the_initial_values() {
        let needs = vec![vec![0, 1, 4, 5], vec![2, 3, 0, 1]];
        let p = planned(plan(&[None, None], &[None, None], &needs, None));
        assert_eq!(p.target, Target::Rank(0));
        assert_eq!(p.step, 0);
        assert_eq!(p.sources, with(&needs, &[&[I, I, I, I], &[I, I, I, I]]));
        assert!(p.transfers.is_empty());
    }

    #[test]
    fn a_replaced_middle_stage_takes_its_layers_from_the_copy_and_its_copy_from_the_owner() {
        // Three stages of two layers; each keeps a copy of the previous stage. Rank 1 was
        // replaced: its layers 2..4 are rank 2's copy, its copy (0..2) is rank 0's stage.
        let holdings = [
            h(40, false, 0..2, Some(4..6)),
            None,
            h(40, false, 4..6, Some(2..4)),
        ];
        let steps = [Some(40), None, Some(40)];
        let needs = vec![vec![0, 1, 4, 5], vec![0, 1, 2, 3], vec![2, 3, 4, 5]];
        let p = planned(plan(&holdings, &steps, &needs, None));
        assert_eq!(p.target, Target::Rank(0));
        assert_eq!(p.step, 40);
        assert_eq!(
            p.sources,
            with(
                &needs,
                &[&[L, L, L, L], &[R(0), R(0), R(2), R(2)], &[L, L, L, L]]
            )
        );
        assert_eq!(p.transfers, vec![(0, 1, vec![0, 1]), (2, 1, vec![2, 3])]);
    }

    #[test]
    fn a_stage_lost_for_good_is_re_partitioned_over_the_survivors() {
        // Three stages -> two (layers 0..3, 3..6), from survivors 0 and 2 of the old
        // layout (now ranks 0 and 1).
        let holdings = [h(9, false, 0..2, Some(4..6)), h(9, false, 4..6, Some(2..4))];
        let steps = [Some(9), Some(9)];
        // Rank 0: stage 0..3, copy of stage 1 (3..6); rank 1: 3..6 and copy 0..3.
        let needs = vec![vec![0, 1, 2, 3, 4, 5], vec![0, 1, 2, 3, 4, 5]];
        let p = planned(plan(&holdings, &steps, &needs, None));
        assert_eq!(
            p.sources,
            with(
                &needs,
                &[&[L, L, R(1), R(1), L, L], &[R(0), R(0), L, L, L, L]]
            )
        );
        assert_eq!(p.transfers, vec![(0, 1, vec![0, 1]), (1, 0, vec![2, 3])]);
    }

    #[test]
    fn pending_gradients_roll_a_rank_forward_to_the_newest_step() {
        // Rank 0 saw the step's end (step 13); ranks 1 and 2 failed in the agreement with
        // the step's gradients complete: they serve layers at 13 after applying them.
        let holdings = [
            h(13, false, 0..2, Some(4..6)),
            h(12, true, 2..4, Some(0..2)),
            None,
        ];
        let steps = [Some(13), Some(12), None];
        let needs = vec![vec![0, 1, 4, 5], vec![0, 1, 2, 3], vec![2, 3, 4, 5]];
        let p = planned(plan(&holdings, &steps, &needs, None));
        assert_eq!(p.target, Target::Rank(0));
        assert_eq!(p.step, 13);
        assert_eq!(
            p.sources,
            with(
                &needs,
                &[&[L, L, L, L], &[L, L, L, L], &[R(1), R(1), R(0), R(0)]]
            )
        );
    }

    #[test]
    fn a_layer_nowhere_at_the_step_comes_from_a_checkpoint_of_that_step() {
        // Two stages, no copies; rank 1 lost.
        let holdings = [h(50, false, 0..2, None), None];
        let steps = [Some(50), None];
        let needs = vec![vec![0, 1], vec![2, 3]];
        assert_eq!(
            plan(&holdings, &steps, &needs, None),
            Outcome::NeedCheckpoint
        );
        let p = planned(plan(&holdings, &steps, &needs, Some(Some(50))));
        assert_eq!(p.target, Target::Rank(0));
        assert_eq!(p.sources, with(&needs, &[&[L, L], &[C, C]]));
        // An older checkpoint: everything rolls back to it.
        let p = planned(plan(&holdings, &steps, &needs, Some(Some(40))));
        assert_eq!(p.target, Target::Checkpoint);
        assert_eq!(p.step, 40);
        assert_eq!(p.sources, with(&needs, &[&[C, C], &[C, C]]));
        // None at all.
        assert_eq!(
            plan(&holdings, &steps, &needs, Some(None)),
            Outcome::Lost {
                step: 50,
                layers: vec![2, 3]
            }
        );
    }

    #[test]
    fn stale_holdings_are_not_used() {
        // Rank 1 restored an old checkpoint (step 20) while rank 0 is at 30 without a copy.
        let holdings = [h(30, false, 0..2, None), h(20, false, 2..4, None)];
        let steps = [Some(30), Some(20)];
        let needs = vec![vec![0, 1], vec![2, 3]];
        assert_eq!(
            plan(&holdings, &steps, &needs, None),
            Outcome::NeedCheckpoint
        );
        // A rank at T - 1 without pending gradients is stale too.
        let holdings = [h(30, false, 0..2, None), h(29, false, 2..4, None)];
        let steps = [Some(30), Some(29)];
        assert_eq!(
            plan(&holdings, &steps, &needs, None),
            Outcome::NeedCheckpoint
        );
    }

    #[test]
    fn the_live_holder_is_preferred_to_a_copy_and_the_lowest_rank_wins() {
        // 2 x 2: ranks 0 and 2 hold stage 0 (0..2), ranks 1 and 3 stage 1 (2..4), each
        // keeping the other stage's copy. A new rank 4 needs both.
        let holdings = [
            h(5, false, 0..2, Some(2..4)),
            h(5, false, 2..4, Some(0..2)),
            h(5, false, 0..2, Some(2..4)),
            h(5, false, 2..4, Some(0..2)),
            None,
        ];
        let steps = [Some(5), Some(5), Some(5), Some(5), None];
        let needs = vec![
            vec![0, 1, 2, 3],
            vec![0, 1, 2, 3],
            vec![0, 1, 2, 3],
            vec![0, 1, 2, 3],
            vec![0, 1, 2, 3],
        ];
        let p = planned(plan(&holdings, &steps, &needs, None));
        assert_eq!(
            p.sources[4],
            vec![(0, R(0)), (1, R(0)), (2, R(1)), (3, R(1))]
        );
        assert_eq!(p.transfers, vec![(0, 4, vec![0, 1]), (1, 4, vec![2, 3])]);
    }
}
