//! [`ShardMap`]: which server holds which parameters. A pure function of the parameters
//! (sorted by name), the number of servers and the smallest tensor that may be split, so every
//! rank computes the same map without talking.
//!
//! The parameters, in name order, are laid end to end as one flat range of `P` elements and
//! cut into `K` contiguous parts of `P / K` elements (the first `P % K` one longer), so every
//! server moves the same number of bytes per step. A cut that falls inside a tensor of fewer
//! than `min_split` elements moves to that tensor's nearer edge (the start on a tie), so small
//! tensors stay whole and only large ones are split. A tensor may be split over several
//! servers; a server may hold no piece at all when there are more servers than large tensors
//! can fill.

use std::ops::Range;

use rekindle_runtime::optim::ParamSpec;

/// A contiguous element range of one parameter, held by one server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The parameter's index in name order.
    pub param: usize,
    /// The elements of the (flattened) parameter.
    pub range: Range<usize>,
}

/// The parameters' placement over the servers. See the [module docs](self).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardMap {
    specs: Vec<ParamSpec>,
    shards: Vec<Vec<Piece>>,
}

/// Why a map cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardMapError {
    /// No servers.
    #[error("a parameter server needs at least one server")]
    NoServers,
    /// The parameters are not sorted by name, or a name repeats.
    #[error("the parameters must be sorted by name without repeats ({name:?} is out of order)")]
    Unsorted {
        /// The first name out of order.
        name: String,
    },
}

impl ShardMap {
    /// The map of `specs` (sorted by name) over `servers` servers.
    pub fn new(
        specs: &[ParamSpec],
        servers: usize,
        min_split: usize,
    ) -> Result<ShardMap, ShardMapError> {
        if servers == 0 {
            return Err(ShardMapError::NoServers);
        }
        if let Some(w) = specs.windows(2).find(|w| w[0].name >= w[1].name) {
            return Err(ShardMapError::Unsorted {
                name: w[1].name.clone(),
            });
        }
        // Where each parameter starts in the flat range.
        let mut starts = Vec::with_capacity(specs.len() + 1);
        let mut total = 0usize;
        for s in specs {
            starts.push(total);
            total += s.len();
        }
        starts.push(total);
        // Balanced cuts, each moved out of a small tensor it falls into.
        let mut cuts = vec![0usize];
        for k in 1..servers {
            let mut c = rekindle_runtime::collectives::segment(total, servers, k).start;
            if let Some(p) = (0..specs.len()).find(|&p| starts[p] < c && c < starts[p + 1]) {
                let (a, b) = (starts[p], starts[p + 1]);
                if b - a < min_split {
                    c = if c - a <= b - c { a } else { b };
                }
            }
            let prev = cuts[k - 1];
            cuts.push(c.max(prev));
        }
        cuts.push(total);
        let shards = (0..servers)
            .map(|k| {
                let (lo, hi) = (cuts[k], cuts[k + 1]);
                (0..specs.len())
                    .filter_map(|p| {
                        let (a, b) = (starts[p].max(lo), starts[p + 1].min(hi));
                        (a < b).then(|| Piece {
                            param: p,
                            range: a - starts[p]..b - starts[p],
                        })
                    })
                    .collect()
            })
            .collect();
        Ok(ShardMap {
            specs: specs.to_vec(),
            shards,
        })
    }

    /// The number of servers.
    pub fn servers(&self) -> usize {
        self.shards.len()
    }

    /// The parameters, in name order.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// The pieces server `k` holds, in name order and then element order.
    pub fn pieces(&self, k: usize) -> &[Piece] {
        self.shards.get(k).map_or(&[], Vec::as_slice)
    }

    /// The number of elements server `k` holds.
    pub fn shard_len(&self, k: usize) -> usize {
        self.pieces(k).iter().map(|p| p.range.len()).sum()
    }

    /// True when `piece` is its whole parameter.
    pub fn is_whole(&self, piece: &Piece) -> bool {
        piece.range.start == 0 && piece.range.end == self.specs[piece.param].len()
    }

    /// The name of a piece: the parameter's name when it is whole, `name[a..b]` otherwise.
    pub fn piece_name(&self, piece: &Piece) -> String {
        let name = &self.specs[piece.param].name;
        if self.is_whole(piece) {
            name.clone()
        } else {
            format!("{name}[{}..{}]", piece.range.start, piece.range.end)
        }
    }

    /// The shape of a piece: the parameter's when whole, flat otherwise.
    pub fn piece_shape(&self, piece: &Piece) -> Vec<usize> {
        if self.is_whole(piece) {
            self.specs[piece.param].shape.clone()
        } else {
            vec![piece.range.len()]
        }
    }

    /// The optimizer's view of server `k`'s shard: one parameter per piece.
    pub fn piece_specs(&self, k: usize) -> Vec<ParamSpec> {
        self.pieces(k)
            .iter()
            .map(|p| ParamSpec::new(self.piece_name(p), &self.piece_shape(p)))
            .collect()
    }

    /// The server that writes parameter `param` whole into a checkpoint: the first server
    /// holding a piece of it.
    pub fn writer(&self, param: usize) -> usize {
        (0..self.servers())
            .find(|&k| self.pieces(k).iter().any(|p| p.param == param))
            .unwrap_or(0)
    }

    /// The parameters split over more than one server.
    pub fn split_params(&self) -> Vec<usize> {
        (0..self.specs.len())
            .filter(|&p| {
                (0..self.servers())
                    .filter(|&k| self.pieces(k).iter().any(|x| x.param == p))
                    .count()
                    > 1
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs(sizes: &[(&str, usize)]) -> Vec<ParamSpec> {
        sizes
            .iter()
            .map(|(n, s)| ParamSpec::new(*n, &[*s]))
            .collect()
    }

    /// Every server's pieces as (name, start, end).
    fn layout(m: &ShardMap) -> Vec<Vec<(String, usize, usize)>> {
        (0..m.servers())
            .map(|k| {
                m.pieces(k)
                    .iter()
                    .map(|p| (m.specs()[p.param].name.clone(), p.range.start, p.range.end))
                    .collect()
            })
            .collect()
    }

    /// Each server's pieces: (parameter name, start, end).
    type Layout = Vec<Vec<(String, usize, usize)>>;

    fn l(v: &[&[(&str, usize, usize)]]) -> Layout {
        v.iter()
            .map(|s| s.iter().map(|(n, a, b)| (n.to_string(), *a, *b)).collect())
            .collect()
    }

    #[test]
    fn maps_by_table() {
        let a = specs(&[("a", 100), ("b", 10), ("c", 90)]);
        let cases: Vec<(Vec<ParamSpec>, usize, usize, Layout)> = vec![
            // One server holds everything, whole.
            (
                a.clone(),
                1,
                0,
                l(&[&[("a", 0, 100), ("b", 0, 10), ("c", 0, 90)]]),
            ),
            // Two servers cut at 100: on a boundary, nothing split.
            (
                a.clone(),
                2,
                0,
                l(&[&[("a", 0, 100)], &[("b", 0, 10), ("c", 0, 90)]]),
            ),
            // Three servers: cuts at 67 (in a, 100 >= min_split 50: split) and 134 (in c).
            (
                a.clone(),
                3,
                50,
                l(&[
                    &[("a", 0, 67)],
                    &[("a", 67, 100), ("b", 0, 10), ("c", 0, 24)],
                    &[("c", 24, 90)],
                ]),
            ),
            // The same with min_split 101: a and c stay whole; 67 moves to a's end (100),
            // 134 to c's start (110, nearer than 200).
            (
                a.clone(),
                3,
                101,
                l(&[&[("a", 0, 100)], &[("b", 0, 10)], &[("c", 0, 90)]]),
            ),
            // More servers than elements: empty shards at the end.
            (
                specs(&[("x", 2)]),
                3,
                0,
                l(&[&[("x", 0, 1)], &[("x", 1, 2)], &[]]),
            ),
            // A small tensor cut in its middle: the tie goes to its start.
            (specs(&[("x", 4)]), 2, 5, l(&[&[], &[("x", 0, 4)]])),
        ];
        for (i, (s, k, min, want)) in cases.into_iter().enumerate() {
            let m = ShardMap::new(&s, k, min).unwrap();
            assert_eq!(layout(&m), want, "case {i}");
            let total: usize = (0..k).map(|j| m.shard_len(j)).sum();
            assert_eq!(
                total,
                s.iter().map(ParamSpec::len).sum::<usize>(),
                "case {i}"
            );
        }
    }

    #[test]
    fn balanced_when_everything_may_split() {
        let s = specs(&[("a", 1000), ("b", 7), ("c", 333), ("d", 4096)]);
        for k in 1..=6 {
            let m = ShardMap::new(&s, k, 0).unwrap();
            let lens: Vec<usize> = (0..k).map(|j| m.shard_len(j)).collect();
            let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
            assert!(hi - lo <= 1, "{k} servers: {lens:?}");
        }
    }

    #[test]
    fn names_shapes_writers_and_splits() {
        let s = vec![
            ParamSpec::new("fc1.bias", &[4]),
            ParamSpec::new("fc1.weight", &[4, 8]),
        ];
        let m = ShardMap::new(&s, 2, 16).unwrap();
        // Total 36, cut at 18: inside fc1.weight (32 >= 16 elements): split at 14.
        assert_eq!(m.piece_specs(0)[0], ParamSpec::new("fc1.bias", &[4]));
        assert_eq!(
            m.piece_specs(0)[1],
            ParamSpec::new("fc1.weight[0..14]", &[14])
        );
        assert_eq!(
            m.piece_specs(1),
            vec![ParamSpec::new("fc1.weight[14..32]", &[18])]
        );
        assert_eq!(m.writer(0), 0);
        assert_eq!(m.writer(1), 0);
        assert_eq!(m.split_params(), vec![1]);
        assert_eq!(
            ShardMap::new(&s, 0, 0),
            Err(ShardMapError::NoServers),
            "no servers"
        );
        let unsorted = vec![ParamSpec::new("b", &[1]), ParamSpec::new("a", &[1])];
        assert!(matches!(
            ShardMap::new(&unsorted, 1, 0),
            Err(ShardMapError::Unsorted { .. })
        ));
    }
}
