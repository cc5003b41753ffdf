//! The rendezvous state machine: pure decisions over the shared state.
//!
//! Every node runs the same loop: read the state and the set of live nodes, call [`decide`]
//! with the current time, and carry out the [`Action`] (write a new state with
//! compare-and-set, wait for a change, or return). Nothing here does I/O or reads a clock, so
//! every rule is a table-driven unit test.
//!
//! Rules, in the order they apply:
//! 1. A closed job ([`RendezvousState::closed`], or the backend's finished record) ends every
//!    call with [`Action::Closed`].
//! 2. Dead nodes (not in `alive`) are dropped from the waiting list and from an open round. A
//!    complete round that lost a participant is replaced by the next round, whose members are
//!    the survivors (in rank order) and the waiting nodes.
//! 3. An open round takes every node that asks. It closes at `max_nodes` at once, or at
//!    `min_nodes` or more once the last-call window (opened when `min_nodes` was reached) has
//!    passed.
//! 4. A node that asks while a round is complete and it is not a member goes on the waiting
//!    list. A member of the complete round that asks again (its workers failed, or it saw a
//!    waiting node) opens the next round with every current member and the waiting nodes.
//! 5. Ranks are assigned when a round closes: members of the previous round first, in their
//!    previous order, then new nodes in the order they joined. Survivors keep their order.

use std::collections::BTreeSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What a node publishes about itself when it joins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Unique id of the node's agent (stable for the agent's life).
    pub id: String,
    /// The address other nodes reach this node at.
    pub host: String,
    /// Number of worker processes the node runs.
    pub nproc: u32,
    /// The node's embedded store (`host:port`), if it hosts one.
    pub store_addr: Option<String>,
}

/// The state every node of a job shares, stored as JSON by the backend.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RendezvousState {
    /// The round number; rises by one each time a new round opens.
    pub round: u64,
    /// True once the round has closed and ranks are assigned.
    pub complete: bool,
    /// Members: in join order while open, in rank order once complete.
    pub participants: Vec<NodeInfo>,
    /// Ids of the previous round's members in rank order (for stable ranks).
    pub previous: Vec<String>,
    /// Nodes that asked to join while the round was complete.
    pub waiting: Vec<NodeInfo>,
    /// When the last-call window ends (ms since the Unix epoch), once `min_nodes` have joined.
    pub last_call_deadline_ms: Option<u64>,
    /// The job is finished; nobody may join.
    pub closed: bool,
}

/// Round-size rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// A round may close with this many nodes (after the last call).
    pub min_nodes: usize,
    /// A round closes at once with this many nodes.
    pub max_nodes: usize,
    /// How long a round with `min_nodes` or more stays open for more nodes.
    pub last_call: Duration,
}

/// What the deciding node knows besides the state.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    /// Now, in ms since the Unix epoch (the clock shared by all nodes).
    pub now_ms: u64,
    /// The deciding node.
    pub me: &'a NodeInfo,
    /// The last round this node completed, if any.
    pub prev_round: Option<u64>,
    /// Ids of the nodes whose liveness record is current.
    pub alive: &'a BTreeSet<String>,
    /// The backend holds the job-finished record.
    pub finished: bool,
}

/// The outcome of a rendezvous for one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// The round.
    pub round: u64,
    /// This node's rank among the nodes (group rank).
    pub rank: usize,
    /// The members in rank order.
    pub participants: Vec<NodeInfo>,
}

/// What the node should do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The round is complete and this node is a member.
    Done(Assignment),
    /// The job is closed: stop.
    Closed,
    /// Write this state (compare-and-set against what was read), then decide again.
    Write(RendezvousState),
    /// Wait for a change of the state or of liveness, at most until `until_ms` if given.
    Wait {
        /// When to decide again even without a change (the last-call deadline).
        until_ms: Option<u64>,
    },
}

/// An action and why it was chosen (for logs, printed when it changes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// What to do.
    pub action: Action,
    /// Why.
    pub reason: &'static str,
}

fn decision(action: Action, reason: &'static str) -> Decision {
    Decision { action, reason }
}

fn contains(nodes: &[NodeInfo], id: &str) -> bool {
    nodes.iter().any(|n| n.id == id)
}

/// Orders an open round's members for rank assignment and marks it complete.
fn close_round(st: &mut RendezvousState) {
    let previous = &st.previous;
    let mut keyed: Vec<((u8, usize), NodeInfo)> = st
        .participants
        .drain(..)
        .enumerate()
        .map(|(join, n)| match previous.iter().position(|p| *p == n.id) {
            Some(pos) => ((0, pos), n),
            None => ((1, join), n),
        })
        .collect();
    keyed.sort_by_key(|(k, _)| *k);
    st.participants = keyed.into_iter().map(|(_, n)| n).collect();
    st.complete = true;
    st.last_call_deadline_ms = None;
}

/// Updates the deadline and closes the round if the size rules say so.
fn apply_size_rules(st: &mut RendezvousState, now_ms: u64, s: &Settings) {
    let n = st.participants.len();
    if n >= s.max_nodes {
        close_round(st);
    } else if n >= s.min_nodes {
        if st.last_call_deadline_ms.is_none() {
            st.last_call_deadline_ms = Some(now_ms + s.last_call.as_millis() as u64);
        }
    } else {
        st.last_call_deadline_ms = None;
    }
}

/// Opens the round after `st.round` with `members` (already in order).
fn open_next_round(st: &mut RendezvousState, members: Vec<NodeInfo>, now_ms: u64, s: &Settings) {
    st.previous = st.participants.iter().map(|n| n.id.clone()).collect();
    st.round += 1;
    st.complete = false;
    st.participants = members;
    st.waiting.clear();
    st.last_call_deadline_ms = None;
    apply_size_rules(st, now_ms, s);
}

/// Decides the next step for `ctx.me` given the state read (`None`: no state yet).
pub fn decide(state: Option<&RendezvousState>, ctx: &Context<'_>, s: &Settings) -> Decision {
    let mut st = state.cloned().unwrap_or_default();
    if st.closed || ctx.finished {
        return decision(Action::Closed, "the job is closed");
    }
    let alive = |n: &NodeInfo| ctx.alive.contains(&n.id);

    // Rule 2: forget the dead.
    let before = st.clone();
    st.waiting.retain(alive);
    if !st.complete {
        st.participants.retain(alive);
        if st.participants.len() < s.min_nodes {
            st.last_call_deadline_ms = None;
        }
    } else if !st.participants.iter().all(alive) {
        let mut members: Vec<NodeInfo> = st
            .participants
            .iter()
            .filter(|n| alive(n))
            .cloned()
            .collect();
        members.extend(st.waiting.iter().cloned());
        open_next_round(&mut st, members, ctx.now_ms, s);
        return decision(
            Action::Write(st),
            "a member of the round was lost: next round",
        );
    }
    if st != before {
        return decision(Action::Write(st), "removed dead nodes");
    }

    let me = ctx.me;
    if st.complete {
        if contains(&st.participants, &me.id) {
            if ctx.prev_round != Some(st.round) {
                let rank = st
                    .participants
                    .iter()
                    .position(|n| n.id == me.id)
                    .unwrap_or(0);
                return decision(
                    Action::Done(Assignment {
                        round: st.round,
                        rank,
                        participants: st.participants.clone(),
                    }),
                    "the round is complete",
                );
            }
            // Rule 4: a member asks again: re-form with everyone plus the waiting nodes.
            let mut members = st.participants.clone();
            members.extend(st.waiting.iter().cloned());
            open_next_round(&mut st, members, ctx.now_ms, s);
            return decision(Action::Write(st), "a member asked for a new round");
        }
        if contains(&st.waiting, &me.id) {
            return decision(
                Action::Wait { until_ms: None },
                "waiting for the next round",
            );
        }
        st.waiting.push(me.clone());
        return decision(
            Action::Write(st),
            "the round is running: join the waiting list",
        );
    }

    // Rule 3: an open round.
    if !contains(&st.participants, &me.id) {
        st.participants.push(me.clone());
        apply_size_rules(&mut st, ctx.now_ms, s);
        return decision(Action::Write(st), "join the open round");
    }
    let n = st.participants.len();
    let last_call_over = st.last_call_deadline_ms.is_some_and(|d| ctx.now_ms >= d);
    if n >= s.max_nodes || (n >= s.min_nodes && last_call_over) {
        close_round(&mut st);
        return decision(Action::Write(st), "close the round");
    }
    if n >= s.min_nodes && st.last_call_deadline_ms.is_none() {
        apply_size_rules(&mut st, ctx.now_ms, s);
        return decision(Action::Write(st), "open the last call");
    }
    decision(
        Action::Wait {
            until_ms: st.last_call_deadline_ms,
        },
        if n >= s.min_nodes {
            "last call: waiting for more nodes"
        } else {
            "waiting for min_nodes"
        },
    )
}

/// Marks the job closed.
pub fn close(state: Option<&RendezvousState>) -> RendezvousState {
    let mut st = state.cloned().unwrap_or_default();
    st.closed = true;
    st
}

/// Nodes waiting for the next round that could join it (the round is below `max_nodes`);
/// waiting nodes that would not fit do not count, so they cannot cause useless re-forms.
pub fn nodes_waiting(state: &RendezvousState, alive: &BTreeSet<String>, s: &Settings) -> usize {
    if !state.complete {
        return 0;
    }
    let members = state
        .participants
        .iter()
        .filter(|n| alive.contains(&n.id))
        .count();
    let waiting = state
        .waiting
        .iter()
        .filter(|n| alive.contains(&n.id))
        .count();
    waiting.min(s.max_nodes.saturating_sub(members))
}

/// What a member of round `round` sees of the job's membership.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Observation {
    /// Members of the round whose liveness record is gone.
    pub lost: BTreeSet<String>,
    /// Nodes waiting that could join a re-formed round.
    pub waiting: usize,
    /// A newer round has opened.
    pub newer_round: Option<u64>,
    /// The job is closed.
    pub closed: bool,
}

/// Observes the state from the point of view of a member of `round` with `members`.
pub fn observe(
    state: Option<&RendezvousState>,
    finished: bool,
    round: u64,
    members: &[String],
    alive: &BTreeSet<String>,
    s: &Settings,
) -> Observation {
    let mut o = Observation {
        lost: members
            .iter()
            .filter(|m| !alive.contains(*m))
            .cloned()
            .collect(),
        closed: finished,
        ..Default::default()
    };
    if let Some(st) = state {
        o.closed |= st.closed;
        if st.round > round {
            o.newer_round = Some(st.round);
        } else if st.round == round {
            o.waiting = nodes_waiting(st, alive, s);
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str) -> NodeInfo {
        NodeInfo {
            id: id.into(),
            host: format!("{id}.host"),
            nproc: 1,
            store_addr: None,
        }
    }

    fn nodes(ids: &[&str]) -> Vec<NodeInfo> {
        ids.iter().map(|i| node(i)).collect()
    }

    fn ids(ns: &[NodeInfo]) -> Vec<&str> {
        ns.iter().map(|n| n.id.as_str()).collect()
    }

    fn alive(ids: &[&str]) -> BTreeSet<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    const S: Settings = Settings {
        min_nodes: 2,
        max_nodes: 3,
        last_call: Duration::from_millis(1000),
    };

    fn open(round: u64, members: &[&str], deadline: Option<u64>) -> RendezvousState {
        RendezvousState {
            round,
            participants: nodes(members),
            last_call_deadline_ms: deadline,
            ..Default::default()
        }
    }

    fn complete(round: u64, members: &[&str], waiting: &[&str]) -> RendezvousState {
        RendezvousState {
            round,
            complete: true,
            participants: nodes(members),
            waiting: nodes(waiting),
            ..Default::default()
        }
    }

    /// One row: state, who decides, their previous round, who is alive, now -> expected action.
    struct Row {
        name: &'static str,
        state: Option<RendezvousState>,
        me: &'static str,
        prev: Option<u64>,
        alive: &'static [&'static str],
        now: u64,
        want: Action,
    }

    #[test]
    fn decisions() {
        let rows = vec![
            Row {
                name: "first node creates round 0",
                state: None,
                me: "a",
                prev: None,
                alive: &["a"],
                now: 0,
                want: Action::Write(open(0, &["a"], None)),
            },
            Row {
                name: "second node reaches min: last call opens",
                state: Some(open(0, &["a"], None)),
                me: "b",
                prev: None,
                alive: &["a", "b"],
                now: 100,
                want: Action::Write(open(0, &["a", "b"], Some(1100))),
            },
            Row {
                name: "member waits for min",
                state: Some(open(0, &["a"], None)),
                me: "a",
                prev: None,
                alive: &["a"],
                now: 5,
                want: Action::Wait { until_ms: None },
            },
            Row {
                name: "member waits for the last call to end",
                state: Some(open(0, &["a", "b"], Some(1100))),
                me: "a",
                prev: None,
                alive: &["a", "b"],
                now: 500,
                want: Action::Wait {
                    until_ms: Some(1100),
                },
            },
            Row {
                name: "last call over: close with min nodes",
                state: Some(open(0, &["a", "b"], Some(1100))),
                me: "b",
                prev: None,
                alive: &["a", "b"],
                now: 1100,
                want: Action::Write(complete(0, &["a", "b"], &[])),
            },
            Row {
                name: "max reached: close at once",
                state: Some(open(0, &["a", "b"], Some(1100))),
                me: "c",
                prev: None,
                alive: &["a", "b", "c"],
                now: 200,
                want: Action::Write(complete(0, &["a", "b", "c"], &[])),
            },
            Row {
                name: "member of a complete round gets its rank",
                state: Some(complete(0, &["a", "b", "c"], &[])),
                me: "c",
                prev: None,
                alive: &["a", "b", "c"],
                now: 300,
                want: Action::Done(Assignment {
                    round: 0,
                    rank: 2,
                    participants: nodes(&["a", "b", "c"]),
                }),
            },
            Row {
                name: "late node joins the waiting list",
                state: Some(complete(0, &["a", "b"], &[])),
                me: "d",
                prev: None,
                alive: &["a", "b", "d"],
                now: 300,
                want: Action::Write(complete(0, &["a", "b"], &["d"])),
            },
            Row {
                name: "waiting node waits",
                state: Some(complete(0, &["a", "b"], &["d"])),
                me: "d",
                prev: None,
                alive: &["a", "b", "d"],
                now: 300,
                want: Action::Wait { until_ms: None },
            },
            Row {
                name: "dead node leaves an open round; the deadline goes below min",
                state: Some(open(0, &["a", "b"], Some(1100))),
                me: "a",
                prev: None,
                alive: &["a"],
                now: 300,
                want: Action::Write(open(0, &["a"], None)),
            },
            Row {
                name: "dead waiting node is dropped",
                state: Some(complete(0, &["a", "b"], &["d", "e"])),
                me: "a",
                prev: Some(0),
                alive: &["a", "b", "e"],
                now: 300,
                want: Action::Write(complete(0, &["a", "b"], &["e"])),
            },
            Row {
                name: "closed job",
                state: Some(RendezvousState {
                    closed: true,
                    ..complete(3, &["a"], &[])
                }),
                me: "z",
                prev: None,
                alive: &["z"],
                now: 0,
                want: Action::Closed,
            },
        ];
        for r in rows {
            let me = node(r.me);
            let alive = alive(r.alive);
            let ctx = Context {
                now_ms: r.now,
                me: &me,
                prev_round: r.prev,
                alive: &alive,
                finished: false,
            };
            let got = decide(r.state.as_ref(), &ctx, &S);
            assert_eq!(got.action, r.want, "row {:?} ({})", r.name, got.reason);
        }
    }

    #[test]
    fn finished_record_closes_even_an_empty_state() {
        let me = node("a");
        let alive = alive(&["a"]);
        let ctx = Context {
            now_ms: 0,
            me: &me,
            prev_round: None,
            alive: &alive,
            finished: true,
        };
        assert_eq!(decide(None, &ctx, &S).action, Action::Closed);
    }

    #[test]
    fn lost_member_opens_next_round_with_survivors_and_waiting() {
        let st = complete(4, &["a", "b", "c"], &["d"]);
        let me = node("a");
        let alive = alive(&["a", "c", "d"]);
        let ctx = Context {
            now_ms: 10,
            me: &me,
            prev_round: Some(4),
            alive: &alive,
            finished: false,
        };
        let Action::Write(next) = decide(Some(&st), &ctx, &S).action else {
            panic!("expected a write")
        };
        // a, c, d is max (3): closes at once, survivors first in their old order.
        assert_eq!(next.round, 5);
        assert!(next.complete);
        assert_eq!(ids(&next.participants), vec!["a", "c", "d"]);
        assert_eq!(next.previous, vec!["a", "b", "c"]);
        assert!(next.waiting.is_empty());
    }

    #[test]
    fn member_asking_again_reforms_and_survivors_keep_their_order() {
        // Round 2 had ranks c, a; b waits. c asks for a new round.
        let st = complete(2, &["c", "a"], &["b"]);
        let me = node("c");
        let alive = alive(&["a", "b", "c"]);
        let mut ctx = Context {
            now_ms: 0,
            me: &me,
            prev_round: Some(2),
            alive: &alive,
            finished: false,
        };
        let Action::Write(next) = decide(Some(&st), &ctx, &S).action else {
            panic!("expected a write")
        };
        assert_eq!(next.round, 3);
        assert_eq!(ids(&next.participants), vec!["c", "a", "b"]);
        assert!(next.complete, "3 members is max");
        ctx.prev_round = Some(2);
        let done = decide(Some(&next), &ctx, &S).action;
        assert_eq!(
            done,
            Action::Done(Assignment {
                round: 3,
                rank: 0,
                participants: nodes(&["c", "a", "b"]),
            })
        );
    }

    #[test]
    fn ranks_put_previous_members_first_then_join_order() {
        let mut st = RendezvousState {
            round: 7,
            participants: nodes(&["x", "b", "y", "a"]),
            previous: vec!["a".into(), "b".into(), "gone".into()],
            ..Default::default()
        };
        close_round(&mut st);
        assert_eq!(ids(&st.participants), vec!["a", "b", "x", "y"]);
    }

    #[test]
    fn whole_rendezvous_of_three_nodes_is_deterministic() {
        // Nodes act in a fixed interleaving; the result must be the same every time.
        let all = alive(&["n1", "n2", "n3"]);
        let s = Settings {
            min_nodes: 3,
            max_nodes: 3,
            last_call: Duration::ZERO,
        };
        let mut st: Option<RendezvousState> = None;
        let mut done = std::collections::BTreeMap::new();
        for step in 0..20 {
            let id = ["n2", "n3", "n1"][step % 3];
            let me = node(id);
            let ctx = Context {
                now_ms: step as u64,
                me: &me,
                prev_round: None,
                alive: &all,
                finished: false,
            };
            match decide(st.as_ref(), &ctx, &s).action {
                Action::Write(n) => st = Some(n),
                Action::Done(a) => {
                    done.insert(id, a.rank);
                }
                Action::Wait { .. } => {}
                Action::Closed => panic!("closed"),
            }
        }
        assert_eq!(done.len(), 3);
        assert_eq!(done["n2"], 0);
        assert_eq!(done["n3"], 1);
        assert_eq!(done["n1"], 2);
    }

    #[test]
    fn waiting_counts_only_nodes_that_fit() {
        let st = complete(1, &["a", "b"], &["c", "d"]);
        let all = alive(&["a", "b", "c", "d"]);
        assert_eq!(nodes_waiting(&st, &all, &S), 1);
        let full = complete(1, &["a", "b", "c"], &["d"]);
        assert_eq!(nodes_waiting(&full, &all, &S), 0);
        assert_eq!(nodes_waiting(&open(1, &["a"], None), &all, &S), 0);
    }

    #[test]
    fn observations() {
        let members: Vec<String> = vec!["a".into(), "b".into()];
        let st = complete(1, &["a", "b"], &["c"]);
        let o = observe(Some(&st), false, 1, &members, &alive(&["a", "c"]), &S);
        assert_eq!(o.lost, alive(&["b"]));
        assert_eq!(o.waiting, 1);
        assert_eq!(o.newer_round, None);
        let newer = open(2, &["a"], None);
        let o = observe(Some(&newer), false, 1, &members, &alive(&["a", "b"]), &S);
        assert_eq!(o.newer_round, Some(2));
        let o = observe(None, true, 1, &members, &alive(&["a", "b"]), &S);
        assert!(o.closed);
    }
}
