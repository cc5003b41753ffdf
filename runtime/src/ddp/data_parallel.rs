//! [`Ddp`]: the data-parallel replica of one rank.

use candle_core::backprop::GradStore;
use candle_core::Var;
use candle_nn::VarMap;

use super::bucket::{plan_buckets, BucketPlan};
use super::{DdpError, DdpOptions, DdpResult, StepMode};
use crate::buffer::Buffer;
use crate::collectives::{ReduceOp, Work};
use crate::optim::tensor_io::{hash_f32, update_f32, with_f32, HASH_START};
use crate::optim::{OptimError, Optimizer, ParamSpec};
use crate::process_group::ProcessGroup;

/// Sample counts travel as one f32 element: exact up to 2^24.
const MAX_SAMPLES: usize = 1 << 24;

/// What one [`Ddp::step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepReport {
    /// Samples of the step over all ranks (including those accumulated with `no_sync`).
    pub global_samples: u64,
    /// The samples this rank contributed.
    pub local_samples: u64,
    /// The number of buckets all-reduced.
    pub buckets: usize,
}

struct Bucket {
    plan: BucketPlan,
    /// The flat gradient buffer (plus the sample count in the first bucket); `None` while an
    /// all-reduce owns it or after one failed.
    grads: Option<Vec<f32>>,
}

/// One rank's replica: the model's variables sorted by name, the process group, and the
/// gradient buckets. See the [module docs](super).
pub struct Ddp {
    pg: ProcessGroup,
    options: DdpOptions,
    names: Vec<String>,
    vars: Vec<Var>,
    specs: Vec<ParamSpec>,
    buckets: Vec<Bucket>,
    /// Samples whose gradients `no_sync` accumulated into the buckets.
    pending: usize,
}

impl std::fmt::Debug for Ddp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ddp")
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .field("params", &self.names)
            .field("buckets", &self.buckets.len())
            .field("pending", &self.pending)
            .finish()
    }
}

impl Ddp {
    /// A replica over `varmap`'s variables: checks that every rank has the same parameter
    /// names and shapes, then broadcasts the parameters from rank 0 so every replica starts
    /// identical. Blocks on the collectives (each bounded by `options.timeout`).
    pub fn new(varmap: &VarMap, pg: ProcessGroup, options: DdpOptions) -> DdpResult<Self> {
        let rank = pg.rank();
        let mut named: Vec<(String, Var)> = match varmap.data().lock() {
            Ok(map) => map.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            Err(_) => {
                return Err(DdpError::InvalidArgument {
                    rank,
                    reason: "the VarMap's lock is poisoned".into(),
                })
            }
        };
        named.sort_by(|a, b| a.0.cmp(&b.0));
        Self::from_vars(named, pg, options)
    }

    /// [`Ddp::new`] with the parameters broadcast from `root` instead of rank 0: for a group
    /// re-formed after a failure, where the rank whose state survives need not be rank 0.
    pub fn with_root(
        varmap: &VarMap,
        pg: ProcessGroup,
        options: DdpOptions,
        root: usize,
    ) -> DdpResult<Self> {
        let rank = pg.rank();
        if root >= pg.world_size() {
            return Err(DdpError::InvalidArgument {
                rank,
                reason: format!(
                    "root {root} is not a rank of a group of {}",
                    pg.world_size()
                ),
            });
        }
        let named: Vec<(String, Var)> = match varmap.data().lock() {
            Ok(map) => map.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            Err(_) => {
                return Err(DdpError::InvalidArgument {
                    rank,
                    reason: "the VarMap's lock is poisoned".into(),
                })
            }
        };
        Self::build(named, pg, options, root)
    }

    /// A replica over named variables (any order; they are sorted by name). See [`Ddp::new`].
    pub fn from_vars(
        named: Vec<(String, Var)>,
        pg: ProcessGroup,
        options: DdpOptions,
    ) -> DdpResult<Self> {
        Self::build(named, pg, options, 0)
    }

    fn build(
        mut named: Vec<(String, Var)>,
        pg: ProcessGroup,
        options: DdpOptions,
        root: usize,
    ) -> DdpResult<Self> {
        let rank = pg.rank();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = named.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(DdpError::InvalidArgument {
                rank,
                reason: format!("parameter {:?} is listed twice", w[0].0),
            });
        }
        let bad_mb = |mb: f64| !(mb.is_finite() && mb > 0.0);
        if bad_mb(options.bucket_cap_mb) || bad_mb(options.first_bucket_mb) {
            return Err(DdpError::InvalidArgument {
                rank,
                reason: format!(
                    "bucket sizes must be positive, got first {} MiB cap {} MiB",
                    options.first_bucket_mb, options.bucket_cap_mb
                ),
            });
        }
        let specs: Vec<ParamSpec> = named
            .iter()
            .map(|(n, v)| ParamSpec::new(n.clone(), v.dims()))
            .collect();
        let mib = |mb: f64| (mb * (1 << 20) as f64) as usize;
        let buckets = plan_buckets(
            &specs,
            mib(options.first_bucket_mb),
            mib(options.bucket_cap_mb),
        )
        .into_iter()
        .map(|plan| Bucket { plan, grads: None })
        .collect();
        let (names, vars) = named.into_iter().unzip();
        let mut ddp = Ddp {
            pg,
            options,
            names,
            vars,
            specs,
            buckets,
            pending: 0,
        };
        ddp.check_layout()?;
        ddp.broadcast_parameters(root)?;
        Ok(ddp)
    }

    /// The parameters (sorted by name) as an optimizer must be built over them.
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        self.specs.clone()
    }

    /// The parameter names, sorted.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The variables, in name order.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The bucket layout.
    pub fn buckets(&self) -> Vec<&BucketPlan> {
        self.buckets.iter().map(|b| &b.plan).collect()
    }

    /// The process group.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// Replaces the process group (after the job re-formed with another membership). Gradients
    /// accumulated with `no_sync` are dropped; parameters are kept as they are (call
    /// [`broadcast_parameters`](Self::broadcast_parameters) to take them from a peer).
    pub fn set_process_group(&mut self, pg: ProcessGroup) {
        self.pg = pg;
        self.pending = 0;
    }

    /// The options.
    pub fn options(&self) -> &DdpOptions {
        &self.options
    }

    fn rank(&self) -> usize {
        self.pg.rank()
    }

    fn tensor_err(&self, param: usize, e: impl std::fmt::Display) -> DdpError {
        DdpError::Tensor {
            rank: self.rank(),
            param: self.names[param].clone(),
            message: e.to_string(),
        }
    }

    fn wait(&self, work: Work, during: &'static str) -> DdpResult<Buffer> {
        work.wait(self.options.timeout)
            .map_err(|source| DdpError::Collective {
                rank: self.rank(),
                during,
                source,
            })
    }

    /// Every rank's `(min, max)` of a 62-bit value, in one all-reduce.
    fn min_max(&self, value: u64, during: &'static str) -> DdpResult<(u64, u64)> {
        let v = (value >> 2) as i64;
        let work = self.pg.all_reduce(Buffer::from(vec![v, -v]), ReduceOp::Max);
        let out = self.wait(work, during)?;
        match out.as_slice::<i64>() {
            Some(&[max, neg_min]) => Ok(((-neg_min) as u64, max as u64)),
            _ => Err(DdpError::Collective {
                rank: self.rank(),
                during,
                source: crate::Error::InvalidArgument {
                    op: "all_reduce",
                    reason: format!("expected 2 i64 back, got {:?} x{}", out.dtype(), out.len()),
                },
            }),
        }
    }

    fn check_layout(&self) -> DdpResult<()> {
        let mut h = HASH_START;
        for s in &self.specs {
            for b in s.name.bytes() {
                h = hash_f32(h, &[f32::from_bits(u32::from(b))]);
            }
            for &d in &s.shape {
                h = hash_f32(
                    h,
                    &[f32::from_bits(d as u32), f32::from_bits((d >> 32) as u32)],
                );
            }
            h = hash_f32(h, &[f32::from_bits(u32::MAX)]);
        }
        let (min, max) = self.min_max(h, "parameter layout check")?;
        if min != max {
            return Err(DdpError::LayoutMismatch {
                rank: self.rank(),
                reason: format!(
                    "{} parameters here ({:?}); layout fingerprints range {min:#x}..{max:#x}",
                    self.specs.len(),
                    self.names
                ),
            });
        }
        Ok(())
    }

    /// Overwrites every rank's parameters with `root`'s, bucket by bucket (all broadcasts are
    /// issued before the first wait). Optimizer state is not touched.
    pub fn broadcast_parameters(&mut self, root: usize) -> DdpResult<()> {
        let is_root = self.rank() == root;
        let mut works = Vec::with_capacity(self.buckets.len());
        for bucket in &self.buckets {
            let mut flat = vec![0.0f32; bucket.plan.len];
            if is_root {
                for m in &bucket.plan.members {
                    with_f32(self.vars[m.param].as_tensor(), |src| {
                        flat[m.range.clone()].copy_from_slice(src)
                    })
                    .map_err(|e| self.tensor_err(m.param, e))?;
                }
            }
            works.push(self.pg.broadcast(Buffer::from(flat), root));
        }
        for (b, work) in works.into_iter().enumerate() {
            let flat = self.wait(work, "parameter broadcast")?;
            if is_root {
                continue;
            }
            let flat = flat.as_slice::<f32>().unwrap_or_default();
            let plan = &self.buckets[b].plan;
            if flat.len() != plan.len {
                return Err(DdpError::LayoutMismatch {
                    rank: self.rank(),
                    reason: format!(
                        "bucket {b} came back with {} elements, expected {}",
                        flat.len(),
                        plan.len
                    ),
                });
            }
            for m in &plan.members {
                update_f32(&self.vars[m.param], |dst| {
                    dst.copy_from_slice(&flat[m.range.clone()]);
                    Ok(())
                })
                .map_err(|e| self.tensor_err(m.param, e))?;
            }
        }
        Ok(())
    }

    /// A fingerprint of this rank's parameters (a 64-bit hash of their bits, in name order).
    pub fn params_fingerprint(&self) -> DdpResult<u64> {
        let mut h = HASH_START;
        for (i, v) in self.vars.iter().enumerate() {
            h = with_f32(v.as_tensor(), |x| hash_f32(h, x)).map_err(|e| self.tensor_err(i, e))?;
        }
        Ok(h)
    }

    /// Checks that every rank's parameters are bit-identical (one small all-reduce of the
    /// fingerprints' minimum and maximum); returns the common fingerprint (its 62 high bits).
    pub fn check_parameters(&self) -> DdpResult<u64> {
        let local = self.params_fingerprint()?;
        let (min, max) = self.min_max(local, "parameter agreement check")?;
        if min != max {
            return Err(DdpError::ParamsDiverged {
                rank: self.rank(),
                local: local >> 2,
                min,
                max,
            });
        }
        Ok(min)
    }

    /// Flattens `grads` (scaled by `n`) into bucket `b`'s buffer, adding to what `no_sync`
    /// left there when `accumulate`. A parameter without a gradient contributes zeros.
    fn flatten(
        &mut self,
        b: usize,
        grads: Option<&GradStore>,
        n: usize,
        accumulate: bool,
    ) -> DdpResult<Vec<f32>> {
        let rank = self.rank();
        let len = self.buckets[b].plan.len + usize::from(b == 0);
        let mut buf = match self.buckets[b].grads.take() {
            Some(v) if v.len() == len => v,
            _ => vec![0.0; len],
        };
        let scale = n as f32;
        for m in &self.buckets[b].plan.members {
            let dst = &mut buf[m.range.clone()];
            let grad = grads.and_then(|g| g.get(self.vars[m.param].as_tensor()));
            let Some(grad) = grad else {
                if !accumulate {
                    dst.fill(0.0);
                }
                continue;
            };
            let copied = with_f32(grad, |src| {
                if src.len() != dst.len() {
                    return false;
                }
                match (accumulate, n) {
                    (false, 1) => dst.copy_from_slice(src),
                    (false, _) => dst.iter_mut().zip(src).for_each(|(d, s)| *d = s * scale),
                    (true, _) => dst.iter_mut().zip(src).for_each(|(d, s)| *d += s * scale),
                }
                true
            })
            .map_err(|e| DdpError::Tensor {
                rank,
                param: self.names[m.param].clone(),
                message: e.to_string(),
            })?;
            if !copied {
                return Err(DdpError::InvalidArgument {
                    rank,
                    reason: format!(
                        "the gradient of {:?} does not have the parameter's {} elements",
                        self.names[m.param],
                        dst.len()
                    ),
                });
            }
        }
        Ok(buf)
    }

    fn check_samples(&self, n_local: usize) -> DdpResult<usize> {
        let total = self.pending + n_local;
        if total > MAX_SAMPLES {
            return Err(DdpError::InvalidArgument {
                rank: self.rank(),
                reason: format!("{total} samples in one step is more than {MAX_SAMPLES}"),
            });
        }
        Ok(total)
    }

    /// Gradient accumulation without communication (torch's `no_sync`): adds `grads`, weighted
    /// by their `n_local` samples, to what the next [`step`](Self::step) all-reduces. `grads`
    /// must be of a loss averaged over those `n_local` samples.
    pub fn no_sync(&mut self, grads: &GradStore, n_local: usize) -> DdpResult<()> {
        let total = self.check_samples(n_local)?;
        let accumulate = self.pending > 0;
        for b in 0..self.buckets.len() {
            let buf = self.flatten(b, Some(grads), n_local, accumulate)?;
            self.buckets[b].grads = Some(buf);
        }
        self.pending = total;
        Ok(())
    }

    /// One synchronous training step: all-reduces the gradients and updates the parameters
    /// through `optimizer` (which must be over [`param_specs`](Self::param_specs)).
    ///
    /// `grads` are of a loss averaged over this rank's `n_local` samples, or `None` when the
    /// rank has no samples this step (it still takes part in the all-reduces). The update uses
    /// the sample-weighted mean `sum_r n_r * grad_r / sum_r n_r` over ranks, plus anything
    /// accumulated with [`no_sync`](Self::no_sync) since the last step.
    ///
    /// On error (a collective failed, no rank had samples) the accumulated gradients are
    /// dropped; in [`StepMode::Atomic`] the parameters and the optimizer are unchanged.
    pub fn step(
        &mut self,
        grads: Option<&GradStore>,
        n_local: usize,
        optimizer: &mut dyn Optimizer,
    ) -> DdpResult<StepReport> {
        let rank = self.rank();
        if optimizer.params() != self.specs.as_slice() {
            return Err(DdpError::InvalidArgument {
                rank,
                reason: "the optimizer is not over this model's parameters (name order)".into(),
            });
        }
        let local = self.check_samples(n_local)?;
        let accumulate = self.pending > 0;
        self.pending = 0;
        let grads = if n_local == 0 { None } else { grads };

        // Flatten bucket k and issue its all-reduce before flattening bucket k + 1.
        let mut works = Vec::with_capacity(self.buckets.len());
        for b in 0..self.buckets.len() {
            let mut buf = self.flatten(b, grads, n_local, accumulate)?;
            if b == 0 {
                let count_at = self.buckets[0].plan.len;
                buf[count_at] = local as f32;
            }
            works.push(self.pg.all_reduce(Buffer::from(buf), ReduceOp::Sum));
        }
        let buckets = works.len();
        if buckets == 0 {
            optimizer.begin_step();
            return Ok(StepReport {
                global_samples: local as u64,
                local_samples: local as u64,
                buckets,
            });
        }

        let mut global = 0usize;
        match self.options.mode {
            StepMode::Atomic => {
                let mut reduced = Vec::with_capacity(buckets);
                for work in works {
                    reduced.push(self.reduced(work)?);
                }
                global = self.global_count(&reduced[0])?;
                optimizer.begin_step();
                for (b, buf) in reduced.into_iter().enumerate() {
                    self.apply(b, buf, global, optimizer)?;
                }
            }
            StepMode::Overlapped => {
                for (b, work) in works.into_iter().enumerate() {
                    let buf = self.reduced(work)?;
                    if b == 0 {
                        global = self.global_count(&buf)?;
                        optimizer.begin_step();
                    }
                    self.apply(b, buf, global, optimizer)?;
                }
            }
        }
        Ok(StepReport {
            global_samples: global as u64,
            local_samples: local as u64,
            buckets,
        })
    }

    fn reduced(&self, work: Work) -> DdpResult<Vec<f32>> {
        self.wait(work, "gradient all-reduce")?
            .into_vec::<f32>()
            .map_err(|b| DdpError::Collective {
                rank: self.rank(),
                during: "gradient all-reduce",
                source: crate::Error::InvalidArgument {
                    op: "all_reduce",
                    reason: format!("expected f32 back, got {:?}", b.dtype()),
                },
            })
    }

    fn global_count(&self, first: &[f32]) -> DdpResult<usize> {
        let count = first.get(self.buckets[0].plan.len).copied().unwrap_or(0.0);
        if count < 0.5 {
            return Err(DdpError::NoSamples { rank: self.rank() });
        }
        Ok(count as usize)
    }

    /// Updates bucket `b`'s parameters in place from its reduced gradients divided by the
    /// global count, and keeps the buffer for the next step.
    fn apply(
        &mut self,
        b: usize,
        buf: Vec<f32>,
        global: usize,
        optimizer: &mut dyn Optimizer,
    ) -> DdpResult<()> {
        let plan_len = self.buckets[b].plan.len;
        if buf.len() != plan_len + usize::from(b == 0) {
            return Err(DdpError::InvalidArgument {
                rank: self.rank(),
                reason: format!("bucket {b} came back with {} elements", buf.len()),
            });
        }
        // The average is folded into the update: one pass over the gradients fewer.
        let scale = (1.0 / global as f64) as f32;
        let mut opt_err: Option<OptimError> = None;
        for m in &self.buckets[b].plan.members {
            let grad = &buf[m.range.clone()];
            update_f32(&self.vars[m.param], |p| {
                if let Err(e) = optimizer.update_scaled(m.param, p, grad, scale) {
                    opt_err = Some(e);
                }
                Ok(())
            })
            .map_err(|e| DdpError::Tensor {
                rank: self.pg.rank(),
                param: self.names[m.param].clone(),
                message: e.to_string(),
            })?;
            if let Some(e) = opt_err.take() {
                return Err(e.into());
            }
        }
        self.buckets[b].grads = Some(buf);
        Ok(())
    }
}
