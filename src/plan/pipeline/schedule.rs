//! What each stage does in one step: the compute order of every schedule ([`compute_order`],
//! ZB-V's by [`zb_v_orders`]), the messages around it ([`schedule`]), evaluation's forwards
//! ([`forward_schedule`]), and the replays of those schedules under a cost model ([`replay`],
//! [`idle_per_busy`]). ZB-V's order is itself chosen by replaying candidates, so the replay's
//! engine (src/plan/pipeline/replay.rs) sits below the schedules and knows none of them.

use crate::plan::pipeline::replay::{message_peer, replay_plans, Costs, Replay};
use crate::plan::pipeline::shape::{Action, ScheduleKind, Shape};
#[cfg(test)]
use crate::plan::pipeline::replay::{replay_forward_plans, ForwardReplay};

/// The compute actions of `stage`, in order, as the schedule orders them.
pub fn compute_order(shape: &Shape, stage: usize) -> Vec<Action> {
    let (p_count, m_count) = (shape.stages, shape.micro_batches);
    let forward = |micro, chunk| Action::Forward { micro, chunk };
    let backward = |micro, chunk| Action::Backward { micro, chunk };
    match shape.kind {
        ScheduleKind::Gpipe => {
            let mut order: Vec<Action> = (0..m_count).map(|m| forward(m, stage)).collect();
            order.extend((0..m_count).map(|m| backward(m, stage)));
            order
        }
        ScheduleKind::OneFOneB => {
            let warmup = (p_count - 1 - stage).min(m_count);
            let mut order: Vec<Action> = (0..warmup).map(|m| forward(m, stage)).collect();
            for i in 0..m_count - warmup {
                order.push(forward(warmup + i, stage));
                order.push(backward(i, stage));
            }
            order.extend((m_count - warmup..m_count).map(|m| backward(m, stage)));
            order
        }
        ScheduleKind::Interleaved => {
            // Megatron-LM's forward_backward_pipelining_with_interleaving: the k-th forward of
            // a stage takes micro-batch group k / (P V) (P micro-batches), chunk (k mod PV) / P;
            // backwards take the chunks in reverse.
            let v_count = shape.virtual_stages;
            let total = m_count * v_count;
            let group = p_count * v_count;
            let micro_of = |k: usize| (k / group) * p_count + k % p_count;
            let local_chunk = |k: usize, forward: bool| {
                let c = (k % group) / p_count;
                if forward { c } else { v_count - 1 - c }
            };
            let chunk = |k: usize, forward: bool| local_chunk(k, forward) * p_count + stage;
            let warmup = ((p_count - stage - 1) * 2 + (v_count - 1) * p_count).min(total);
            let mut order: Vec<Action> = (0..warmup).map(|k| forward(micro_of(k), chunk(k, true))).collect();
            for i in 0..total - warmup {
                let k = warmup + i;
                order.push(forward(micro_of(k), chunk(k, true)));
                order.push(backward(micro_of(i), chunk(i, false)));
            }
            order.extend((total - warmup..total).map(|k| backward(micro_of(k), chunk(k, false))));
            order
        }
        ScheduleKind::ZbH1 => {
            // 1F1B's forwards and B's; stage p's W's trail its B's by p (the last stage's B is
            // what the stages before wait for; the first stage's idle cool-down takes its W's
            // at once), the W's left over fill the end.
            let warmup = (p_count - 1 - stage).min(m_count);
            let (input, weight) = (|micro| Action::BackwardInput { micro, chunk: stage }, |micro| Action::BackwardWeight { micro, chunk: stage });
            let mut order: Vec<Action> = (0..warmup).map(|m| forward(m, stage)).collect();
            let mut weights = 0;
            for i in 0..m_count {
                if i + warmup < m_count {
                    order.push(forward(i + warmup, stage));
                }
                order.push(input(i));
                if i >= stage {
                    order.push(weight(weights));
                    weights += 1;
                }
            }
            order.extend((weights..m_count).map(weight));
            order
        }
        ScheduleKind::ZbV => zb_v_orders(shape).swap_remove(stage),
    }
}

/// ZB-V's compute order on every stage: of two list schedules, the one whose replay idles least
/// under the V's own unit costs (F = B = W = 1, except the first chunk's B, which takes no time
/// since its input is the images, and its W, which is then its whole backward: 2). One list
/// schedule is made with those costs, the other as if every chunk's B took a unit (a balanced
/// V); neither wins everywhere (under the V's costs: P = 4, M = 4 idles 11.1% against 20.0%,
/// P = 3, M = 8 5.9% against 7.7%). The order is data, the same on every rank; the measured
/// times only move when each action happens, never the order.
pub fn zb_v_orders(shape: &Shape) -> Vec<Vec<Action>> {
    let v_costs = zb_v_unit_costs(shape.chunks());
    let bubble = |orders: &Vec<Vec<Action>>| replay_orders(shape, orders, &v_costs).map_or(f64::INFINITY, |r| r.makespan);
    let (empty_first_b, balanced) = (zb_v_list_schedule(shape, true), zb_v_list_schedule(shape, false));
    if bubble(&balanced) <= bubble(&empty_first_b) { balanced } else { empty_first_b }
}

/// The V's unit costs as the executor runs it: F = B = W = 1, but the first chunk's B takes no
/// time and its W is its whole backward (2).
fn zb_v_unit_costs(chunks: usize) -> Costs {
    let (mut input_grad, mut weight_grad) = (vec![1.0; chunks], vec![1.0; chunks]);
    (input_grad[0], weight_grad[0]) = (0.0, 2.0);
    Costs { forward: vec![1.0; chunks], input_grad, weight_grad }
}

/// A list schedule of ZB-V made by replaying the step with unit costs (messages free), each
/// stage taking, whenever it is free, the first that can start of: a B (the earliest
/// micro-batch, the later chunk first), a forward while it holds fewer than 2P (micro-batch,
/// chunk) activations (1F1B's peak: P micro-batches of a stage of two chunks; the later chunk
/// first), a W (the oldest B's). With `empty_first_b` the first chunk's B takes no time and its
/// W two units (what the executor does), else every action one.
fn zb_v_list_schedule(shape: &Shape, empty_first_b: bool) -> Vec<Vec<Action>> {
    let (p_count, m_count, chunks) = (shape.stages, shape.micro_batches, shape.chunks());
    let limit = 2 * p_count;
    let ticks = |a: &Action| -> u64 {
        match *a {
            Action::BackwardInput { chunk: 0, .. } if empty_first_b => 0,
            Action::BackwardWeight { chunk: 0, .. } if empty_first_b => 2,
            _ => 1,
        }
    };
    // Per (chunk, micro): when its forward and its B end (None: not yet run).
    let mut forward_end = vec![vec![None::<u64>; m_count]; chunks];
    let mut input_end = vec![vec![None::<u64>; m_count]; chunks];
    let mut next_forward = vec![0usize; chunks];
    let mut next_input = vec![0usize; chunks];
    let mut weights_due: Vec<std::collections::VecDeque<(usize, usize)>> = vec![Default::default(); p_count];
    let mut alive = vec![0usize; p_count];
    let mut free_at = vec![0u64; p_count];
    let mut orders: Vec<Vec<Action>> = vec![Vec::new(); p_count];
    let total = 3 * m_count * chunks;
    let mut done = 0;
    let mut now = 0u64;
    while done < total {
        for p in 0..p_count {
            // A stage free now takes actions until one takes time (the first chunk's B takes
            // none) or none can start.
            while free_at[p] <= now {
                let ready = |end: Option<u64>| end.is_some_and(|t| t <= now);
                let mut mine = shape.chunks_of(p);
                mine.reverse(); // the later chunk first
                let input = mine
                    .iter()
                    .filter_map(|&c| {
                        let m = next_input[c];
                        let gradient_ready = c + 1 == chunks || ready(input_end[c + 1].get(m).copied().flatten());
                        (m < m_count && ready(forward_end[c][m]) && gradient_ready).then_some((m, c))
                    })
                    .min_by_key(|&(m, c)| (m, std::cmp::Reverse(c)));
                let action = if let Some((micro, chunk)) = input {
                    next_input[chunk] += 1;
                    weights_due[p].push_back((micro, chunk));
                    Action::BackwardInput { micro, chunk }
                } else if let Some(chunk) = mine.iter().copied().find(|&c| {
                    let m = next_forward[c];
                    alive[p] < limit && m < m_count && (c == 0 || ready(forward_end[c - 1][m]))
                }) {
                    next_forward[chunk] += 1;
                    alive[p] += 1;
                    Action::Forward { micro: next_forward[chunk] - 1, chunk }
                } else if let Some((micro, chunk)) = weights_due[p].pop_front() {
                    alive[p] -= 1;
                    Action::BackwardWeight { micro, chunk }
                } else {
                    break;
                };
                let end = now + ticks(&action);
                match action {
                    Action::BackwardInput { micro, chunk } => input_end[chunk][micro] = Some(end),
                    Action::Forward { micro, chunk } => forward_end[chunk][micro] = Some(end),
                    _ => {}
                }
                orders[p].push(action);
                free_at[p] = end;
                done += 1;
            }
        }
        now += 1;
        assert!(now <= 4 * total as u64 + 4, "ZB-V's list schedule made no progress (a bug in zb_v_orders)");
    }
    orders
}

/// The full list of `stage`'s actions in one step: the compute order, each forward's output
/// sent and each backward's input gradient sent right after it, and each receive posted one
/// compute action before the one that needs it (so that its transfer overlaps that compute;
/// the receives of the first two compute actions are posted at the start).
/// Under ZB-V the turn of the V (chunk P-1 to chunk P, both on the last stage) is a message
/// the stage sends itself, which MPI delivers as a local copy: one executor for every schedule.
pub fn schedule(shape: &Shape, stage: usize) -> Vec<Action> {
    schedule_of(shape, &compute_order(shape, stage))
}

/// [`schedule`] of a given compute order.
fn schedule_of(shape: &Shape, compute: &[Action]) -> Vec<Action> {
    let last = shape.chunks() - 1;
    let needs = |a: &Action| match *a {
        Action::Forward { micro, chunk } if chunk > 0 => Some(Action::ReceiveActivation { micro, chunk }),
        Action::Backward { micro, chunk } | Action::BackwardInput { micro, chunk } if chunk < last => Some(Action::ReceiveGradient { micro, chunk }),
        _ => None,
    };
    let sends = |a: &Action| match *a {
        Action::Forward { micro, chunk } if chunk < last => Some(Action::SendActivation { micro, chunk }),
        Action::Backward { micro, chunk } | Action::BackwardInput { micro, chunk } if chunk > 0 => Some(Action::SendGradient { micro, chunk }),
        _ => None,
    };
    with_messages(compute, needs, sends)
}

/// `compute` with each action's receive (`needs`) posted one compute action before it (the
/// first two at the start) and each action's send right after it.
fn with_messages(compute: &[Action], needs: impl Fn(&Action) -> Option<Action>, sends: impl Fn(&Action) -> Option<Action>) -> Vec<Action> {
    let mut actions = Vec::with_capacity(compute.len() * 3);
    actions.extend(compute.first().and_then(&needs));
    for (i, a) in compute.iter().enumerate() {
        actions.extend(compute.get(i + 1).and_then(&needs));
        actions.push(*a);
        actions.extend(sends(a));
    }
    actions
}

/// The most micro-batches (per chunk) that `stage` holds at once under training's schedule:
/// forwards not yet matched by their backward (a split backward's W, which lets the graph go),
/// at the worst point of its compute order (GPipe M, 1F1B min(P - p, M), interleaved
/// Megatron-LM's warm-up plus one, ZB-H1 at most P, ZB-V at most 2P of half a stage each).
pub fn peak_held(shape: &Shape, stage: usize) -> usize {
    let mut alive = 0usize;
    let mut peak = 0;
    for a in compute_order(shape, stage) {
        match a {
            Action::Forward { .. } => alive += 1,
            Action::Backward { .. } | Action::BackwardWeight { .. } => alive -= 1,
            _ => {}
        }
        peak = peak.max(alive);
    }
    peak
}

/// Evaluation's schedule for `stage` over `micro_batches` micro-batches (any count: the test
/// set's, not training's M): forwards only, in the order training runs its forwards (chunk
/// after chunk for P micro-batches at a time when interleaved), each input's receive posted one
/// forward ahead and each output sent right after its forward. Stage p forwards micro-batch m
/// while stage p + 1 forwards m - 1. The executor keeps at most [`peak_held`] outputs in flight
/// (sent, not yet received): before a forward whose output it will send, it waits for its
/// oldest send until fewer are in flight, so that evaluation holds no more micro-batches than
/// training does; [`replay_forwards`] checks that this cannot deadlock.
pub fn forward_schedule(shape: &Shape, stage: usize, micro_batches: usize) -> Vec<Action> {
    let (p_count, last) = (shape.stages, shape.chunks() - 1);
    let mut compute = Vec::with_capacity(micro_batches * shape.virtual_stages);
    let chunks = shape.chunks_of(stage);
    for group in (0..micro_batches).step_by(p_count) {
        let members = group..(group + p_count).min(micro_batches);
        if chunks.len() == 2 && chunks[1] == chunks[0] + 1 {
            // ZB-V's last stage holds the turn of the V, two chunks in a row: each micro-batch
            // through both at once, its message to itself received one forward later (held
            // back, the stage's own sends would fill its window with nobody else to drain it).
            compute.extend(members.clone().flat_map(|micro| chunks.iter().map(move |&chunk| Action::Forward { micro, chunk })));
            continue;
        }
        // Without interleaving a stage's one chunk: micro-batch after micro-batch.
        for &chunk in &chunks {
            compute.extend(members.clone().map(|micro| Action::Forward { micro, chunk }));
        }
    }
    let needs = |a: &Action| match *a {
        Action::Forward { micro, chunk } if chunk > 0 => Some(Action::ReceiveActivation { micro, chunk }),
        _ => None,
    };
    let sends = |a: &Action| match *a {
        Action::Forward { micro, chunk } if chunk < last => Some(Action::SendActivation { micro, chunk }),
        _ => None,
    };
    with_messages(&compute, needs, sends)
}

// The schedule's bubble is a replay's, so it is priced here, beside the schedules the replay
// runs, rather than with the rest of Shape (src/plan/pipeline/shape.rs), below the replay.
impl Shape {
    /// The bubble of the schedule with balanced stages, free messages and a backward twice the
    /// forward (B = W = F where it is split): the idle share of a stage's step, (P-1)/(M+P-1)
    /// for GPipe and 1F1B, with P-1 divided by V when interleaved; for the zero-bubble
    /// schedules their replay's at these costs: (P-1)/(3M+P-1) for ZB-H1 from M = P
    /// ((P-1)(F+B-W) idle against M(F+B+W) busy), about (P-1)/2 / (3M + (P-1)/2) for ZB-V.
    pub fn theoretical_bubble(&self) -> f64 {
        match self.kind {
            ScheduleKind::ZbH1 | ScheduleKind::ZbV => {
                let each = vec![1.0 / self.virtual_stages as f64; self.chunks()];
                replay(self, &Costs { forward: each.clone(), input_grad: each.clone(), weight_grad: each }).map_or(f64::NAN, |r| r.mean_bubble())
            }
            _ => {
                let fill = (self.stages - 1) as f64 / self.virtual_stages as f64;
                fill / (self.micro_batches as f64 + fill)
            }
        }
    }
}

/// A schedule's idle time per step against its busy time, with balanced stages, free messages
/// and F = B = W (an unsplit backward twice the forward), for pricing layouts that are never
/// run (`hpc-train project`): GPipe and 1F1B (P-1)/M, interleaved (P-1)/(VM); ZB-H1
/// (P-1)/(3M) and ZB-V at its least, (P-1)/(6M) (the last stage waits for the first
/// micro-batch's P-1 half-stage forwards), from M = P, where the unit tests show the replay
/// reaching them (ZB-V up to P = 4, within 1.1x + 1 half-forward beyond); below M = P the
/// replay itself, whose size is then small. Closed forms elsewhere, because a plan prices
/// thousands of layouts of up to hundreds of stages. ZB-V is priced as the paper's balanced V,
/// whose first chunk computes a B too; the executor's first chunk has none (its input is the
/// images), which costs the V a few points its price leaves out (P = 2, M = 4: 7.7% against
/// 4.0%; see [`zb_v_orders`]).
pub fn idle_per_busy(shape: &Shape) -> f64 {
    let (p, m) = (shape.stages as f64, shape.micro_batches as f64);
    let replayed = || {
        let each = vec![1.0 / shape.virtual_stages as f64; shape.chunks()];
        replay(shape, &Costs { forward: each.clone(), input_grad: each.clone(), weight_grad: each }).map_or(f64::NAN, |r| r.makespan / (3.0 * m) - 1.0)
    };
    match shape.kind {
        ScheduleKind::Gpipe | ScheduleKind::OneFOneB => (p - 1.0) / m,
        ScheduleKind::Interleaved => (p - 1.0) / (shape.virtual_stages as f64 * m),
        _ if shape.micro_batches < shape.stages => replayed(),
        ScheduleKind::ZbH1 => (p - 1.0) / (3.0 * m),
        ScheduleKind::ZbV => (p - 1.0) / (6.0 * m),
    }
}

/// Replays one step: every stage runs its [`schedule`] in order; a compute action starts once
/// the stage is free and its input has been sent; sends are non-blocking. Fails, naming the
/// stuck stages, when no stage can go on (a deadlock), or when a message is received that
/// nobody sends or sent that nobody receives.
pub fn replay(shape: &Shape, costs: &Costs) -> Result<Replay, String> {
    replay_with_messages(shape, costs, &[])
}

/// [`replay`] where posting a message to another stage (a send or a receive) takes its stage
/// `message[stage]` of time, which counts as idle: what the executor spends on a message
/// outside computing and outside waiting for one (making its buffer, posting it, testing it),
/// measured per stage. A send leaves once posted. A stage missing from `message` pays nothing.
/// The turn of ZB-V's V, where both chunks are one stage's, is no message.
pub fn replay_with_messages(shape: &Shape, costs: &Costs, message: &[f64]) -> Result<Replay, String> {
    let plans: Vec<Vec<Action>> = (0..shape.stages).map(|p| schedule(shape, p)).collect();
    replay_plans(shape, &plans, costs, message)
}

/// [`replay`] of given compute orders, one per stage.
fn replay_orders(shape: &Shape, orders: &[Vec<Action>], costs: &Costs) -> Result<Replay, String> {
    let plans: Vec<Vec<Action>> = orders.iter().map(|order| schedule_of(shape, order)).collect();
    replay_plans(shape, &plans, costs, &[])
}

/// Replays evaluation over `micro_batches`: every stage's [`forward_schedule`], with
/// [`peak_held`] sends in flight at most, as the executor runs it; fails naming the stuck
/// stages when no stage can go on (a deadlock), or when sends and receives do not pair up.
#[cfg(test)]
pub fn replay_forwards(shape: &Shape, micro_batches: usize, forward_cost: &[f64]) -> Result<ForwardReplay, String> {
    let plans: Vec<Vec<Action>> = (0..shape.stages).map(|p| forward_schedule(shape, p, micro_batches)).collect();
    let windows: Vec<usize> = (0..shape.stages).map(|p| peak_held(shape, p)).collect();
    replay_forward_plans(shape, &plans, &windows, forward_cost)
}

/// How many messages `stage` posts per step under training's [`schedule`] (sends and receives
/// to other stages).
pub fn messages_per_step(shape: &Shape, stage: usize) -> usize {
    schedule(shape, stage).iter().filter(|a| message_peer(shape, a).is_some_and(|peer| peer != stage)).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPipe on 2 stages with one micro-batch, F = B = 1 and every message c: stage 0 posts the
    /// gradient's receive (c), forwards (1) and sends (c); stage 1 waits for it, forwards and
    /// backwards (2) and sends the gradient (c); stage 0's backward (1) ends the step at 4 + 3c.
    #[test]
    fn messages_cost_their_stage_time_and_the_turn_of_the_v_costs_nothing() {
        let shape = Shape::new(ScheduleKind::Gpipe, 2, 1, 1).unwrap();
        let unit = Costs { forward: vec![1.0], input_grad: vec![1.0], weight_grad: vec![0.0] };
        for c in [0.0, 0.5, 2.0] {
            let r = replay_with_messages(&shape, &unit, &[c, c]).unwrap();
            assert!((r.makespan - (4.0 + 3.0 * c)).abs() < 1e-12, "c = {c}: {}", r.makespan);
            assert_eq!(r.busy, vec![2.0, 2.0], "messages are not compute");
        }
        assert_eq!(replay_with_messages(&shape, &unit, &[]).unwrap().makespan, replay(&shape, &unit).unwrap().makespan);
        // Each stage of every schedule posts 2 messages per micro-batch and boundary it has
        // with another stage: ZB-V's stage P-1 holds both chunks at the turn of the V, and that
        // boundary is no message.
        for shape in shapes().into_iter().filter(|s| s.stages > 1) {
            let chunks = shape.chunks();
            for stage in 0..shape.stages {
                let crossing = (0..chunks - 1).filter(|&b| shape.stage_of(b) != shape.stage_of(b + 1));
                let mine = crossing.map(|b| usize::from(shape.stage_of(b) == stage) + usize::from(shape.stage_of(b + 1) == stage)).sum::<usize>();
                assert_eq!(messages_per_step(&shape, stage), 2 * shape.micro_batches * mine, "{shape:?} stage {stage}");
            }
        }
        let v = Shape::new(ScheduleKind::ZbV, 2, 4, 1).unwrap();
        assert_eq!((messages_per_step(&v, 0), messages_per_step(&v, 1)), (16, 16));
    }

    fn shapes() -> Vec<Shape> {
        let mut all = Vec::new();
        for p in 1..=5 {
            for m in [1, 2, 3, 4, 7, 8, 16] {
                for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB, ScheduleKind::ZbH1, ScheduleKind::ZbV] {
                    all.push(Shape::new(kind, p, m, 1).unwrap());
                }
                for v in [2, 3] {
                    if let Ok(s) = Shape::new(ScheduleKind::Interleaved, p, m, v) {
                        all.push(s);
                    }
                }
            }
        }
        all
    }

    #[test]
    fn every_micro_batch_is_forwarded_and_backwarded_once_per_chunk_in_order() {
        for shape in shapes() {
            for stage in 0..shape.stages {
                let order = compute_order(&shape, stage);
                let of = |chunk: usize, pick: fn(&Action) -> Option<(usize, usize)>| -> Vec<usize> { order.iter().filter_map(pick).filter(|&(_, c)| c == chunk).map(|(m, _)| m).collect() };
                for chunk in shape.chunks_of(stage) {
                    let all: Vec<usize> = (0..shape.micro_batches).collect();
                    assert_eq!(of(chunk, |a| match *a { Action::Forward { micro, chunk } => Some((micro, chunk)), _ => None }), all, "{shape:?} stage {stage} chunk {chunk}");
                    // In micro-batch order: the gradients accumulate as one process adds them.
                    let (whole, input, weight) = (
                        of(chunk, |a| match *a { Action::Backward { micro, chunk } => Some((micro, chunk)), _ => None }),
                        of(chunk, |a| match *a { Action::BackwardInput { micro, chunk } => Some((micro, chunk)), _ => None }),
                        of(chunk, |a| match *a { Action::BackwardWeight { micro, chunk } => Some((micro, chunk)), _ => None }),
                    );
                    if shape.kind.splits_backward() {
                        assert!(whole.is_empty() && input == all && weight == all, "{shape:?} stage {stage} chunk {chunk}: B {input:?}, W {weight:?}");
                    } else {
                        assert!(whole == all && input.is_empty() && weight.is_empty(), "{shape:?} stage {stage} chunk {chunk}");
                    }
                }
                // A micro-batch's backward (or B) comes after its forward through the same
                // chunk, and its W after its B.
                for (i, a) in order.iter().enumerate() {
                    let before = match *a {
                        Action::Backward { micro, chunk } | Action::BackwardInput { micro, chunk } => Action::Forward { micro, chunk },
                        Action::BackwardWeight { micro, chunk } => Action::BackwardInput { micro, chunk },
                        _ => continue,
                    };
                    assert!(order[..i].contains(&before), "{shape:?} stage {stage}: {a:?} before {before:?}");
                }
            }
        }
    }

    #[test]
    fn sends_match_receives_and_no_schedule_deadlocks() {
        for shape in shapes() {
            let unit = vec![1.0; shape.chunks()];
            let double = vec![2.0; shape.chunks()];
            replay(&shape, &Costs::unsplit(&unit, &double)).unwrap_or_else(|e| panic!("{shape:?}: {e}"));
            // Uneven stages cannot deadlock a schedule either.
            let uneven: Vec<f64> = (0..shape.chunks()).map(|c| 1.0 + (c * 7 % 5) as f64).collect();
            let falling: Vec<f64> = (0..shape.chunks()).map(|c| (shape.chunks() - c) as f64).collect();
            replay(&shape, &Costs { forward: uneven.clone(), input_grad: falling.clone(), weight_grad: uneven.clone() }).unwrap_or_else(|e| panic!("{shape:?}: {e}"));
            replay(&shape, &Costs::unsplit(&uneven, &uneven)).unwrap_or_else(|e| panic!("{shape:?}: {e}"));
        }
    }

    #[test]
    fn a_receive_is_posted_before_the_compute_that_needs_it_and_a_step_ahead() {
        let shape = Shape::new(ScheduleKind::OneFOneB, 4, 8, 1).unwrap();
        let plan = schedule(&shape, 2);
        // Stage 2's second forward (micro-batch 1) has its receive posted before the first.
        let first_forward = plan.iter().position(|a| *a == Action::Forward { micro: 0, chunk: 2 }).unwrap();
        let posted = plan.iter().position(|a| *a == Action::ReceiveActivation { micro: 1, chunk: 2 }).unwrap();
        assert!(posted < first_forward, "{plan:?}");
    }

    #[test]
    fn balanced_bubbles_are_the_theory() {
        // The zero-bubble schedules' theory is their replay (tested against the formulas below).
        for shape in shapes().into_iter().filter(|s| !s.kind.splits_backward()) {
            // F = B = W: an unsplit backward twice the forward.
            let f = vec![1.0 / shape.virtual_stages as f64; shape.chunks()];
            let replay = replay(&shape, &Costs { forward: f.clone(), input_grad: f.clone(), weight_grad: f }).unwrap();
            for stage in 0..shape.stages {
                let (got, want) = (replay.bubble(stage), shape.theoretical_bubble());
                assert!((got - want).abs() < 1e-9, "{shape:?} stage {stage}: bubble {got}, theory {want}");
            }
        }
    }

    #[test]
    fn gpipe_holds_every_micro_batch_and_1f1b_at_most_the_stages_left() {
        for p in 1..=5 {
            for m in [1, 3, 4, 8, 16] {
                let gpipe = replay(&Shape::new(ScheduleKind::Gpipe, p, m, 1).unwrap(), &Costs::unsplit(&[1.0], &[2.0])).unwrap();
                let one = replay(&Shape::new(ScheduleKind::OneFOneB, p, m, 1).unwrap(), &Costs::unsplit(&[1.0], &[2.0])).unwrap();
                for stage in 0..p {
                    assert_eq!(gpipe.peak_alive[stage], m);
                    assert_eq!(one.peak_alive[stage], (p - stage).min(m), "P {p} M {m} stage {stage}");
                }
            }
        }
        // Interleaved: Megatron-LM's warm-up bound, in chunk-sized activations.
        let shape = Shape::new(ScheduleKind::Interleaved, 4, 8, 2).unwrap();
        let r = replay(&shape, &Costs::unsplit(&[0.5], &[1.0])).unwrap();
        for stage in 0..4 {
            assert!(r.peak_alive[stage] <= (4 - stage - 1) * 2 + 4 + 1, "stage {stage}: {}", r.peak_alive[stage]);
        }
    }

    #[test]
    fn peak_held_is_what_the_replay_of_training_holds() {
        for shape in shapes() {
            let r = replay(&shape, &Costs { forward: vec![1.0], input_grad: vec![1.0], weight_grad: vec![1.0] }).unwrap();
            for stage in 0..shape.stages {
                assert_eq!(peak_held(&shape, stage), r.peak_alive[stage], "{shape:?} stage {stage}");
            }
        }
        let one = Shape::new(ScheduleKind::OneFOneB, 4, 8, 1).unwrap();
        assert_eq!((0..4).map(|p| peak_held(&one, p)).collect::<Vec<_>>(), vec![4, 3, 2, 1]);
        assert_eq!(peak_held(&Shape::new(ScheduleKind::Gpipe, 4, 8, 1).unwrap(), 3), 8);
    }

    /// Evaluation forwards every micro-batch once through every chunk, in training's forward
    /// order where the counts are training's, with no backward and no gradient message.
    #[test]
    fn evaluation_forwards_each_micro_batch_once_per_chunk_in_trainings_order() {
        for shape in shapes() {
            for micro_batches in [0, 1, 2, 3, shape.micro_batches, 2 * shape.micro_batches + 1] {
                for stage in 0..shape.stages {
                    let plan = forward_schedule(&shape, stage, micro_batches);
                    assert!(plan.iter().all(|a| matches!(a, Action::Forward { .. } | Action::ReceiveActivation { .. } | Action::SendActivation { .. })), "{shape:?}: {plan:?}");
                    for chunk in shape.chunks_of(stage) {
                        let forwards: Vec<usize> = plan.iter().filter_map(|a| match *a { Action::Forward { micro, chunk: c } if c == chunk => Some(micro), _ => None }).collect();
                        assert_eq!(forwards, (0..micro_batches).collect::<Vec<_>>(), "{shape:?} stage {stage} chunk {chunk}");
                    }
                    // ZB-V's list schedule orders its forwards by the replay, not chunk by chunk.
                    if micro_batches == shape.micro_batches && shape.kind != ScheduleKind::ZbV {
                        let training: Vec<Action> = compute_order(&shape, stage).into_iter().filter(|a| matches!(a, Action::Forward { .. })).collect();
                        let evaluation: Vec<Action> = plan.into_iter().filter(|a| matches!(a, Action::Forward { .. })).collect();
                        assert_eq!(evaluation, training, "{shape:?} stage {stage}");
                    }
                }
            }
        }
    }

    /// No schedule deadlocks with the executor's bound on sends in flight, whatever the stages'
    /// speeds and the number of micro-batches, and the bound holds.
    #[test]
    fn evaluation_never_deadlocks_and_holds_no_more_than_training() {
        for shape in shapes() {
            for micro_batches in [1, 2, 3, 5, shape.micro_batches, 2 * shape.micro_batches + 1, 17] {
                let uneven: Vec<f64> = (0..shape.chunks()).map(|c| 1.0 + (c * 7 % 5) as f64).collect();
                let falling: Vec<f64> = (0..shape.chunks()).map(|c| (shape.chunks() - c) as f64).collect();
                for costs in [vec![1.0; shape.chunks()], uneven, falling] {
                    let r = replay_forwards(&shape, micro_batches, &costs).unwrap_or_else(|e| panic!("{shape:?}, {micro_batches} micro-batches, costs {costs:?}: {e}"));
                    for stage in 0..shape.stages {
                        assert!(r.peak_in_flight[stage] <= peak_held(&shape, stage), "{shape:?} stage {stage}: {} in flight", r.peak_in_flight[stage]);
                    }
                    // Every chunk's forward ran once per micro-batch, on some stage.
                    let computed: f64 = r.busy.iter().sum();
                    let expected = micro_batches as f64 * costs.iter().sum::<f64>();
                    assert!((computed - expected).abs() < 1e-9, "{shape:?}, {micro_batches} micro-batches: {computed} of {expected} computed");
                }
            }
        }
    }

    /// Balanced stages run evaluation as a pipeline: K micro-batches over P stages take K + P - 1
    /// forward times (stage p on micro-batch m while stage p + 1 is on m - 1), not K x P.
    #[test]
    fn evaluation_is_pipelined() {
        for p in 1..=5 {
            for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
                let shape = Shape::new(kind, p, 4, 1).unwrap();
                for k in [1, 4, 9, 40] {
                    let r = replay_forwards(&shape, k, &[1.0]).unwrap();
                    assert_eq!(r.makespan, (k + p - 1) as f64, "{shape:?}, {k} micro-batches");
                }
            }
        }
        // Interleaved: V chunks of half the time each, the bubble divided by V as in training.
        let shape = Shape::new(ScheduleKind::Interleaved, 2, 4, 2).unwrap();
        let r = replay_forwards(&shape, 40, &[0.5]).unwrap();
        assert!(r.makespan < 40.0 + 1.0, "{}", r.makespan);
    }

    /// ZB-H1 with F = B = W idles (P-1)(F+B-W) a step on every stage, a third of 1F1B's
    /// (P-1)(F+B+W) (DeepSeek's DualPipe table), at 1F1B's memory: at most P micro-batches.
    /// ZB-V's bubble is near zero from M = 2P, at the same memory in chunk halves (2P).
    #[test]
    fn zero_bubble_schedules_keep_1f1bs_memory_and_cut_its_bubble() {
        let third = |chunks: usize, v: f64| Costs { forward: vec![1.0 / v; chunks], input_grad: vec![1.0 / v; chunks], weight_grad: vec![1.0 / v; chunks] };
        for p in 1..=6 {
            for m in [1, 2, 3, 4, 6, 8, 12, 16, 32] {
                let one = Shape::new(ScheduleKind::OneFOneB, p, m, 1).unwrap();
                let h1 = Shape::new(ScheduleKind::ZbH1, p, m, 1).unwrap();
                let v = Shape::new(ScheduleKind::ZbV, p, m, 1).unwrap();
                // ZB-V's formula is the paper's balanced V, every chunk's B a unit: its list
                // schedule of that model (the executor's order also weighs the first chunk's
                // empty B: zb_v_orders_weigh_the_first_chunks_empty_b).
                let balanced_v = zb_v_list_schedule(&v, false);
                let (r1, rh, rv) = (replay(&one, &third(p, 1.0)).unwrap(), replay(&h1, &third(p, 1.0)).unwrap(), replay_orders(&v, &balanced_v, &third(2 * p, 2.0)).unwrap());
                let idle = |r: &Replay| r.makespan - 3.0 * m as f64;
                assert!((idle(&r1) - 3.0 * (p - 1) as f64).abs() < 1e-9, "1F1B P {p} M {m}: {}", idle(&r1));
                if m >= p {
                    assert!((idle(&rh) - (p - 1) as f64).abs() < 1e-9, "ZB-H1 P {p} M {m}: idle {}", idle(&rh));
                }
                assert!(idle(&rh) <= idle(&r1) + 1e-9 && idle(&rv) <= idle(&rh) + 1e-9, "P {p} M {m}: 1F1B {}, ZB-H1 {}, ZB-V {}", idle(&r1), idle(&rh), idle(&rv));
                // ZB-V: the last stage waits for the first micro-batch's P-1 half-stage forwards
                // whatever the schedule, so (P-1)/2 is the least idle time; the list schedule
                // reaches it up to 4 stages and stays within 1.1 x (P-1)/2 + 1 beyond (from M = P).
                let least = (p - 1) as f64 / 2.0;
                assert!(idle(&rv) >= least - 1e-9, "ZB-V P {p} M {m}: idle {} below the bound", idle(&rv));
                if m >= p && p <= 4 {
                    assert!((idle(&rv) - least).abs() < 1e-9, "ZB-V P {p} M {m}: idle {}, the least is {least}", idle(&rv));
                }
                if m >= 2 && p >= 2 {
                    assert!(idle(&rv) < idle(&rh) && (m < p || idle(&rv) <= 1.1 * least + 1.0), "ZB-V P {p} M {m}: idle {} against ZB-H1's {}", idle(&rv), idle(&rh));
                }
                let one_peak = (0..p).map(|s| peak_held(&one, s)).max().unwrap();
                for stage in 0..p {
                    assert!(peak_held(&h1, stage) <= one_peak, "ZB-H1 P {p} M {m} stage {stage}: {}", peak_held(&h1, stage));
                    assert!(peak_held(&v, stage) <= 2 * one_peak.max(1), "ZB-V P {p} M {m} stage {stage}: {}", peak_held(&v, stage));
                }
            }
        }
        // The V: stage 0 holds the first and the last chunk, the last stage the turn.
        let v = Shape::new(ScheduleKind::ZbV, 4, 8, 1).unwrap();
        assert_eq!((v.chunks_of(0), v.chunks_of(3), v.loss_stage()), (vec![0, 7], vec![3, 4], 0));
        assert_eq!((0..8).map(|c| v.stage_of(c)).collect::<Vec<_>>(), vec![0, 1, 2, 3, 3, 2, 1, 0]);
    }

    /// The executor's ZB-V order idles no more than either list schedule under the V's own
    /// costs (the first chunk's B empty, its W the whole backward), and less than the balanced
    /// V's order where the two differ most.
    #[test]
    fn zb_v_orders_weigh_the_first_chunks_empty_b() {
        for p in 2..=8 {
            for m in [2, 4, 8, 16, 32] {
                let v = Shape::new(ScheduleKind::ZbV, p, m, 1).unwrap();
                let costs = zb_v_unit_costs(v.chunks());
                let chosen = replay(&v, &costs).unwrap();
                for empty_first_b in [true, false] {
                    let other = replay_orders(&v, &zb_v_list_schedule(&v, empty_first_b), &costs).unwrap();
                    assert!(chosen.makespan <= other.makespan, "P {p} M {m}: {} against {} ({empty_first_b})", chosen.makespan, other.makespan);
                }
                assert!(chosen.peak_alive.iter().all(|&a| a <= 2 * p), "P {p} M {m}: {:?}", chosen.peak_alive);
            }
        }
        let bubble = |p, m, empty_first_b| {
            let v = Shape::new(ScheduleKind::ZbV, p, m, 1).unwrap();
            replay_orders(&v, &zb_v_list_schedule(&v, empty_first_b), &zb_v_unit_costs(v.chunks())).unwrap().mean_bubble()
        };
        assert!((bubble(4, 4, true) - 3.0 / 27.0).abs() < 1e-9 && (bubble(4, 4, false) - 6.0 / 30.0).abs() < 1e-9);
        assert!(bubble(3, 8, false) < bubble(3, 8, true));
    }

    /// The prices `project` uses are the replay's, where the replay reaches them.
    #[test]
    fn the_priced_idle_time_is_the_replays() {
        for p in 1..=4 {
            for m in [1, 2, 3, 4, 8, 16] {
                for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB, ScheduleKind::ZbH1, ScheduleKind::ZbV] {
                    let shape = Shape::new(kind, p, m, 1).unwrap();
                    let each = vec![1.0 / shape.virtual_stages as f64; shape.chunks()];
                    let costs = Costs { forward: each.clone(), input_grad: each.clone(), weight_grad: each };
                    // ZB-V is priced as the paper's balanced V (see zb_v_orders).
                    let r = match kind {
                        ScheduleKind::ZbV if m >= p => replay_orders(&shape, &zb_v_list_schedule(&shape, false), &costs),
                        _ => replay(&shape, &costs),
                    }
                    .unwrap();
                    let replayed = r.makespan / (3.0 * m as f64) - 1.0;
                    assert!((idle_per_busy(&shape) - replayed).abs() < 1e-9, "{shape:?}: priced {}, replayed {replayed}", idle_per_busy(&shape));
                }
            }
        }
    }
}
