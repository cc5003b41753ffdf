//! Closed-form inputs and expected results for checking collectives, shared by the test suite
//! and `collectives_perf -c 1`. Every value is a small integer, exact in every dtype (u8 and
//! bf16 included) for world sizes up to 8.

use crate::collectives::ReduceOp;
use crate::dtype::DType;

/// The value rank `rank` holds at element `i` for data-movement operations.
pub fn value(rank: usize, i: usize) -> f64 {
    ((rank * 31 + i) % 97) as f64
}

/// The input of rank `rank` at element `i` for a reduction with `op`.
pub fn reduce_input(op: ReduceOp, rank: usize, i: usize) -> f64 {
    match op {
        ReduceOp::Prod => 1.0 + ((rank + i) % 2) as f64,
        _ => ((rank + 1) * (i % 7 + 1)) as f64,
    }
}

/// The reduction with `op` over `world` ranks of [`reduce_input`] at element `i`.
pub fn reduce_expected(op: ReduceOp, dtype: DType, world: usize, i: usize) -> f64 {
    let k = (i % 7 + 1) as f64;
    let sum = k * (world * (world + 1) / 2) as f64;
    match op {
        ReduceOp::Sum => sum,
        ReduceOp::Prod => (0..world).map(|r| 1.0 + ((r + i) % 2) as f64).product(),
        ReduceOp::Min => k,
        ReduceOp::Max => k * world as f64,
        ReduceOp::Avg if dtype.is_float() => sum / world as f64,
        ReduceOp::Avg => (sum as i64 / world as i64) as f64,
    }
}
