//! [`DataParallel`]: one model replicated over several devices of one process.

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::VarMap;

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
/// Each [`forward_backward`](Self::forward_backward): the first replica's parameters are
/// copied to the others; the batch is split along dimension 0 ([`chunk_sizes`]); every replica
/// runs forward and backward on its chunk in a thread of its own; the gradients are reduced
/// onto the first device, each replica's weighted by its share of the samples (so uneven
/// chunks give the gradient of the whole batch's mean loss), always in replica order, so the
/// result is the same from run to run. One optimizer then updates the first replica's
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
            for ((_, src), (_, dst)) in first[0].vars.iter().zip(&replica.vars) {
                src.as_tensor()
                    .to_device(&replica.device)
                    .and_then(|t| dst.set(&t))
                    .map_err(|source| ParallelError::Tensor {
                        replica: i + 1,
                        during: "copying the parameters",
                        source,
                    })?;
            }
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
        self.replicate()?;
        let sizes = chunk_sizes(n, self.replicas.len());
        let loss = &loss;
        // Every replica's (loss, gradients of its own variables), in replica order.
        let results: Vec<Result<Option<(f32, GradStore)>, ParallelError>> =
            std::thread::scope(|s| {
                let mut start = 0;
                let handles: Vec<_> = self
                    .replicas
                    .iter()
                    .zip(&sizes)
                    .enumerate()
                    .map(|(i, (replica, &len))| {
                        let from = start;
                        start += len;
                        s.spawn(move || -> Result<Option<(f32, GradStore)>, ParallelError> {
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
                            let grads = l.backward().map_err(tensor_err(i, "the backward pass"))?;
                            Ok(Some((value, grads)))
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
        // Reduce onto the first device: sum_i (n_i / n) * grad_i, in replica order.
        let dev0 = &self.replicas[0].device;
        let mut grads = GradStore::default();
        let mut total_loss = 0.0f64;
        for (p, (name, var0)) in self.replicas[0].vars.iter().enumerate() {
            let mut acc: Option<Tensor> = None;
            for (i, (replica, out)) in self.replicas.iter().zip(&per).enumerate() {
                let Some((_, g)) = out else { continue };
                let Some(gi) = g.get(replica.vars[p].1.as_tensor()) else {
                    continue;
                };
                let weight = sizes[i] as f64 / n as f64;
                let term = gi
                    .to_device(dev0)
                    .and_then(|g| g.affine(weight, 0.0))
                    .map_err(tensor_err(i, "reducing the gradients"))?;
                acc = Some(match acc {
                    None => term,
                    Some(a) => (a + term).map_err(tensor_err(i, "reducing the gradients"))?,
                });
            }
            if let Some(g) = acc {
                grads.insert(var0.as_tensor(), g);
            } else {
                tracing::debug!(param = %name, "no replica produced a gradient");
            }
        }
        for (i, out) in per.iter().enumerate() {
            if let Some((l, _)) = out {
                total_loss += *l as f64 * sizes[i] as f64 / n as f64;
            }
        }
        Ok(DpStep {
            grads,
            loss: total_loss as f32,
            samples: n,
            per_replica: sizes,
        })
    }
}
