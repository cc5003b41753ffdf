//! Asynchronous steps. A server runs one thread per worker link (receive a push, hand it to
//! the server, send the reply it gets back), one that receives its predecessor's updates for
//! the copy, and one that forwards its own updates to its copy holder; the strategy's thread
//! applies what they hand it, in arrival order, whenever the loop lets it serve (inside a
//! step, at the step boundary, while it waits for the end of the run).
//!
//! Stopping on a signal: a rank that gets one flags its messages; server 0 then stops
//! dealing and fixes the stop step (the first ticket it has not dealt), which travels on
//! every reply, on every push, and around the servers' copy links; every rank stops at the
//! boundary of that step.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use rekindle_runtime::{Buffer, Work};

use super::links::{peer, Links, Role};
use super::shard_map::ShardMap;
use super::sync_mode::{mean_scale, wait_link};
use super::tickets::Staleness;
use super::wire::{Header, Kind, DUPLICATE, HEADER_LEN, NO_STOP, REFUSED, STOP};
use super::{ParameterServer, NONE};
use crate::train::strategy::{
    Boundary, BoxError, Group, StepDone, StepError, StepOutput, SubGroup,
};
use crate::train::StepInput;

/// The worker has nothing more to push in this group (its last message to each server).
pub(super) const DONE: u32 = 8;
/// A forward with no update, carrying only the stop step.
pub(super) const NOTICE: u32 = 16;

/// What a server's threads hand it.
pub(super) enum Event {
    /// A worker's push (by worker index).
    Push { worker: usize, msg: Vec<f32> },
    /// The predecessor's update for the copy.
    Forward { msg: Vec<f32> },
    /// A link failed.
    Failed(StepError),
}

/// A server's threads and the channels to them.
pub(super) struct AsyncServer {
    events: mpsc::Receiver<Event>,
    replies: Vec<mpsc::Sender<Vec<f32>>>,
    forward: Option<mpsc::Sender<Vec<f32>>>,
    /// Elements of a forward (this server's shard).
    forward_len: usize,
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<(), StepError> {
    std::thread::Builder::new()
        .name(name)
        .spawn(f)
        .map(|_| ())
        .map_err(|e| StepError::state("starting a server thread", e))
}

fn receive(
    link: &SubGroup,
    len: usize,
    wait: Duration,
    during: &'static str,
) -> Result<Vec<f32>, StepError> {
    link.pg()
        .recv(Buffer::from(vec![0.0f32; len]), peer(link))
        .wait(wait)
        .map_err(|e| link.error(during, e))?
        .into_vec::<f32>()
        .map_err(|_| StepError::state(during, "a message that is not f32"))
}

impl AsyncServer {
    /// Starts server `k`'s threads over `links`.
    pub fn start(
        links: &Links,
        map: &ShardMap,
        k: usize,
        servers: usize,
        workers: usize,
        wait: Duration,
    ) -> Result<AsyncServer, StepError> {
        let (events_tx, events) = mpsc::channel();
        let len = HEADER_LEN + map.shard_len(k);
        let mut replies = Vec::with_capacity(workers);
        for (j, link) in links.pairs.iter().enumerate() {
            let (tx, rx) = mpsc::channel::<Vec<f32>>();
            replies.push(tx);
            let link = link.clone();
            let events = events_tx.clone();
            spawn(format!("ps-{k}-w{j}"), move || loop {
                let msg = match receive(&link, len, wait, "receiving a push") {
                    Ok(m) => m,
                    Err(e) => {
                        let _ = events.send(Event::Failed(e));
                        return;
                    }
                };
                let done = Header::read(&msg).is_ok_and(|h| h.flags & DONE != 0);
                if events.send(Event::Push { worker: j, msg }).is_err() {
                    return;
                }
                let Ok(reply) = rx.recv() else { return };
                let sent = link.pg().send(Buffer::from(reply), peer(&link)).wait(wait);
                if let Err(e) = sent {
                    let _ = events.send(Event::Failed(link.error("sending a reply", e)));
                    return;
                }
                if done {
                    return;
                }
            })?;
        }
        // A copy link exists only with the copies on.
        let pred = super::links::copy_of(k, servers, true);
        if let (Some(link), Some(pred)) = (links.copy_in.clone(), pred) {
            let events = events_tx.clone();
            let len = HEADER_LEN + map.shard_len(pred);
            spawn(format!("ps-{k}-copy-in"), move || loop {
                match receive(&link, len, wait, "receiving the predecessor's update") {
                    Ok(msg) => {
                        if events.send(Event::Forward { msg }).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        let _ = events.send(Event::Failed(e));
                        return;
                    }
                }
            })?;
        }
        let mut forward = None;
        if let Some(link) = links.copy_out.clone() {
            let (tx, rx) = mpsc::channel::<Vec<f32>>();
            forward = Some(tx);
            let events = events_tx.clone();
            spawn(format!("ps-{k}-copy-out"), move || {
                while let Ok(msg) = rx.recv() {
                    let sent = link.pg().send(Buffer::from(msg), peer(&link)).wait(wait);
                    if let Err(e) = sent {
                        let _ = events.send(Event::Failed(link.error("forwarding to the copy", e)));
                        return;
                    }
                }
            })?;
        }
        Ok(AsyncServer {
            events,
            replies,
            forward,
            forward_len: len,
        })
    }

    /// Stops handing work to the threads (they end when their links are aborted).
    pub fn stop(self) {
        drop(self.replies);
        drop(self.forward);
    }
}

/// A timeout of the server's own wait: nothing arrived for the collective deadline.
fn silent(rank: usize, during: &'static str, waited: Duration) -> StepError {
    StepError::collective(
        during,
        rekindle_runtime::Error::Timeout {
            rank,
            op: during,
            elapsed: waited,
            waiting_on: Vec::new(),
        },
    )
}

impl ParameterServer {
    /// Handles at most one event, waiting at most `timeout`; false when none came.
    pub(super) fn serve_once(&mut self, timeout: Duration) -> Result<bool, StepError> {
        let Some(server) = self.group.as_ref().and_then(|g| g.server.as_ref()) else {
            return Ok(false);
        };
        let ev = match server.events.recv_timeout(timeout) {
            Ok(ev) => ev,
            Err(mpsc::RecvTimeoutError::Timeout) => return Ok(false),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(StepError::state("serving", "the server's threads stopped"))
            }
        };
        match ev {
            Event::Push { worker, msg } => self.handle_push(worker, msg)?,
            Event::Forward { msg } => self.handle_forward(msg)?,
            Event::Failed(e) => return Err(e),
        }
        Ok(true)
    }

    /// Serves until `ready` holds or the stop step is `at`; errors when nothing arrives for
    /// the collective deadline.
    fn serve_while(
        &mut self,
        group: &Group<'_>,
        at: u64,
        during: &'static str,
        ready: impl Fn(&ParameterServer) -> bool,
    ) -> Result<(), StepError> {
        let mut last = Instant::now();
        while !ready(self) {
            if self.group.as_ref().is_some_and(|g| g.stop_at <= at) {
                return Ok(());
            }
            if self.serve_once(Duration::from_millis(50))? {
                last = Instant::now();
            } else if last.elapsed() > group.wait() {
                return Err(silent(group.rank(), during, last.elapsed()));
            }
        }
        Ok(())
    }

    /// True when ticket `t` and every one before it are in this server's shard and copy.
    fn applied_through(&self, t: u64) -> bool {
        let primary = self
            .primary
            .as_ref()
            .is_some_and(|s| s.applied.prefix() > t);
        primary && self.copy.as_ref().is_none_or(|c| c.applied.prefix() > t)
    }

    /// Learns the stop step; a server passes it on to its copy holder the first time.
    fn learn_stop(&mut self, stop_at: u64) {
        let Some(g) = self.group.as_mut() else { return };
        if stop_at == NO_STOP || g.stop_at <= stop_at {
            return;
        }
        g.stop_at = stop_at;
        if let Some(server) = &g.server {
            if let Some(fwd) = &server.forward {
                let mut msg = vec![0.0f32; server.forward_len];
                let mut h = Header::new(Kind::Forward, stop_at);
                h.flags = NOTICE;
                h.stop_at = stop_at;
                h.write(&mut msg);
                let _ = fwd.send(msg);
            }
        }
    }

    /// This rank got a signal: server 0 fixes the stop step, the others flag their messages.
    fn ask_stop(&mut self) {
        let Some(g) = self.group.as_mut() else { return };
        g.stop_asked = true;
        let fixed = match (&g.role, &mut g.dealer) {
            (Role::Server(0), Some(d)) => Some(d.peek().min(g.max_steps)),
            _ => None,
        };
        if let Some(at) = fixed {
            self.learn_stop(at);
        }
    }

    /// Server 0: worker `j`'s next ticket after its push of `ticket` (dealt once per push).
    fn next_for(&mut self, j: usize, ticket: u64) -> u64 {
        let Some(g) = self.group.as_mut() else {
            return NONE;
        };
        if let Some(&(t, n)) = g.dealt.get(&j) {
            if t == ticket {
                return n;
            }
        }
        let limit = g.max_steps.min(g.stop_at);
        let n = match &mut g.dealer {
            Some(d) => {
                let n = d.deal();
                if n < limit {
                    n
                } else {
                    NONE
                }
            }
            None => NONE,
        };
        g.dealt.insert(j, (ticket, n));
        n
    }

    fn handle_push(&mut self, j: usize, mut msg: Vec<f32>) -> Result<(), StepError> {
        let h = Header::read(&msg).map_err(|e| StepError::state("receiving a push", e))?;
        if h.kind != Kind::Push {
            return Err(StepError::state(
                "receiving a push",
                format!("worker {j} sent {:?}", h.kind),
            ));
        }
        self.learn_stop(h.stop_at);
        if h.flags & STOP != 0 {
            self.ask_stop();
        }
        let bound = self.bound();
        let is_dealer = self
            .group
            .as_ref()
            .is_some_and(|g| g.role == Role::Server(0));
        let mut reply = Header::new(Kind::Reply, h.ticket);
        let shard = self
            .primary
            .as_mut()
            .ok_or_else(|| StepError::state("serving", "no shard"))?;
        let mut applied = false;
        if h.flags & DONE != 0 {
            // Nothing to apply: the worker's last message.
        } else if shard.applied.contains(h.ticket) {
            reply.flags |= DUPLICATE;
        } else {
            let staleness = shard.version.saturating_sub(h.version);
            if Staleness::admits(staleness, bound) {
                if h.samples > 0 {
                    shard.apply(&msg[HEADER_LEN..], mean_scale(u64::from(h.samples)))?;
                }
                shard.applied.insert(h.ticket);
                self.stats.applied(staleness);
                applied = true;
            } else {
                reply.flags |= REFUSED;
                self.stats.refused();
            }
        }
        if applied {
            if let Some(g) = self.group.as_mut() {
                g.losses.insert(h.ticket, (h.samples, h.loss));
                if let Some(fwd) = g.server.as_ref().and_then(|s| s.forward.as_ref()) {
                    let mut f = h;
                    f.kind = Kind::Forward;
                    f.flags = 0;
                    f.stop_at = g.stop_at;
                    f.write(&mut msg);
                    let _ = fwd.send(msg);
                }
            }
        }
        if is_dealer && h.flags & DONE == 0 && reply.flags & REFUSED == 0 {
            reply.next = self.next_for(j, h.ticket);
        }
        let shard = self
            .primary
            .as_ref()
            .ok_or_else(|| StepError::state("serving", "no shard"))?;
        reply.version = shard.version;
        let mut buf = vec![0.0f32; HEADER_LEN + shard.values.len()];
        buf[HEADER_LEN..].copy_from_slice(&shard.values);
        let g = self
            .group
            .as_ref()
            .ok_or_else(|| StepError::state("serving", "no group"))?;
        reply.stop_at = g.stop_at;
        if g.stop_asked {
            reply.flags |= STOP;
        }
        reply.write(&mut buf);
        if let Some(tx) = g.server.as_ref().and_then(|s| s.replies.get(j)) {
            // A closed channel means the link failed; its thread reports that.
            let _ = tx.send(buf);
        }
        Ok(())
    }

    fn handle_forward(&mut self, msg: Vec<f32>) -> Result<(), StepError> {
        let h = Header::read(&msg)
            .map_err(|e| StepError::state("receiving the predecessor's update", e))?;
        self.learn_stop(h.stop_at);
        if h.flags & NOTICE != 0 {
            return Ok(());
        }
        let copy = self
            .copy
            .as_mut()
            .ok_or_else(|| StepError::state("receiving the predecessor's update", "no copy"))?;
        if copy.applied.contains(h.ticket) {
            return Ok(());
        }
        if h.samples > 0 {
            copy.apply(&msg[HEADER_LEN..], mean_scale(u64::from(h.samples)))?;
        }
        copy.applied.insert(h.ticket);
        Ok(())
    }

    /// A server's step `t`: serves until ticket `t` is in its shard and its copy.
    pub(super) fn async_server_step(
        &mut self,
        group: &mut Group<'_>,
        t: u64,
    ) -> Result<StepDone, StepError> {
        self.serve_while(group, t, "waiting for pushes", |s| s.applied_through(t))?;
        let g = self.in_group()?;
        if g.stop_at <= t {
            return Err(StepError::state(
                "an asynchronous step",
                format!("step {t} is past the agreed stop step {}", g.stop_at),
            ));
        }
        let (samples, loss) = g.losses.remove(&t).unwrap_or((0, f32::NAN));
        Ok(StepDone {
            global_samples: u64::from(samples),
            loss_samples: if loss.is_nan() { 0 } else { u64::from(samples) },
            loss: if loss.is_nan() { 0.0 } else { loss },
        })
    }

    /// The boundary of an asynchronous step: no collective. A server serves until the next
    /// ticket is in (so that it learns a stop step before it would pass it).
    pub(super) fn async_boundary(
        &mut self,
        group: &mut Group<'_>,
        done: &StepDone,
        stopping: bool,
    ) -> Result<Boundary, StepError> {
        let g = self.in_group()?;
        if stopping && !g.stop_asked {
            self.ask_stop();
        }
        let g = self.in_group()?;
        let next = g.last_step + 1;
        if matches!(g.role, Role::Server(_)) && next < g.max_steps && g.stop_at > next {
            self.serve_while(group, next, "waiting for pushes", |s| {
                s.applied_through(next)
            })?;
        }
        let g = self.in_group()?;
        Ok(Boundary {
            loss: (done.loss_samples > 0).then_some(f64::from(done.loss)),
            stop: g.stop_at == next,
        })
    }

    /// One exchange with each server of `to`: pushes `bufs`, returns the replies.
    fn exchange(
        &mut self,
        group: &Group<'_>,
        to: &[usize],
        bufs: Vec<Vec<f32>>,
        during: &'static str,
    ) -> Result<Vec<Vec<f32>>, StepError> {
        let g = self.in_group()?;
        let mut works: Vec<(SubGroup, Work, Work)> = Vec::with_capacity(to.len());
        for (&k, buf) in to.iter().zip(bufs) {
            let link = g.links.pairs[k].clone();
            let len = buf.len();
            let send = link.pg().send(Buffer::from(buf), peer(&link));
            let recv = link.pg().recv(Buffer::from(vec![0.0f32; len]), peer(&link));
            works.push((link, send, recv));
        }
        let mut replies = Vec::with_capacity(works.len());
        for (link, send, recv) in works {
            wait_link(&link, send, group, during)?;
            replies.push(wait_link(&link, recv, group, during)?);
        }
        Ok(replies)
    }

    /// Takes a reply from server `k`: its values, its version, the stop step.
    fn take_reply(&mut self, k: usize, reply: &[f32]) -> Result<Header, StepError> {
        let h = Header::read(reply).map_err(|e| StepError::state("pulling parameters", e))?;
        if h.kind != Kind::Reply {
            return Err(StepError::state(
                "pulling parameters",
                format!("server {k} sent {:?}", h.kind),
            ));
        }
        self.values_to_vars(k, &reply[HEADER_LEN..])?;
        self.learn_stop(h.stop_at);
        let g = self.in_group()?;
        g.bases[k] = h.version;
        Ok(h)
    }

    /// A worker's step: its ticket (computed, pushed, and computed again for the servers
    /// that refused it as too stale), or nothing when the step is dealt to another worker.
    pub(super) fn async_worker_step(
        &mut self,
        group: &mut Group<'_>,
        input: &StepInput<'_>,
        step_fn: &mut dyn FnMut(&StepInput<'_>) -> Result<StepOutput, BoxError>,
    ) -> Result<StepDone, StepError> {
        let g = self.in_group()?;
        let ticket = g.ticket;
        if ticket == NONE || input.step < ticket {
            if ticket == NONE && !g.done_sent {
                self.send_done(group)?;
            }
            return Ok(StepDone::default());
        }
        if input.step > ticket {
            return Err(StepError::state(
                "an asynchronous step",
                format!(
                    "the loop is at step {} past this worker's ticket {ticket}",
                    input.step
                ),
            ));
        }
        let servers = self.config.servers;
        let mut pending: Vec<usize> = (0..servers).collect();
        let mut next = None;
        loop {
            let out = step_fn(input).map_err(StepError::Program)?;
            let samples = if out.grads().is_some() {
                out.samples()
            } else {
                0
            };
            let g = self.in_group()?;
            let (stop_at, stop_asked) = (g.stop_at, g.stop_asked);
            let bases = g.bases.clone();
            let mut bufs = Vec::with_capacity(pending.len());
            for &k in &pending {
                let mut buf = vec![0.0f32; HEADER_LEN + self.map.shard_len(k)];
                let mut h = Header::new(Kind::Push, ticket);
                h.version = bases[k];
                h.samples = samples as u32;
                h.loss = out.loss().unwrap_or(f32::NAN);
                h.stop_at = stop_at;
                if stop_asked {
                    h.flags |= STOP;
                }
                h.write(&mut buf);
                if samples > 0 {
                    self.flatten_grads(k, &out, &mut buf)?;
                }
                bufs.push(buf);
            }
            let replies = self.exchange(group, &pending, bufs, "pushing gradients")?;
            let mut refused = Vec::new();
            for (&k, reply) in pending.iter().zip(&replies) {
                let h = self.take_reply(k, reply)?;
                if h.flags & REFUSED != 0 {
                    refused.push(k);
                } else if k == 0 {
                    next = Some(h.next);
                }
            }
            if refused.is_empty() {
                let g = self.in_group()?;
                g.ticket = next.unwrap_or(NONE);
                if g.ticket == NONE {
                    self.send_done(group)?;
                }
                return Ok(StepDone {
                    global_samples: samples as u64,
                    loss_samples: if out.loss().is_some() {
                        samples as u64
                    } else {
                        0
                    },
                    loss: out.loss().unwrap_or(0.0),
                });
            }
            pending = refused;
        }
    }

    /// A worker's last message to every server of this group.
    pub(super) fn send_done(&mut self, group: &Group<'_>) -> Result<(), StepError> {
        let g = self.in_group()?;
        if g.done_sent || !matches!(g.role, Role::Worker(_)) {
            return Ok(());
        }
        let (stop_at, stop_asked) = (g.stop_at, g.stop_asked);
        let servers = self.config.servers;
        let to: Vec<usize> = (0..servers).collect();
        let bufs = to
            .iter()
            .map(|&k| {
                let mut buf = vec![0.0f32; HEADER_LEN + self.map.shard_len(k)];
                let mut h = Header::new(Kind::Push, NONE);
                h.flags = DONE | if stop_asked { STOP } else { 0 };
                h.stop_at = stop_at;
                h.write(&mut buf);
                buf
            })
            .collect();
        let replies = self.exchange(group, &to, bufs, "telling the servers this worker is done")?;
        for (k, reply) in replies.iter().enumerate() {
            self.take_reply(k, reply)?;
        }
        self.in_group()?.done_sent = true;
        Ok(())
    }
}
