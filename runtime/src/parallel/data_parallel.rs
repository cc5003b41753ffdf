//! [`DataParallel`]: one model replicated over several devices of one process.

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::VarMap;
use std::time::{Duration, Instant};

use super::ParallelError;

/// The split of a batch of `n` samples over `replicas` like torch's `scatter` (which uses
/// `Tensor.chunk`): chunks of `ceil(n / replicas)`, the last ones smaller or empty.
///
/// ```
/// use rekindle_runtime::parallel::chunk_sizes;
/// assert_eq!(chunk_sizes(10, 3), vec![4, 4, 2]);
/// assert_eq!(chunk_sizes(5, 4), vec![2, 2, 1, 0]);
/// ```
pub fn chunk_sizes(n: usize, replicas: usize) -> Vec<usize> {
    if replicas == 0 {
        return Vec::new();
    }
    let chunk = n.div_ceil(replicas);
    (0..replicas)
        .map(|r| n.saturating_sub(r * chunk).min(chunk))
        .collect()
}

/// What one [`DataParallel::forward_backward`] computed.
#[derive(Debug)]
pub struct DpStep {
    /// The gradients of the batch's mean loss, for the first replica's variables (the model's
    /// own, see [`DataParallel::varmap`]), on the first device.
    pub grads: GradStore,
    /// The batch's mean loss.
    pub loss: f32,
    /// The samples of the batch.
    pub samples: usize,
    /// The samples each replica computed.
    pub per_replica: Vec<usize>,
    /// The parallel part: copying the parameters, scattering the batch, and the forward and
    /// backward passes, until the last replica finished.
    pub compute: Duration,
    /// Summing the replicas' gradients on the first device.
    pub reduce: Duration,
}

/// What one replica's thread returns: its chunk's mean loss and its gradients (already weighted
/// by its share of the samples), one per variable in name order, on the first device.
struct ReplicaOut {
    loss: f32,
    grads: Vec<Option<Tensor>>,
}

/// Copies `from`'s parameters into `to`'s variables (on `to`'s device).
fn copy_params<M>(from: &Replica<M>, to: &Replica<M>) -> candle_core::Result<()> {
    for ((_, src), (_, dst)) in from.vars.iter().zip(&to.vars) {
        dst.set(&src.as_tensor().to_device(&to.device)?)?;
    }
    Ok(())
}

/// A variable's index and its summed gradient (none if no replica produced one).
type Summed = (usize, Option<Tensor>);

/// Sums the replicas' gradients of every variable, always in replica order (so the result does
/// not depend on the threads), with the variables shared out over up to one thread per replica,
/// balanced by element count.
fn reduce(
    vars: &[(String, Var)],
    per: &[Option<ReplicaOut>],
) -> Result<Vec<Option<Tensor>>, ParallelError> {
    let outs: Vec<&ReplicaOut> = per.iter().flatten().collect();
    if let [only] = outs.as_slice() {
        return Ok(only.grads.clone());
    }
    let sum_one = |p: usize| -> Result<Option<Tensor>, ParallelError> {
        let mut acc: Option<Tensor> = None;
        for (i, out) in per.iter().enumerate() {
            let Some(g) = out.as_ref().and_then(|o| o.grads[p].as_ref()) else {
                continue;
            };
            acc = Some(match acc {
                None => g.clone(),
                Some(a) => (a + g).map_err(|source| ParallelError::Tensor {
                    replica: i,
                    during: "reducing the gradients",
                    source,
                })?,
            });
        }
        Ok(acc)
    };
    let workers = outs.len().min(vars.len()).max(1);
    // Largest first onto the least loaded worker.
    let mut order: Vec<usize> = (0..vars.len()).collect();
    order.sort_by_key(|&p| std::cmp::Reverse(vars[p].1.elem_count()));
    let mut load = vec![0usize; workers];
    let mut share: Vec<Vec<usize>> = vec![Vec::new(); workers];
    for p in order {
        let w = (0..workers).min_by_key(|&w| load[w]).unwrap_or(0);
        load[w] += vars[p].1.elem_count();
        share[w].push(p);
    }
    let sum_one = &sum_one;
    let parts: Vec<Result<Vec<Summed>, ParallelError>> = std::thread::scope(|s| {
        let handles: Vec<_> = share
            .iter()
            .map(|ps| {
                s.spawn(move || {
                    ps.iter()
                        .map(|&p| sum_one(p).map(|g| (p, g)))
                        .collect::<Result<Vec<_>, _>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or(Err(ParallelError::Panicked { replica: 0 }))
            })
            .collect()
    });
    let mut summed: Vec<Option<Tensor>> = vec![None; vars.len()];
    for part in parts {
        for (p, g) in part? {
            summed[p] = g;
        }
    }
    Ok(summed)
}

struct Replica<M> {
    device: Device,
    /// The variables sorted by name.
    vars: Vec<(String, Var)>,
    model: M,
}

fn sorted_vars(varmap: &VarMap) -> Result<Vec<(String, Var)>, ParallelError> {
    let data = varmap
        .data()
        .lock()
        .map_err(|_| ParallelError::InvalidArgument {
            reason: "a VarMap's lock is poisoned".into(),
        })?;
    let mut vars: Vec<(String, Var)> = data.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(vars)
}

/// A model replicated over several devices of one process (torch's `nn.DataParallel`).
///
/// Each [`forward_backward`](Self::forward_backward): the batch is split along dimension 0
/// ([`chunk_sizes`]); every replica, in a thread of its own, copies the first replica's
/// parameters, runs forward on its chunk, scales its loss by its share of the samples (so
/// uneven chunks give the gradient of the whole batch's mean loss) and runs backward; the
/// gradients are summed onto the first device, always in replica order, so the result is the
/// same from run to run. On the CPU see [`keep_freed_memory`](super::keep_freed_memory). One optimizer then updates the first replica's
/// variables ([`varmap`](Self::varmap)), which are also what a checkpoint saves: the names
/// carry no `module.` prefix, and a PyTorch `DataParallel` state dict, whose keys do, loads
/// into them (the storage crate strips it).
pub struct DataParallel<M> {
    varmap: VarMap,
    replicas: Vec<Replica<M>>,
}

impl<M> std::fmt::Debug for DataParallel<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallel")
            .field(
                "devices",
                &self.replicas.iter().map(|r| &r.device).collect::<Vec<_>>(),
            )
            .field("params", &self.replicas.first().map_or(0, |r| r.vars.len()))
            .finish()
    }
}

impl<M: Sync> DataParallel<M> {
    /// One replica per device, each built by `build(varmap, device)`, which must create the
    /// model's variables in the (empty) `varmap` on `device`. The first device's replica holds
    /// the model's parameters; the others start as copies of them.
    pub fn new<E: std::fmt::Display>(
        devices: Vec<Device>,
        mut build: impl FnMut(&VarMap, &Device) -> Result<M, E>,
    ) -> Result<DataParallel<M>, ParallelError> {
        if devices.is_empty() {
            return Err(ParallelError::InvalidArgument {
                reason: "DataParallel needs at least one device".into(),
            });
        }
        let mut first = None;
        let mut replicas = Vec::with_capacity(devices.len());
        for (i, device) in devices.into_iter().enumerate() {
            let varmap = VarMap::new();
            let model = build(&varmap, &device).map_err(|e| ParallelError::Build {
                what: format!("replica {i} on {device:?}"),
                message: e.to_string(),
            })?;
            let vars = sorted_vars(&varmap)?;
            if let Some(r0) = replicas.first() {
                let r0: &Replica<M> = r0;
                let same = r0.vars.len() == vars.len()
                    && r0
                        .vars
                        .iter()
                        .zip(&vars)
                        .all(|((a, va), (b, vb))| a == b && va.dims() == vb.dims());
                if !same {
                    return Err(ParallelError::InvalidArgument {
                        reason: format!(
                            "replica {i} has other parameters than replica 0 (the builder must \
                             create the same variables on every device)"
                        ),
                    });
                }
            }
            if i == 0 {
                first = Some(varmap);
            }
            replicas.push(Replica {
                device,
                vars,
                model,
            });
        }
        let dp = DataParallel {
            varmap: first.unwrap_or_else(VarMap::new),
            replicas,
        };
        dp.replicate()?;
        Ok(dp)
    }

    /// The first replica's variables: the model's parameters.
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// The first replica's model.
    pub fn module(&self) -> &M {
        &self.replicas[0].model
    }

    /// The devices, first replica first.
    pub fn devices(&self) -> Vec<&Device> {
        self.replicas.iter().map(|r| &r.device).collect()
    }

    /// Copies the first replica's parameters to every other replica.
    pub fn replicate(&self) -> Result<(), ParallelError> {
        let (first, rest) = self.replicas.split_at(1);
        for (i, replica) in rest.iter().enumerate() {
            copy_params(&first[0], replica).map_err(|source| ParallelError::Tensor {
                replica: i + 1,
                during: "copying the parameters",
                source,
            })?;
        }
        Ok(())
    }

    /// One forward and backward pass of the batch `(x, y)` (split along dimension 0) on every
    /// replica in parallel; `loss(model, x, y)` must return the mean loss of its chunk, as a
    /// scalar. Returns the gradients of the whole batch's mean loss on the first device.
    pub fn forward_backward<F>(
        &self,
        x: &Tensor,
        y: &Tensor,
        loss: F,
    ) -> Result<DpStep, ParallelError>
    where
        F: Fn(&M, &Tensor, &Tensor) -> candle_core::Result<Tensor> + Sync,
    {
        let tensor_err = |replica: usize, during: &'static str| {
            move |source| ParallelError::Tensor {
                replica,
                during,
                source,
            }
        };
        let n = x.dim(0).map_err(tensor_err(0, "reading the batch size"))?;
        if y.dim(0).map_err(tensor_err(0, "reading the labels"))? != n {
            return Err(ParallelError::InvalidArgument {
                reason: "inputs and labels have different batch sizes".into(),
            });
        }
        if n == 0 {
            return Err(ParallelError::InvalidArgument {
                reason: "an empty batch".into(),
            });
        }
        let sizes = chunk_sizes(n, self.replicas.len());
        let loss = &loss;
        let first = &self.replicas[0];
        let dev0 = &first.device;
        let started = Instant::now();
        // Every replica's (loss, gradients of its variables in name order, on the first
        // device), in replica order. Each replica copies the first one's parameters in its own
        // thread, so the copies overlap the first replica's forward pass; each scales its loss
        // by its share of the samples before the backward pass, so its gradients arrive
        // weighted and the reduction is a plain sum.
        let results: Vec<Result<Option<ReplicaOut>, ParallelError>> = std::thread::scope(|s| {
            let mut start = 0;
            let handles: Vec<_> = self
                .replicas
                .iter()
                .zip(&sizes)
                .enumerate()
                .map(|(i, (replica, &len))| {
                    let from = start;
                    start += len;
                    s.spawn(move || -> Result<Option<ReplicaOut>, ParallelError> {
                        if i > 0 {
                            copy_params(first, replica)
                                .map_err(tensor_err(i, "copying the parameters"))?;
                        }
                        if len == 0 {
                            return Ok(None);
                        }
                        let xi = x
                            .narrow(0, from, len)
                            .and_then(|t| t.to_device(&replica.device))
                            .map_err(tensor_err(i, "scattering the inputs"))?;
                        let yi = y
                            .narrow(0, from, len)
                            .and_then(|t| t.to_device(&replica.device))
                            .map_err(tensor_err(i, "scattering the labels"))?;
                        let l = loss(&replica.model, &xi, &yi)
                            .map_err(tensor_err(i, "the forward pass"))?;
                        let value = l
                            .to_dtype(candle_core::DType::F32)
                            .and_then(|l| l.to_scalar::<f32>())
                            .map_err(tensor_err(i, "reading the loss"))?;
                        let weight = len as f64 / n as f64;
                        let scaled = if len == n {
                            l
                        } else {
                            l.affine(weight, 0.0)
                                .map_err(tensor_err(i, "weighting the loss"))?
                        };
                        let store = scaled
                            .backward()
                            .map_err(tensor_err(i, "the backward pass"))?;
                        let grads = replica
                            .vars
                            .iter()
                            .map(|(_, v)| {
                                store
                                    .get(v.as_tensor())
                                    .map(|g| g.to_device(dev0))
                                    .transpose()
                            })
                            .collect::<candle_core::Result<Vec<_>>>()
                            .map_err(tensor_err(i, "gathering the gradients"))?;
                        Ok(Some(ReplicaOut { loss: value, grads }))
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(i, h)| {
                    h.join()
                        .unwrap_or(Err(ParallelError::Panicked { replica: i }))
                })
                .collect()
        });
        let mut per = Vec::with_capacity(results.len());
        for r in results {
            per.push(r?);
        }
        let computed = Instant::now();
        let total_loss: f64 = per
            .iter()
            .zip(&sizes)
            .filter_map(|(out, &len)| out.as_ref().map(|o| o.loss as f64 * len as f64 / n as f64))
            .sum();
        let summed = reduce(&first.vars, &per)?;
        let mut grads = GradStore::default();
        for ((name, var0), g) in first.vars.iter().zip(summed) {
            match g {
                Some(g) => {
                    grads.insert(var0.as_tensor(), g);
                }
                None => tracing::debug!(param = %name, "no replica produced a gradient"),
            }
        }
        let reduced = Instant::now();
        Ok(DpStep {
            grads,
            loss: total_loss as f32,
            samples: n,
            per_replica: sizes,
            compute: computed - started,
            reduce: reduced - computed,
        })
    }
}
