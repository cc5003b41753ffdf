//! Synchronous steps: every worker pushes its share's gradients to every server and waits for
//! the new values; every server waits for every worker, sums in worker order, updates its
//! shard and its copy of its predecessor's, then replies.

use rekindle_runtime::{Buffer, Work};

use super::links::peer;
use super::wire::{Header, Kind, HEADER_LEN};
use super::{tensors, ParameterServer};
use crate::train::strategy::{BoxError, Group, StepDone, StepError, StepOutput, SubGroup};
use crate::train::StepInput;

/// Waits for a send or receive on a link, naming the silent parent ranks on a timeout.
pub(super) fn wait_link(
    link: &SubGroup,
    work: Work,
    group: &Group<'_>,
    during: &'static str,
) -> Result<Vec<f32>, StepError> {
    work.wait(group.wait())
        .map_err(|e| link.error(during, e))?
        .into_vec::<f32>()
        .map_err(|_| StepError::state(during, "a message that is not f32"))
}

fn header(buf: &[f32], during: &'static str) -> Result<Header, StepError> {
    Header::read(buf).map_err(|e| StepError::state(during, e))
}

/// The scale that turns a sum over `samples` samples into their mean, as DDP computes it.
pub(super) fn mean_scale(samples: u64) -> f32 {
    (1.0 / samples as f64) as f32
}

impl ParameterServer {
    /// Fills `buf[HEADER_LEN..]` with shard `k`'s gradients times `n` (zeros without
    /// gradients).
    pub(super) fn flatten_grads(
        &self,
        k: usize,
        out: &StepOutput,
        buf: &mut [f32],
    ) -> Result<(), StepError> {
        let n = out.samples() as f32;
        let mut at = HEADER_LEN;
        for p in self.map.pieces(k) {
            let len = p.range.len();
            let dst = &mut buf[at..at + len];
            let grad = out
                .grads()
                .and_then(|g| g.get(self.vars[p.param].as_tensor()));
            match grad {
                Some(g) => tensors::with_f32(g, |src| {
                    let src = &src[p.range.clone()];
                    if out.samples() == 1 {
                        dst.copy_from_slice(src);
                    } else {
                        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s * n);
                    }
                })
                .map_err(|e| StepError::state("reading the gradients", e))?,
                None => dst.fill(0.0),
            }
            at += len;
        }
        Ok(())
    }

    /// A worker's synchronous step.
    pub(super) fn sync_worker_step(
        &mut self,
        group: &mut Group<'_>,
        input: &StepInput<'_>,
        step_fn: &mut dyn FnMut(&StepInput<'_>) -> Result<StepOutput, BoxError>,
    ) -> Result<StepDone, StepError> {
        let out = step_fn(input).map_err(StepError::Program)?;
        let samples = if out.grads().is_some() {
            out.samples()
        } else {
            0
        };
        let servers = self.config.servers;
        let mut works = Vec::with_capacity(servers);
        for k in 0..servers {
            let len = HEADER_LEN + self.map.shard_len(k);
            let mut buf = vec![0.0f32; len];
            let mut h = Header::new(Kind::Push, input.step);
            h.samples = samples as u32;
            h.loss = out.loss().unwrap_or(f32::NAN);
            h.write(&mut buf);
            if samples > 0 {
                self.flatten_grads(k, &out, &mut buf)?;
            }
            let g = self.in_group()?;
            let link = &g.links.pairs[k];
            let send = link.pg().send(Buffer::from(buf), peer(link));
            let recv = link.pg().recv(Buffer::from(vec![0.0f32; len]), peer(link));
            works.push((send, recv));
        }
        let mut global = 0u64;
        let mut replies = Vec::with_capacity(servers);
        for (k, (send, recv)) in works.into_iter().enumerate() {
            let link = self.in_group()?.links.pairs[k].clone();
            wait_link(&link, send, group, "pushing gradients")?;
            replies.push(wait_link(&link, recv, group, "pulling parameters")?);
        }
        for (k, reply) in replies.iter().enumerate() {
            let h = header(reply, "pulling parameters")?;
            if h.kind != Kind::Reply || h.ticket != input.step {
                return Err(StepError::state(
                    "pulling parameters",
                    format!(
                        "server {k} replied {:?} for step {} during step {}",
                        h.kind, h.ticket, input.step
                    ),
                ));
            }
            global = u64::from(h.samples);
            self.values_to_vars(k, &reply[HEADER_LEN..])?;
        }
        Ok(StepDone {
            global_samples: global,
            loss_samples: if out.loss().is_some() {
                samples as u64
            } else {
                0
            },
            loss: out.loss().unwrap_or(0.0),
        })
    }

    /// Server `k`'s synchronous step.
    pub(super) fn sync_server_step(
        &mut self,
        group: &mut Group<'_>,
        input: &StepInput<'_>,
        k: usize,
    ) -> Result<StepDone, StepError> {
        let len = HEADER_LEN + self.map.shard_len(k);
        let g = self.in_group()?;
        let links = &g.links;
        let recvs: Vec<Work> = links
            .pairs
            .iter()
            .map(|l| l.pg().recv(Buffer::from(vec![0.0f32; len]), peer(l)))
            .collect();
        let pairs = links.pairs.clone();
        // Every worker's push, summed in worker order.
        let mut sum: Option<Vec<f32>> = None;
        let mut total = 0u64;
        for (j, work) in recvs.into_iter().enumerate() {
            let msg = wait_link(&pairs[j], work, group, "receiving gradients")?;
            let h = header(&msg, "receiving gradients")?;
            if h.kind != Kind::Push || h.ticket != input.step {
                return Err(StepError::state(
                    "receiving gradients",
                    format!(
                        "worker {j} pushed {:?} for step {} during step {}",
                        h.kind, h.ticket, input.step
                    ),
                ));
            }
            total += u64::from(h.samples);
            match &mut sum {
                None => sum = Some(msg),
                Some(s) => s[HEADER_LEN..]
                    .iter_mut()
                    .zip(&msg[HEADER_LEN..])
                    .for_each(|(a, b)| *a += b),
            }
        }
        let Some(mut sum) = sum else {
            return Err(StepError::state("a synchronous step", "no workers"));
        };
        if total == 0 {
            return Err(StepError::state(
                "a synchronous step",
                format!("step {} has no samples on any worker", input.step),
            ));
        }
        let scale = mean_scale(total);
        let shard = self
            .primary
            .as_mut()
            .ok_or_else(|| StepError::state("a synchronous step", "no shard"))?;
        shard.save_undo()?;
        shard.apply(&sum[HEADER_LEN..], scale)?;
        shard.at = input.step + 1;
        // The copy holder applies the same sum; this server applies its predecessor's.
        let g = self.in_group()?;
        let copy_out = g.links.copy_out.clone();
        let copy_in = g.links.copy_in.clone();
        let mut fwd = Header::new(Kind::Forward, input.step);
        fwd.samples = total as u32;
        fwd.write(&mut sum);
        let sent = copy_out
            .as_ref()
            .map(|l| (l, l.pg().send(Buffer::from(sum), peer(l))));
        let pred = match &self.copy {
            Some(c) => c.index,
            None => 0,
        };
        let received = copy_in.as_ref().map(|l| {
            let len = HEADER_LEN + self.map.shard_len(pred);
            (l, l.pg().recv(Buffer::from(vec![0.0f32; len]), peer(l)))
        });
        if let Some((l, w)) = sent {
            wait_link(l, w, group, "forwarding to the copy")?;
        }
        if let Some((l, w)) = received {
            let msg = wait_link(l, w, group, "receiving the predecessor's update")?;
            let h = header(&msg, "receiving the predecessor's update")?;
            if h.kind != Kind::Forward || h.ticket != input.step {
                return Err(StepError::state(
                    "receiving the predecessor's update",
                    format!(
                        "got {:?} for step {} during step {}",
                        h.kind, h.ticket, input.step
                    ),
                ));
            }
            let copy = self
                .copy
                .as_mut()
                .ok_or_else(|| StepError::state("a synchronous step", "no copy"))?;
            copy.save_undo()?;
            copy.apply(&msg[HEADER_LEN..], mean_scale(u64::from(h.samples)))?;
            copy.at = input.step + 1;
        }
        // The pull.
        let shard = self
            .primary
            .as_ref()
            .ok_or_else(|| StepError::state("a synchronous step", "no shard"))?;
        let mut reply = vec![0.0f32; len];
        let mut h = Header::new(Kind::Reply, input.step);
        h.samples = total as u32;
        h.version = shard.version;
        h.write(&mut reply);
        reply[HEADER_LEN..].copy_from_slice(&shard.values);
        let sends: Vec<Work> = pairs
            .iter()
            .map(|l| l.pg().send(Buffer::from(reply.clone()), peer(l)))
            .collect();
        for (j, w) in sends.into_iter().enumerate() {
            wait_link(&pairs[j], w, group, "sending parameters")?;
        }
        Ok(StepDone {
            global_samples: total,
            ..StepDone::default()
        })
    }
}
