//! Splitting an ordered list of layers into contiguous stages of balanced cost.

use std::ops::Range;

use super::PipelineError;

/// Splits layers of the given `costs` (parameter counts, measured times, any additive
/// measure) into `stages` contiguous, non-empty ranges whose largest total cost is as small
/// as possible. Among the splits that reach it, the one whose last stages are lightest wins
/// (the last stage also computes the loss), so the answer is a pure function of the costs.
pub fn partition(costs: &[f64], stages: usize) -> Result<Vec<Range<usize>>, PipelineError> {
    let layers = costs.len();
    if stages == 0 || stages > layers {
        return Err(PipelineError::Stages { stages, layers });
    }
    if let Some((layer, &cost)) = costs
        .iter()
        .enumerate()
        .find(|(_, c)| !c.is_finite() || **c < 0.0)
    {
        return Err(PipelineError::Cost { layer, cost });
    }
    let mut prefix = vec![0.0f64; layers + 1];
    for (i, c) in costs.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c;
    }
    let sum = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[j][i]: the smallest largest stage cost of the first i layers in j + 1 stages;
    // cut[j][i]: where the last of those stages starts.
    let mut best = vec![vec![f64::INFINITY; layers + 1]; stages];
    let mut cut = vec![vec![0usize; layers + 1]; stages];
    for (i, b) in best[0].iter_mut().enumerate().skip(1) {
        *b = sum(0, i);
    }
    for j in 1..stages {
        for i in (j + 1)..=layers {
            for p in j..i {
                let cost = best[j - 1][p].max(sum(p, i));
                // `<=`: a later cut (a lighter last stage) wins a tie.
                if cost <= best[j][i] {
                    best[j][i] = cost;
                    cut[j][i] = p;
                }
            }
        }
    }
    let mut out = vec![0..0; stages];
    let mut end = layers;
    for j in (0..stages).rev() {
        let start = if j == 0 { 0 } else { cut[j][end] };
        out[j] = start..end;
        end = start;
    }
    Ok(out)
}

/// The per-layer costs for [`partition`]: `costs` when given (one per layer), else the
/// parameter counts `params`.
pub fn partition_costs(params: &[usize], costs: Option<&[f64]>) -> Result<Vec<f64>, PipelineError> {
    match costs {
        Some(c) if c.len() != params.len() => Err(PipelineError::CostCount {
            given: c.len(),
            layers: params.len(),
        }),
        Some(c) => Ok(c.to_vec()),
        None => Ok(params.iter().map(|&n| n as f64).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn max_cost(costs: &[f64], parts: &[Range<usize>]) -> f64 {
        parts
            .iter()
            .map(|r| costs[r.clone()].iter().sum::<f64>())
            .fold(0.0, f64::max)
    }

    /// Every contiguous split into `k` non-empty parts, for the brute-force check.
    fn all_splits(n: usize, k: usize) -> Vec<Vec<Range<usize>>> {
        if k == 1 {
            return vec![vec![0..n]];
        }
        let mut out = Vec::new();
        for last in (k - 1)..n {
            for mut head in all_splits(last, k - 1) {
                head.push(last..n);
                out.push(head);
            }
        }
        out
    }

    /// Costs, stages, the expected split.
    type Case<'a> = (&'a [f64], usize, &'a [Range<usize>]);

    #[test]
    fn table() {
        let one = partition(&[1.0], 1).unwrap();
        assert_eq!((one.len(), one[0].clone()), (1, 0..1));
        let cases: &[Case<'_>] = &[
            (&[1.0, 1.0, 1.0, 1.0], 2, &[0..2, 2..4]),
            (&[1.0, 1.0, 1.0, 1.0], 4, &[0..1, 1..2, 2..3, 3..4]),
            (&[1.0, 1.0, 2.0, 1.0, 1.0, 1.0], 3, &[0..2, 2..4, 4..6]),
            // One heavy layer gets a stage of its own.
            (&[1.0, 10.0, 1.0, 1.0], 3, &[0..1, 1..2, 2..4]),
            // Ties go to a lighter last stage.
            (&[1.0, 1.0, 1.0], 2, &[0..2, 2..3]),
            // An MLP 64-256-256-10 by parameter count: 16640, 65792, 2570.
            (&[16640.0, 65792.0, 2570.0], 2, &[0..1, 1..3]),
            // Free layers (activations) do not change the bottleneck.
            (&[4.0, 0.0, 4.0, 0.0], 2, &[0..2, 2..4]),
        ];
        for (costs, stages, want) in cases {
            assert_eq!(
                &partition(costs, *stages).unwrap(),
                want,
                "{costs:?} / {stages}"
            );
        }
    }

    #[test]
    fn the_bottleneck_is_optimal() {
        let costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0];
        for k in 1..=costs.len() {
            let got = partition(&costs, k).unwrap();
            assert_eq!(got.len(), k);
            assert_eq!(got[0].start, 0);
            assert_eq!(got[k - 1].end, costs.len());
            assert!(got.windows(2).all(|w| w[0].end == w[1].start));
            assert!(got.iter().all(|r| !r.is_empty()));
            let brute = all_splits(costs.len(), k)
                .iter()
                .map(|s| max_cost(&costs, s))
                .fold(f64::INFINITY, f64::min);
            assert_eq!(max_cost(&costs, &got), brute, "k = {k}");
        }
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        assert_eq!(
            partition(&[1.0, 1.0], 3),
            Err(PipelineError::Stages {
                stages: 3,
                layers: 2
            })
        );
        assert!(matches!(
            partition(&[1.0], 0),
            Err(PipelineError::Stages { .. })
        ));
        assert!(matches!(
            partition(&[1.0, f64::NAN], 1),
            Err(PipelineError::Cost { layer: 1, .. })
        ));
        assert!(matches!(
            partition(&[-1.0, 1.0], 1),
            Err(PipelineError::Cost { layer: 0, .. })
        ));
        assert_eq!(partition_costs(&[5, 7], None).unwrap(), vec![5.0, 7.0]);
        assert_eq!(
            partition_costs(&[5, 7], Some(&[1.0])),
            Err(PipelineError::CostCount {
                given: 1,
                layers: 2
            })
        );
    }
}
