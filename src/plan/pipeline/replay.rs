//! The replay's engine: one step of every stage's given list of actions under a cost model
//! (each compute action's time per chunk, optionally each message's), which finds when each
//! action runs, each stage's busy time and what it holds, and fails on a deadlock or on sends
//! and receives that do not pair up. It knows no schedule: src/plan/pipeline/schedule.rs
//! replays its schedules with it (and chooses ZB-V's order by it), src/plan/pipeline/cuts.rs
//! weighs cuts with it.

use crate::plan::pipeline::shape::{Action, Message, Shape};

/// A replay of one step of every stage under a cost model (forward and backward time per
/// chunk, messages free), which is what the schedule tests and the cost projection use: when
/// each action runs, each stage's busy time, and how many micro-batches it holds at most.
#[derive(Clone, Debug)]
pub struct Replay {
    /// When the last stage finished.
    pub makespan: f64,
    /// Per stage: time spent computing.
    pub busy: Vec<f64>,
    /// Per stage: the most (micro-batch, chunk) activations held between forward and backward.
    pub peak_alive: Vec<usize>,
}

impl Replay {
    /// Each stage's idle share of the step.
    pub fn bubble(&self, stage: usize) -> f64 {
        if self.makespan > 0.0 { 1.0 - self.busy[stage] / self.makespan } else { 0.0 }
    }

    /// The stages' mean idle share.
    pub fn mean_bubble(&self) -> f64 {
        (0..self.busy.len()).map(|s| self.bubble(s)).sum::<f64>() / self.busy.len().max(1) as f64
    }
}

/// The time of each action kind per chunk (the last entry stands for the chunks past the end):
/// a forward, a B (the input's gradient) and a W (the weights'); an unsplit backward costs B + W.
#[derive(Clone, Debug, PartialEq)]
pub struct Costs {
    pub forward: Vec<f64>,
    pub input_grad: Vec<f64>,
    pub weight_grad: Vec<f64>,
}

impl Costs {
    /// Forward and whole-backward times, for schedules that do not split the backward (a split
    /// one then takes the backward as B with a W of nothing).
    #[cfg(test)]
    pub fn unsplit(forward: &[f64], backward: &[f64]) -> Costs {
        Costs { forward: forward.to_vec(), input_grad: backward.to_vec(), weight_grad: vec![0.0] }
    }

    fn of(&self, action: &Action) -> f64 {
        let at = |v: &[f64], chunk: usize| v[chunk.min(v.len() - 1)];
        match *action {
            Action::Forward { chunk, .. } => at(&self.forward, chunk),
            Action::Backward { chunk, .. } => at(&self.input_grad, chunk) + at(&self.weight_grad, chunk),
            Action::BackwardInput { chunk, .. } => at(&self.input_grad, chunk),
            Action::BackwardWeight { chunk, .. } => at(&self.weight_grad, chunk),
            _ => 0.0,
        }
    }
}

/// The stage at the other end of a message action (None for a compute action).
pub(super) fn message_peer(shape: &Shape, action: &Action) -> Option<usize> {
    match *action {
        Action::ReceiveActivation { chunk, .. } | Action::SendGradient { chunk, .. } => Some(shape.stage_of(chunk - 1)),
        Action::ReceiveGradient { chunk, .. } | Action::SendActivation { chunk, .. } => Some(shape.stage_of(chunk + 1)),
        _ => None,
    }
}

pub(super) fn replay_plans(shape: &Shape, plans: &[Vec<Action>], costs: &Costs, message: &[f64]) -> Result<Replay, String> {
    use std::collections::HashMap;
    let p_count = shape.stages;
    // Every send must meet exactly one posted receive and the other way round.
    let mut sent: HashMap<(Message, usize, usize), usize> = HashMap::new();
    let mut posted: HashMap<(Message, usize, usize), usize> = HashMap::new();
    for (p, plan) in plans.iter().enumerate() {
        for a in plan {
            match *a {
                Action::SendActivation { micro, chunk } => *sent.entry((Message::Activation, micro, chunk + 1)).or_default() += 1,
                Action::SendGradient { micro, chunk } => *sent.entry((Message::Gradient, micro, chunk)).or_default() += 1,
                Action::ReceiveActivation { micro, chunk } => *posted.entry((Message::Activation, micro, chunk)).or_default() += 1,
                Action::ReceiveGradient { micro, chunk } => *posted.entry((Message::Gradient, micro, chunk + 1)).or_default() += 1,
                Action::Forward { chunk, .. } | Action::Backward { chunk, .. } | Action::BackwardInput { chunk, .. } | Action::BackwardWeight { chunk, .. }
                    if shape.stage_of(chunk) != p =>
                {
                    return Err(format!("stage {p} computes chunk {chunk}, which is stage {}'s", shape.stage_of(chunk)));
                }
                _ => {}
            }
        }
    }
    if sent != posted || sent.values().any(|&n| n != 1) {
        return Err("sends and receives do not pair up one to one".into());
    }
    let mut arrival: HashMap<(Message, usize, usize), f64> = HashMap::new();
    let mut received: std::collections::HashSet<(Message, usize, usize)> = Default::default();
    let mut next = vec![0usize; p_count];
    let mut clock = vec![0.0f64; p_count];
    let mut busy = vec![0.0f64; p_count];
    let mut alive = vec![0usize; p_count];
    let mut peak_alive = vec![0usize; p_count];
    loop {
        let mut progressed = false;
        for p in 0..p_count {
            while let Some(a) = plans[p].get(next[p]) {
                let key_needed = match *a {
                    Action::Forward { micro, chunk } if chunk > 0 => Some((Message::Activation, micro, chunk)),
                    Action::Backward { micro, chunk } | Action::BackwardInput { micro, chunk } if chunk + 1 < shape.chunks() => Some((Message::Gradient, micro, chunk + 1)),
                    _ => None,
                };
                if let Some(key) = key_needed {
                    if !received.contains(&key) {
                        return Err(format!("stage {p} uses {key:?} before posting its receive"));
                    }
                    match arrival.get(&key) {
                        Some(&t) => clock[p] = clock[p].max(t),
                        None => break,
                    }
                }
                if message_peer(shape, a).is_some_and(|peer| peer != p) {
                    clock[p] += message.get(p).copied().unwrap_or(0.0);
                }
                match *a {
                    Action::ReceiveActivation { micro, chunk } => {
                        received.insert((Message::Activation, micro, chunk));
                    }
                    Action::ReceiveGradient { micro, chunk } => {
                        received.insert((Message::Gradient, micro, chunk + 1));
                    }
                    Action::Forward { .. } | Action::Backward { .. } | Action::BackwardInput { .. } | Action::BackwardWeight { .. } => {
                        let cost = costs.of(a);
                        clock[p] += cost;
                        busy[p] += cost;
                        match a {
                            Action::Forward { .. } => {
                                alive[p] += 1;
                                peak_alive[p] = peak_alive[p].max(alive[p]);
                            }
                            Action::Backward { .. } | Action::BackwardWeight { .. } => alive[p] -= 1,
                            _ => {}
                        }
                    }
                    Action::SendActivation { micro, chunk } => {
                        arrival.insert((Message::Activation, micro, chunk + 1), clock[p]);
                    }
                    Action::SendGradient { micro, chunk } => {
                        arrival.insert((Message::Gradient, micro, chunk), clock[p]);
                    }
                }
                next[p] += 1;
                progressed = true;
            }
        }
        if next.iter().zip(plans).all(|(n, plan)| *n == plan.len()) {
            break;
        }
        if !progressed {
            let stuck: Vec<String> = (0..p_count).filter(|&p| next[p] < plans[p].len()).map(|p| format!("stage {p} at {:?}", plans[p][next[p]])).collect();
            return Err(format!("deadlock: {}", stuck.join("; ")));
        }
    }
    let makespan = clock.iter().copied().fold(0.0, f64::max);
    Ok(Replay { makespan, busy, peak_alive })
}

/// A replay of evaluation's forwards-only schedule on every stage (forward time per chunk),
/// as the executor runs it: a send completes once its receiver has posted the receive (the
/// worst case of MPI's rendezvous; a small message sent eagerly only completes sooner), and
/// before a forward whose output it sends, a stage with its window (training's peak held) of
/// sends in flight waits
/// for the oldest; at the end it waits for all of them. The unit tests run it over every
/// schedule (the executor needs no replay: its rule is this one).
#[cfg(test)]
#[derive(Clone, Debug)]
pub struct ForwardReplay {
    pub makespan: f64,
    /// Per stage: time spent computing.
    pub busy: Vec<f64>,
    /// Per stage: the most outputs in flight at once (sent, their receive not yet posted).
    pub peak_in_flight: Vec<usize>,
}

/// Replays evaluation's `plans` (one per stage), a stage holding at most `windows[stage]`
/// sends in flight; fails naming the stuck stages when no stage can go on (a deadlock), or when
/// sends and receives do not pair up.
#[cfg(test)]
pub(super) fn replay_forward_plans(shape: &Shape, plans: &[Vec<Action>], windows: &[usize], forward_cost: &[f64]) -> Result<ForwardReplay, String> {
    use std::collections::{HashMap, VecDeque};
    let p_count = shape.stages;
    let mut sent_keys: Vec<(usize, usize)> = Vec::new();
    let mut posted_keys: Vec<(usize, usize)> = Vec::new();
    for plan in plans {
        for a in plan {
            match *a {
                Action::SendActivation { micro, chunk } => sent_keys.push((micro, chunk + 1)),
                Action::ReceiveActivation { micro, chunk } => posted_keys.push((micro, chunk)),
                Action::Forward { .. } => {}
                _ => return Err(format!("evaluation's schedule holds {a:?}")),
            }
        }
    }
    sent_keys.sort_unstable();
    posted_keys.sort_unstable();
    if sent_keys != posted_keys || sent_keys.windows(2).any(|w| w[0] == w[1]) {
        return Err("sends and receives do not pair up one to one".into());
    }
    // Keys are (micro-batch, the chunk whose input it is); times are when each happened.
    let mut sent_at: HashMap<(usize, usize), f64> = HashMap::new();
    let mut posted_at: HashMap<(usize, usize), f64> = HashMap::new();
    let mut in_flight: Vec<VecDeque<((usize, usize), f64)>> = vec![VecDeque::new(); p_count];
    let mut next = vec![0usize; p_count];
    let mut clock = vec![0.0f64; p_count];
    let mut busy = vec![0.0f64; p_count];
    let mut peak_in_flight = vec![0usize; p_count];
    // A send is over once its receive is posted: (whether, when).
    let completion = |posted_at: &HashMap<(usize, usize), f64>, key: &(usize, usize), sent: f64| posted_at.get(key).map(|&t| t.max(sent));
    // Waits for the oldest send of a stage: false while its receive is not posted yet.
    let wait_oldest = |in_flight: &mut VecDeque<((usize, usize), f64)>, clock: &mut f64, posted_at: &HashMap<(usize, usize), f64>| {
        let Some(done) = in_flight.front().and_then(|(key, sent)| completion(posted_at, key, *sent)) else { return false };
        *clock = clock.max(done);
        in_flight.pop_front();
        true
    };
    loop {
        let mut progressed = false;
        for p in 0..p_count {
            loop {
                // Completed sends let go of their buffers.
                in_flight[p].retain(|(key, sent)| completion(&posted_at, key, *sent).is_none_or(|done| done > clock[p]));
                let Some(&a) = plans[p].get(next[p]) else {
                    // The end: every send waited for.
                    if !wait_oldest(&mut in_flight[p], &mut clock[p], &posted_at) {
                        break;
                    }
                    progressed = true;
                    continue;
                };
                match a {
                    Action::ReceiveActivation { micro, chunk } => {
                        posted_at.insert((micro, chunk), clock[p]);
                    }
                    Action::Forward { micro, chunk } => {
                        if chunk > 0 {
                            if !posted_at.contains_key(&(micro, chunk)) {
                                return Err(format!("stage {p} forwards micro-batch {micro} through chunk {chunk} before posting its receive"));
                            }
                            match sent_at.get(&(micro, chunk)) {
                                Some(&t) => clock[p] = clock[p].max(t),
                                None => break,
                            }
                        }
                        if chunk + 1 < shape.chunks() && in_flight[p].len() >= windows[p] {
                            if !wait_oldest(&mut in_flight[p], &mut clock[p], &posted_at) {
                                break;
                            }
                            progressed = true;
                            continue;
                        }
                        let cost = forward_cost[chunk.min(forward_cost.len() - 1)];
                        clock[p] += cost;
                        busy[p] += cost;
                    }
                    Action::SendActivation { micro, chunk } => {
                        sent_at.insert((micro, chunk + 1), clock[p]);
                        in_flight[p].push_back(((micro, chunk + 1), clock[p]));
                        peak_in_flight[p] = peak_in_flight[p].max(in_flight[p].len());
                    }
                    _ => unreachable!("checked above"),
                }
                next[p] += 1;
                progressed = true;
            }
        }
        if (0..p_count).all(|p| next[p] == plans[p].len() && in_flight[p].is_empty()) {
            break;
        }
        if !progressed {
            let stuck: Vec<String> = (0..p_count)
                .filter(|&p| next[p] < plans[p].len() || !in_flight[p].is_empty())
                .map(|p| match plans[p].get(next[p]) {
                    Some(a) => format!("stage {p} at {a:?} with {} send(s) in flight", in_flight[p].len()),
                    None => format!("stage {p} waiting for its {} last send(s)", in_flight[p].len()),
                })
                .collect();
            return Err(format!("deadlock: {}", stuck.join("; ")));
        }
    }
    let makespan = clock.iter().copied().fold(0.0, f64::max);
    Ok(ForwardReplay { makespan, busy, peak_in_flight })
}
