//! Gradient buckets: which parameters are flattened into which all-reduce.

use std::ops::Range;

use crate::optim::ParamSpec;

/// One parameter's place in a bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The parameter's index in the name-sorted parameter list.
    pub param: usize,
    /// Its elements' range in the bucket's flat buffer.
    pub range: Range<usize>,
}

/// The parameters of one bucket, in flattening order, and its length in elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    /// The members, contiguous from offset 0.
    pub members: Vec<Member>,
    /// The number of f32 elements.
    pub len: usize,
}

/// Assigns parameters to buckets as torch's DDP does
/// (`_compute_bucket_assignment_by_size`): parameters are taken in reverse order of `params`
/// (the name-sorted list; the reverse approximates the order in which backward produces
/// gradients), added to the open bucket, and the bucket is closed as soon as its size reaches
/// its limit: `first_bytes` for the first bucket, `cap_bytes` for the others. A bucket can thus
/// exceed its limit by one parameter; no bucket is empty.
pub fn plan_buckets(params: &[ParamSpec], first_bytes: usize, cap_bytes: usize) -> Vec<BucketPlan> {
    let mut buckets = Vec::new();
    let mut open = BucketPlan {
        members: Vec::new(),
        len: 0,
    };
    for (param, spec) in params.iter().enumerate().rev() {
        let len = spec.len();
        open.members.push(Member {
            param,
            range: open.len..open.len + len,
        });
        open.len += len;
        let limit = if buckets.is_empty() {
            first_bytes
        } else {
            cap_bytes
        };
        if open.len * std::mem::size_of::<f32>() >= limit {
            buckets.push(std::mem::replace(
                &mut open,
                BucketPlan {
                    members: Vec::new(),
                    len: 0,
                },
            ));
        }
    }
    if !open.members.is_empty() {
        buckets.push(open);
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs(lens: &[usize]) -> Vec<ParamSpec> {
        lens.iter()
            .enumerate()
            .map(|(i, &n)| ParamSpec::new(format!("p{i}"), &[n]))
            .collect()
    }

    /// The bucket contents as parameter indices.
    fn layout(lens: &[usize], first: usize, cap: usize) -> Vec<Vec<usize>> {
        plan_buckets(&specs(lens), first, cap)
            .iter()
            .map(|b| b.members.iter().map(|m| m.param).collect())
            .collect()
    }

    #[test]
    fn torch_assignment() {
        // (param lengths, first bytes, cap bytes) -> buckets of parameter indices
        // (param lengths, first bytes, cap bytes, buckets of parameter indices)
        type Row = (&'static [usize], usize, usize, &'static [&'static [usize]]);
        let table: &[Row] = &[
            (&[], 4, 8, &[]),
            (&[1], 4, 8, &[&[0]]),
            (&[1, 1, 1, 1], 4, 8, &[&[3], &[2, 1], &[0]]),
            (&[1, 1, 1, 1, 1], 8, 8, &[&[4, 3], &[2, 1], &[0]]),
            (&[10, 1, 1], 8, 400, &[&[2, 1], &[0]]),
            (&[100, 1, 1], 1 << 20, 25 << 20, &[&[2, 1, 0]]),
            (&[3, 5], 1, 1, &[&[1], &[0]]),
        ];
        for &(lens, first, cap, want) in table {
            let want: Vec<Vec<usize>> = want.iter().map(|b| b.to_vec()).collect();
            assert_eq!(layout(lens, first, cap), want, "{lens:?} {first} {cap}");
        }
    }

    #[test]
    fn mlp_buckets_with_torch_defaults() {
        // 784-1024-1024-10 sorted by name; 1 MB first bucket, 25 MB cap.
        let params = vec![
            ParamSpec::new("fc1.bias", &[1024]),
            ParamSpec::new("fc1.weight", &[1024, 784]),
            ParamSpec::new("fc2.bias", &[1024]),
            ParamSpec::new("fc2.weight", &[1024, 1024]),
            ParamSpec::new("fc3.bias", &[10]),
            ParamSpec::new("fc3.weight", &[10, 1024]),
        ];
        let b = plan_buckets(&params, 1 << 20, 25 << 20);
        let names: Vec<Vec<&str>> = b
            .iter()
            .map(|b| {
                b.members
                    .iter()
                    .map(|m| params[m.param].name.as_str())
                    .collect()
            })
            .collect();
        assert_eq!(
            names,
            [
                vec!["fc3.weight", "fc3.bias", "fc2.weight"],
                vec!["fc2.bias", "fc1.weight", "fc1.bias"]
            ]
        );
        assert_eq!(b[0].len, 10 * 1024 + 10 + 1024 * 1024);
        assert_eq!(b[0].members[2].range, 10250..10250 + 1024 * 1024);
    }
}
