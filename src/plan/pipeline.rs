//! Pipeline parallelism as data: which rank holds which stage ([`Grid`]), where the model is cut
//! ([`balance`], [`cuts_from_list`]), and what each stage does in one training step
//! ([`schedule`]): an ordered list of [`Action`]s that the stage's engine (src/pipeline.rs)
//! executes one by one, computed and unit-tested here without MPI.
//!
//! Vocabulary. The model's blocks are cut into `chunks` consecutive pieces; chunk `c` lives on
//! stage `c % P` (Megatron-LM's interleaving: with V virtual stages a stage holds chunks
//! p, p + P, ..., p + (V-1)P; with V = 1 chunk c is stage c). Boundary `b` (1..chunks) lies
//! between chunk b-1 and chunk b: activations cross it forwards, their gradients backwards.
//!
//! The three schedules (P stages, M micro-batches):
//! - GPipe (Huang et al. 2019): every forward, then every backward; M micro-batches alive.
//! - 1F1B (PipeDream-Flush, Narayanan et al. 2021): P-1-p warm-up forwards on stage p, then
//!   one forward and one backward in turn, then the remaining backwards; at most P-p alive.
//! - Interleaved 1F1B (Megatron-LM): the same with V chunks per stage, taken P micro-batches
//!   at a time, which divides the bubble by V at the price of V times the messages.
//!
//! Backwards run in micro-batch order on every chunk under every schedule, so the gradients
//! accumulate in the same order as one process that sums the micro-batches in turn: the
//! schedule changes when work happens, never the arithmetic.
//!
//! Evaluation runs forwards only ([`forward_schedule`]), over as many micro-batches as the test
//! set makes, holding no more of them per stage than training does ([`peak_held`]); its replay
//! ([`replay_forwards`]) checks that it cannot deadlock.

use std::fmt;

/// The order of forwards and backwards (`--schedule`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (M micro-batches' activations alive at once).
    #[value(name = "gpipe")]
    #[serde(rename = "gpipe")]
    Gpipe,
    /// Warm-up forwards, then one forward one backward, then cool-down (at most P alive).
    #[value(name = "1f1b")]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over `--virtual-stages` chunks per stage (Megatron-LM): the bubble divided by V.
    #[value(name = "interleaved")]
    #[serde(rename = "interleaved")]
    Interleaved,
}

impl ScheduleKind {
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Gpipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One pipeline's shape: P stages, M micro-batches per step, V chunks per stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub kind: ScheduleKind,
    pub stages: usize,
    pub micro_batches: usize,
    pub virtual_stages: usize,
}

impl Shape {
    /// Checks the shape against what its schedule needs; the message names the flag.
    pub fn new(kind: ScheduleKind, stages: usize, micro_batches: usize, virtual_stages: usize) -> Result<Shape, String> {
        if stages == 0 {
            return Err("--pipeline-stages 0: expected at least 1".into());
        }
        if micro_batches == 0 {
            return Err("--micro-batches 0: expected at least 1".into());
        }
        match kind {
            ScheduleKind::Interleaved => {
                if virtual_stages < 2 {
                    return Err(format!("--schedule interleaved needs --virtual-stages of at least 2 (got {virtual_stages}); with one chunk per stage it is --schedule 1f1b"));
                }
                if micro_batches % stages != 0 {
                    return Err(format!(
                        "--schedule interleaved takes micro-batches {stages} at a time (one per stage): --micro-batches {micro_batches} is not a multiple of --pipeline-stages {stages}"
                    ));
                }
            }
            _ if virtual_stages != 1 => {
                return Err(format!("--virtual-stages {virtual_stages} goes with --schedule interleaved, not {kind}"));
            }
            _ => {}
        }
        Ok(Shape { kind, stages, micro_batches, virtual_stages })
    }

    /// Chunks the model is cut into: P x V.
    pub fn chunks(&self) -> usize {
        self.stages * self.virtual_stages
    }

    pub fn stage_of(&self, chunk: usize) -> usize {
        chunk % self.stages
    }

    /// The chunks of `stage`, in model order.
    pub fn chunks_of(&self, stage: usize) -> Vec<usize> {
        (0..self.virtual_stages).map(|v| v * self.stages + stage).collect()
    }

    /// The bubble of the schedule with balanced stages and free messages: the idle share of a
    /// stage's step, (P-1)/(M+P-1) for GPipe and 1F1B, with P-1 divided by V when interleaved.
    pub fn theoretical_bubble(&self) -> f64 {
        let fill = (self.stages - 1) as f64 / self.virtual_stages as f64;
        fill / (self.micro_batches as f64 + fill)
    }

    /// The message tag of an activation (or its gradient) of `micro` crossing `boundary`:
    /// unique within a step, so that every receive matches its one send whatever the order.
    pub fn tag(&self, kind: Message, micro: usize, boundary: usize) -> i32 {
        ((micro * self.chunks() + boundary) * 2 + kind as usize) as i32
    }

    /// The largest tag a step uses, for the check against MPI_TAG_UB.
    pub fn max_tag(&self) -> i32 {
        self.tag(Message::Gradient, self.micro_batches - 1, self.chunks() - 1)
    }
}

/// What crosses a boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Message {
    Activation = 0,
    Gradient = 1,
}

/// One thing a stage does in a step. `chunk` is the global chunk index on this stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Post the receive of the input of chunk `chunk` for `micro` (from the previous chunk's stage).
    ReceiveActivation { micro: usize, chunk: usize },
    /// Post the receive of the gradient of chunk `chunk`'s output (from the next chunk's stage).
    ReceiveGradient { micro: usize, chunk: usize },
    /// Forward `micro` through `chunk` (waiting for its input first).
    Forward { micro: usize, chunk: usize },
    /// Backward `micro` through `chunk` (waiting for its output's gradient first).
    Backward { micro: usize, chunk: usize },
    /// Send the output of `chunk` for `micro` to the next chunk's stage (non-blocking).
    SendActivation { micro: usize, chunk: usize },
    /// Send the gradient of `chunk`'s input for `micro` to the previous chunk's stage.
    SendGradient { micro: usize, chunk: usize },
}

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
    }
}

/// The full list of `stage`'s actions in one step: the compute order, each forward's output
/// sent and each backward's input gradient sent right after it, and each receive posted one
/// compute action before the one that needs it (so that its transfer overlaps that compute;
/// the receives of the first two compute actions are posted at the start).
pub fn schedule(shape: &Shape, stage: usize) -> Vec<Action> {
    let last = shape.chunks() - 1;
    let needs = |a: &Action| match *a {
        Action::Forward { micro, chunk } if chunk > 0 => Some(Action::ReceiveActivation { micro, chunk }),
        Action::Backward { micro, chunk } if chunk < last => Some(Action::ReceiveGradient { micro, chunk }),
        _ => None,
    };
    let sends = |a: &Action| match *a {
        Action::Forward { micro, chunk } if chunk < last => Some(Action::SendActivation { micro, chunk }),
        Action::Backward { micro, chunk } if chunk > 0 => Some(Action::SendGradient { micro, chunk }),
        _ => None,
    };
    with_messages(&compute_order(shape, stage), needs, sends)
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
/// forwards not yet matched by their backward, at the worst point of its compute order (GPipe
/// M, 1F1B min(P - p, M), interleaved Megatron-LM's warm-up plus one).
pub fn peak_held(shape: &Shape, stage: usize) -> usize {
    let mut alive = 0usize;
    let mut peak = 0;
    for a in compute_order(shape, stage) {
        match a {
            Action::Forward { .. } => alive += 1,
            Action::Backward { .. } => alive -= 1,
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
    for group in (0..micro_batches).step_by(p_count) {
        let members = group..(group + p_count).min(micro_batches);
        // Without interleaving a stage's one chunk: micro-batch after micro-batch.
        for chunk in shape.chunks_of(stage) {
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

/// Which rank holds which stage: N = D x P ranks, pipeline d on ranks dP..dP+P-1 (consecutive
/// ranks share a node where the launcher fills nodes in order, so the activations every
/// micro-batch sends stay on the node), and the D ranks of stage p average its gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    pub stages: usize,
    pub replicas: usize,
}

impl Grid {
    pub fn new(ranks: usize, stages: usize) -> Result<Grid, String> {
        if stages == 0 || ranks % stages != 0 {
            return Err(format!(
                "--pipeline-stages {stages} does not divide the {ranks} ranks: the ranks form (ranks / stages) pipelines of {stages} stages each"
            ));
        }
        Ok(Grid { stages, replicas: ranks / stages })
    }

    pub fn stage_of(&self, rank: usize) -> usize {
        rank % self.stages
    }

    pub fn replica_of(&self, rank: usize) -> usize {
        rank / self.stages
    }

    #[cfg(test)]
    pub fn rank_of(&self, replica: usize, stage: usize) -> usize {
        replica * self.stages + stage
    }
}

/// The cut that balances `costs` (one per block, in model order) over `parts` consecutive
/// parts, none empty: the first block of every part, minimising the largest part's cost (the
/// linear partition problem, by dynamic programming; ties go to the earliest cuts). This is
/// torchgpipe's balance by time when `costs` are measured times, and balance by size when they
/// are parameter counts.
pub fn balance(costs: &[f64], parts: usize) -> Result<Vec<usize>, String> {
    let n = costs.len();
    if parts == 0 || parts > n {
        return Err(format!("{n} blocks cannot be cut into {parts} non-empty stages"));
    }
    let prefix: Vec<f64> = std::iter::once(0.0).chain(costs.iter().scan(0.0, |s, c| { *s += c; Some(*s) })).collect();
    let span = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[k][i]: the smallest largest cost of cutting blocks 0..i into k parts; from[k][i]
    // where the last of those parts starts.
    let mut best = vec![vec![f64::INFINITY; n + 1]; parts + 1];
    let mut from = vec![vec![0usize; n + 1]; parts + 1];
    best[0][0] = 0.0;
    for k in 1..=parts {
        for i in k..=n {
            for j in (k - 1)..i {
                let cost = best[k - 1][j].max(span(j, i));
                // Strictly smaller only: among equal cuts the earliest j is kept.
                if best[k][i].is_infinite() || cost < best[k][i] - 1e-12 * best[k][i].max(1.0) {
                    best[k][i] = cost;
                    from[k][i] = j;
                }
            }
        }
    }
    let mut starts = vec![0; parts];
    let mut end = n;
    for k in (1..=parts).rev() {
        starts[k - 1] = from[k][end];
        end = from[k][end];
    }
    Ok(starts)
}

/// `--partition 3,6,8`: the first block of every part but the first, checked against the
/// model's `blocks` and the `parts` needed. Returns the first block of every part.
pub fn cuts_from_list(list: &[usize], blocks: usize, parts: usize) -> Result<Vec<usize>, String> {
    let given = list.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(",");
    if list.len() + 1 != parts {
        return Err(format!(
            "--partition {given}: {parts} chunks need {} cut(s) (the first block of every chunk but the first), not {}",
            parts - 1,
            list.len()
        ));
    }
    let starts: Vec<usize> = std::iter::once(0).chain(list.iter().copied()).collect();
    for (i, w) in starts.windows(2).enumerate() {
        if w[1] <= w[0] {
            return Err(format!("--partition {given}: chunk {i} would be empty (cuts must increase strictly from 1)"));
        }
    }
    if let Some(&last) = list.last() {
        if last >= blocks {
            return Err(format!("--partition {given}: the last chunk would be empty (the model has {blocks} blocks, numbered 0..{})", blocks - 1));
        }
    }
    Ok(starts)
}

/// The blocks of each part, from the parts' first blocks.
pub fn ranges(starts: &[usize], blocks: usize) -> Vec<std::ops::Range<usize>> {
    starts.iter().enumerate().map(|(i, &s)| s..starts.get(i + 1).copied().unwrap_or(blocks)).collect()
}

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
}

/// Replays one step: every stage runs its [`schedule`] in order; a compute action starts once
/// the stage is free and its input has been sent; sends are non-blocking. Fails, naming the
/// stuck stages, when no stage can go on (a deadlock), or when a message is received that
/// nobody sends or sent that nobody receives.
pub fn replay(shape: &Shape, forward_cost: &[f64], backward_cost: &[f64]) -> Result<Replay, String> {
    use std::collections::HashMap;
    let p_count = shape.stages;
    let plans: Vec<Vec<Action>> = (0..p_count).map(|p| schedule(shape, p)).collect();
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
                Action::Forward { chunk, .. } | Action::Backward { chunk, .. } if shape.stage_of(chunk) != p => {
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
                    Action::Backward { micro, chunk } if chunk + 1 < shape.chunks() => Some((Message::Gradient, micro, chunk + 1)),
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
                match *a {
                    Action::ReceiveActivation { micro, chunk } => {
                        received.insert((Message::Activation, micro, chunk));
                    }
                    Action::ReceiveGradient { micro, chunk } => {
                        received.insert((Message::Gradient, micro, chunk + 1));
                    }
                    Action::Forward { chunk, .. } => {
                        clock[p] += forward_cost[chunk.min(forward_cost.len() - 1)];
                        busy[p] += forward_cost[chunk.min(forward_cost.len() - 1)];
                        alive[p] += 1;
                        peak_alive[p] = peak_alive[p].max(alive[p]);
                    }
                    Action::Backward { chunk, .. } => {
                        clock[p] += backward_cost[chunk.min(backward_cost.len() - 1)];
                        busy[p] += backward_cost[chunk.min(backward_cost.len() - 1)];
                        alive[p] -= 1;
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
        if next.iter().zip(&plans).all(|(n, plan)| *n == plan.len()) {
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

/// A replay of evaluation's [`forward_schedule`] on every stage (forward time per chunk),
/// as the executor runs it: a send completes once its receiver has posted the receive (the
/// worst case of MPI's rendezvous; a small message sent eagerly only completes sooner), and
/// before a forward whose output it sends, a stage with [`peak_held`] sends in flight waits
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

/// Replays evaluation over `micro_batches`; fails naming the stuck stages when no stage can go
/// on (a deadlock), or when sends and receives do not pair up.
#[cfg(test)]
pub fn replay_forwards(shape: &Shape, micro_batches: usize, forward_cost: &[f64]) -> Result<ForwardReplay, String> {
    use std::collections::{HashMap, VecDeque};
    let p_count = shape.stages;
    let plans: Vec<Vec<Action>> = (0..p_count).map(|p| forward_schedule(shape, p, micro_batches)).collect();
    let windows: Vec<usize> = (0..p_count).map(|p| peak_held(shape, p)).collect();
    let mut sent_keys: Vec<(usize, usize)> = Vec::new();
    let mut posted_keys: Vec<(usize, usize)> = Vec::new();
    for plan in &plans {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn shapes() -> Vec<Shape> {
        let mut all = Vec::new();
        for p in 1..=5 {
            for m in [1, 2, 3, 4, 7, 8, 16] {
                for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
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
                for chunk in shape.chunks_of(stage) {
                    let forwards: Vec<usize> = order.iter().filter_map(|a| match *a { Action::Forward { micro, chunk: c } if c == chunk => Some(micro), _ => None }).collect();
                    let backwards: Vec<usize> = order.iter().filter_map(|a| match *a { Action::Backward { micro, chunk: c } if c == chunk => Some(micro), _ => None }).collect();
                    let all: Vec<usize> = (0..shape.micro_batches).collect();
                    assert_eq!(forwards, all, "{shape:?} stage {stage} chunk {chunk}");
                    // In micro-batch order: the gradients accumulate as one process adds them.
                    assert_eq!(backwards, all, "{shape:?} stage {stage} chunk {chunk}");
                }
                // A micro-batch's backward comes after its forward through the same chunk.
                for (i, a) in order.iter().enumerate() {
                    if let Action::Backward { micro, chunk } = *a {
                        assert!(order[..i].contains(&Action::Forward { micro, chunk }), "{shape:?} stage {stage}: {a:?} before its forward");
                    }
                }
            }
        }
    }

    #[test]
    fn sends_match_receives_and_no_schedule_deadlocks() {
        for shape in shapes() {
            let unit = vec![1.0; shape.chunks()];
            let double = vec![2.0; shape.chunks()];
            replay(&shape, &unit, &double).unwrap_or_else(|e| panic!("{shape:?}: {e}"));
            // Uneven stages cannot deadlock a schedule either.
            let uneven: Vec<f64> = (0..shape.chunks()).map(|c| 1.0 + (c * 7 % 5) as f64).collect();
            replay(&shape, &uneven, &uneven).unwrap_or_else(|e| panic!("{shape:?}: {e}"));
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
        for shape in shapes() {
            let (f, b) = (1.0 / shape.virtual_stages as f64, 2.0 / shape.virtual_stages as f64);
            let replay = replay(&shape, &vec![f; shape.chunks()], &vec![b; shape.chunks()]).unwrap();
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
                let gpipe = replay(&Shape::new(ScheduleKind::Gpipe, p, m, 1).unwrap(), &[1.0], &[2.0]).unwrap();
                let one = replay(&Shape::new(ScheduleKind::OneFOneB, p, m, 1).unwrap(), &[1.0], &[2.0]).unwrap();
                for stage in 0..p {
                    assert_eq!(gpipe.peak_alive[stage], m);
                    assert_eq!(one.peak_alive[stage], (p - stage).min(m), "P {p} M {m} stage {stage}");
                }
            }
        }
        // Interleaved: Megatron-LM's warm-up bound, in chunk-sized activations.
        let shape = Shape::new(ScheduleKind::Interleaved, 4, 8, 2).unwrap();
        let r = replay(&shape, &[0.5], &[1.0]).unwrap();
        for stage in 0..4 {
            assert!(r.peak_alive[stage] <= (4 - stage - 1) * 2 + 4 + 1, "stage {stage}: {}", r.peak_alive[stage]);
        }
    }

    #[test]
    fn peak_held_is_what_the_replay_of_training_holds() {
        for shape in shapes() {
            let r = replay(&shape, &[1.0], &[2.0]).unwrap();
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
                    if micro_batches == shape.micro_batches {
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

    #[test]
    fn shapes_the_schedules_cannot_run_are_refused_naming_the_flag() {
        assert!(Shape::new(ScheduleKind::Interleaved, 2, 4, 1).unwrap_err().contains("--virtual-stages"));
        assert!(Shape::new(ScheduleKind::Interleaved, 4, 6, 2).unwrap_err().contains("not a multiple of --pipeline-stages 4"));
        assert!(Shape::new(ScheduleKind::OneFOneB, 2, 4, 2).unwrap_err().contains("goes with --schedule interleaved"));
        assert!(Shape::new(ScheduleKind::Gpipe, 2, 0, 1).unwrap_err().contains("--micro-batches 0"));
    }

    #[test]
    fn tags_are_unique_within_a_step() {
        let shape = Shape::new(ScheduleKind::Interleaved, 3, 6, 2).unwrap();
        let mut seen = std::collections::HashSet::new();
        for kind in [Message::Activation, Message::Gradient] {
            for m in 0..6 {
                for b in 1..shape.chunks() {
                    assert!(seen.insert(shape.tag(kind, m, b)));
                }
            }
        }
        assert_eq!(seen.iter().max().copied(), Some(shape.max_tag()));
    }

    #[test]
    fn the_grid_puts_a_pipeline_on_consecutive_ranks() {
        let g = Grid::new(8, 4).unwrap();
        assert_eq!(g.replicas, 2);
        assert_eq!((0..8).map(|r| (g.replica_of(r), g.stage_of(r))).collect::<Vec<_>>(), vec![(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]);
        assert_eq!(g.rank_of(1, 2), 6);
        assert!(Grid::new(6, 4).unwrap_err().contains("does not divide the 6 ranks"));
    }

    #[test]
    fn balance_minimises_the_largest_part() {
        assert_eq!(balance(&[1.0, 1.0, 1.0, 1.0], 2).unwrap(), vec![0, 2]);
        assert_eq!(balance(&[4.0, 1.0, 1.0, 1.0, 1.0], 2).unwrap(), vec![0, 1]);
        assert_eq!(balance(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], 3).unwrap(), vec![0, 5, 7]);
        // Every part gets a block even when one block dominates.
        assert_eq!(balance(&[1.0, 100.0, 1.0], 3).unwrap(), vec![0, 1, 2]);
        assert!(balance(&[1.0, 1.0], 3).unwrap_err().contains("2 blocks cannot be cut into 3"));
        // Brute force agrees on small cases.
        let costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0];
        for parts in 1..=costs.len() {
            let starts = balance(&costs, parts).unwrap();
            let worst = |s: &[usize]| ranges(s, costs.len()).iter().map(|r| costs[r.clone()].iter().sum::<f64>()).fold(0.0, f64::max);
            let best_possible = all_cuts(costs.len(), parts).iter().map(|s| worst(s)).fold(f64::INFINITY, f64::min);
            assert_eq!(worst(&starts), best_possible, "{parts} parts: {starts:?}");
        }
    }

    fn all_cuts(n: usize, parts: usize) -> Vec<Vec<usize>> {
        if parts == 1 {
            return vec![vec![0]];
        }
        let mut out = Vec::new();
        for rest in all_cuts(n, parts - 1) {
            let last = *rest.last().unwrap();
            for next in last + 1..n {
                let mut s = rest.clone();
                s.push(next);
                out.push(s);
            }
        }
        out
    }

    #[test]
    fn an_explicit_partition_is_checked() {
        assert_eq!(cuts_from_list(&[2, 3], 4, 3).unwrap(), vec![0, 2, 3]);
        assert!(cuts_from_list(&[2], 4, 3).unwrap_err().contains("3 chunks need 2 cut(s)"));
        assert!(cuts_from_list(&[2, 2], 4, 3).unwrap_err().contains("chunk 1 would be empty"));
        assert!(cuts_from_list(&[0, 2], 4, 3).unwrap_err().contains("chunk 0 would be empty"));
        assert!(cuts_from_list(&[2, 4], 4, 3).unwrap_err().contains("the last chunk would be empty"));
        assert_eq!(ranges(&[0, 2, 3], 4), vec![0..2, 2..3, 3..4]);
    }
}
