//! The pipeline's vocabulary: a schedule's kind and shape (stages, micro-batches, chunks and
//! the message tags of a step), what crosses a boundary, the actions a stage takes, and which
//! rank holds which stage ([`Grid`]).

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
    /// Zero bubble H1: 1F1B with each backward split into B and W, the W's deferred into the
    /// cool-down's bubble (Qi et al. 2024); 1F1B's memory.
    #[value(name = "zb-h1")]
    #[serde(rename = "zb-h1")]
    ZbH1,
    /// Zero bubble V: two chunks per stage in a V, backwards split into B and W (Qi et al.
    /// 2024); 1F1B's memory, twice its messages.
    #[value(name = "zb-v")]
    #[serde(rename = "zb-v")]
    ZbV,
}

impl ScheduleKind {
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Gpipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
            ScheduleKind::ZbV => "zb-v",
        }
    }

    /// Whether the schedule splits each backward into B (the input's gradient) and W (the
    /// weights').
    pub fn splits_backward(self) -> bool {
        matches!(self, ScheduleKind::ZbH1 | ScheduleKind::ZbV)
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
                if !micro_batches.is_multiple_of(stages) {
                    return Err(format!(
                        "--schedule interleaved takes micro-batches {stages} at a time (one per stage): --micro-batches {micro_batches} is not a multiple of --pipeline-stages {stages}"
                    ));
                }
            }
            // Two chunks per stage by construction; --virtual-stages 2 says the same.
            ScheduleKind::ZbV if virtual_stages <= 2 => return Ok(Shape { kind, stages, micro_batches, virtual_stages: 2 }),
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

    /// The refusal of a model of `blocks` blocks (`model` names it) cut into more chunks than
    /// that, saying how the options the run was given make the chunks: ZB-V's two per stage are
    /// its schedule's, not a --virtual-stages the run may never have been given.
    pub fn too_many_chunks(&self, model: &str, blocks: usize) -> String {
        let (p, chunks) = (self.stages, self.chunks());
        let (made, fewer) = match self.kind {
            ScheduleKind::Interleaved => (format!("--pipeline-stages x --virtual-stages = {p} x {} = {chunks} chunks", self.virtual_stages), "use fewer stages or virtual stages"),
            ScheduleKind::ZbV => (format!("--schedule zb-v puts two chunks on each of --pipeline-stages {p}: {chunks} chunks"), "use fewer stages, or --schedule zb-h1 (one chunk per stage)"),
            kind => (format!("--pipeline-stages {p} with --schedule {kind} = {chunks} chunks"), "use fewer stages"),
        };
        format!("{made}, but --model {model} has {blocks} blocks to cut (each chunk needs one): {fewer}")
    }

    /// The stage that holds `chunk`: round robin (interleaved), or in a V for ZB-V (chunk c on
    /// stage c going down, then 2P-1-c coming back up).
    pub fn stage_of(&self, chunk: usize) -> usize {
        match self.kind {
            ScheduleKind::ZbV if chunk >= self.stages => 2 * self.stages - 1 - chunk,
            _ => chunk % self.stages,
        }
    }

    /// The chunks of `stage`, in model order.
    pub fn chunks_of(&self, stage: usize) -> Vec<usize> {
        match self.kind {
            ScheduleKind::ZbV => vec![stage, 2 * self.stages - 1 - stage],
            _ => (0..self.virtual_stages).map(|v| v * self.stages + stage).collect(),
        }
    }

    /// The stage that computes the loss (holds the last chunk): it alone reads the labels.
    pub fn loss_stage(&self) -> usize {
        self.stage_of(self.chunks() - 1)
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
    /// Zero bubble's B: the gradient of `chunk`'s input for `micro` alone (waiting for its
    /// output's gradient first), its graph kept for the W.
    BackwardInput { micro: usize, chunk: usize },
    /// Zero bubble's W: the weights' gradients of `chunk` for `micro`, from the graph its B
    /// kept, which it then lets go. No message waits for it.
    BackwardWeight { micro: usize, chunk: usize },
    /// Send the output of `chunk` for `micro` to the next chunk's stage (non-blocking).
    SendActivation { micro: usize, chunk: usize },
    /// Send the gradient of `chunk`'s input for `micro` to the previous chunk's stage.
    SendGradient { micro: usize, chunk: usize },
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
        if stages == 0 || !ranks.is_multiple_of(stages) {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A model with too few blocks for the chunks is refused in the words of the options that
    /// made the chunks: ZB-V's refusal names its two chunks per stage, not --virtual-stages,
    /// which its user never gave.
    #[test]
    fn too_many_chunks_names_the_options_that_made_them() {
        let zb_v = Shape::new(ScheduleKind::ZbV, 3, 4, 1).unwrap().too_many_chunks("tiny", 4);
        assert_eq!(zb_v, "--schedule zb-v puts two chunks on each of --pipeline-stages 3: 6 chunks, but --model tiny has 4 blocks to cut (each chunk needs one): use fewer stages, or --schedule zb-h1 (one chunk per stage)");
        assert!(!zb_v.contains("--virtual-stages"), "{zb_v}");
        let interleaved = Shape::new(ScheduleKind::Interleaved, 2, 2, 3).unwrap().too_many_chunks("tiny", 4);
        assert!(interleaved.starts_with("--pipeline-stages x --virtual-stages = 2 x 3 = 6 chunks, but --model tiny has 4 blocks"), "{interleaved}");
        for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB, ScheduleKind::ZbH1] {
            let one_each = Shape::new(kind, 5, 5, 1).unwrap().too_many_chunks("tiny", 4);
            assert_eq!(one_each, format!("--pipeline-stages 5 with --schedule {kind} = 5 chunks, but --model tiny has 4 blocks to cut (each chunk needs one): use fewer stages"));
        }
    }

    #[test]
    fn shapes_the_schedules_cannot_run_are_refused_naming_the_flag() {
        assert!(Shape::new(ScheduleKind::Interleaved, 2, 4, 1).unwrap_err().contains("--virtual-stages"));
        assert!(Shape::new(ScheduleKind::Interleaved, 4, 6, 2).unwrap_err().contains("not a multiple of --pipeline-stages 4"));
        assert!(Shape::new(ScheduleKind::OneFOneB, 2, 4, 2).unwrap_err().contains("goes with --schedule interleaved"));
        assert!(Shape::new(ScheduleKind::Gpipe, 2, 0, 1).unwrap_err().contains("--micro-batches 0"));
        assert!(Shape::new(ScheduleKind::ZbH1, 2, 4, 2).unwrap_err().contains("goes with --schedule interleaved, not zb-h1"));
        assert!(Shape::new(ScheduleKind::ZbV, 2, 4, 3).unwrap_err().contains("goes with --schedule interleaved, not zb-v"));
        assert_eq!(Shape::new(ScheduleKind::ZbV, 2, 4, 1).unwrap().virtual_stages, 2);
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
}
