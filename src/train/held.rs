//! What a pipeline stage holds of its micro-batches from one action to a later one, in bytes: the
//! record's `peak_boundary_activation_bytes`. Each tensor the executor (pipeline.rs) keeps for a
//! later action is entered when it is kept, under what it is and whose it is, and leaves when it
//! is let go, by the method named for the action that does it; the peak is then what was held at
//! once on whichever path an action took.
//!
//! Counted: each chunk's input and output (the boundary activations), and what a split
//! backward's B keeps for its W (the first chunk's output and the gradient it came with, or the
//! gradients B captured for the weights' part of the graph). Not counted, in any schedule: the
//! activations the graph saved inside a chunk, which live from a forward until its backward (its
//! W under a split schedule: the record's peak of micro-batches held counts those), and the
//! buffers of messages in flight.

use std::collections::HashMap;

/// What a kept tensor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kept {
    /// A chunk's input: until the gradient of it is sent (the first chunk's, the images: until
    /// its backward, or its B).
    Input,
    /// A chunk's output (the scaled loss on the last): until its backward or B; under
    /// --recompute, until it is sent (the backward computes it again).
    Output,
    /// What a split backward's B keeps for its W, until W.
    ForWeights,
}

/// The bytes a stage holds now, by what and whose, and the most it held at once.
#[derive(Default, Debug)]
pub(super) struct HeldBytes {
    held: HashMap<(Kept, usize, usize), usize>,
    now: usize,
    peak: usize,
}

impl HeldBytes {
    /// The forward of micro-batch `micro` through `chunk` kept its input and its output.
    pub(super) fn forward(&mut self, micro: usize, chunk: usize, input: usize, output: usize) {
        self.keep(Kept::Input, micro, chunk, input);
        self.keep(Kept::Output, micro, chunk, output);
    }

    /// Under --recompute the output goes with its message: the backward computes it again.
    pub(super) fn output_sent(&mut self, micro: usize, chunk: usize) {
        self.let_go(Kept::Output, micro, chunk);
    }

    /// An unsplit backward lets the output go, where it was still held (the last chunk's loss
    /// under --recompute: it has no message to go with), and the first chunk's input; another
    /// chunk's input goes with the message of its gradient.
    pub(super) fn backward(&mut self, micro: usize, chunk: usize) {
        if self.held.contains_key(&(Kept::Output, micro, chunk)) {
            self.let_go(Kept::Output, micro, chunk);
        }
        if chunk == 0 {
            self.let_go(Kept::Input, micro, chunk);
        }
    }

    /// B lets the output go (and the first chunk's input, as a backward does) and keeps
    /// `for_weights` bytes until its W: the first chunk's output again with its gradient (its
    /// W is that chunk's whole backward), or the gradients it captured for W.
    pub(super) fn input_grad(&mut self, micro: usize, chunk: usize, for_weights: usize) {
        self.backward(micro, chunk);
        self.keep(Kept::ForWeights, micro, chunk, for_weights);
    }

    /// W lets go what its B kept.
    pub(super) fn weight_grad(&mut self, micro: usize, chunk: usize) {
        self.let_go(Kept::ForWeights, micro, chunk);
    }

    /// The gradient of the input was sent (or handed to this stage's own previous chunk): the
    /// input goes.
    pub(super) fn gradient_sent(&mut self, micro: usize, chunk: usize) {
        self.let_go(Kept::Input, micro, chunk);
    }

    /// Bytes held now.
    #[cfg(test)]
    fn now(&self) -> usize {
        self.now
    }

    /// The most bytes held at once so far.
    pub(super) fn peak(&self) -> usize {
        self.peak
    }

    fn keep(&mut self, what: Kept, micro: usize, chunk: usize, bytes: usize) {
        let before = self.held.insert((what, micro, chunk), bytes);
        assert!(before.is_none(), "{what:?} of micro-batch {micro} (chunk {chunk}) kept twice");
        self.now += bytes;
        self.peak = self.peak.max(self.now);
    }

    fn let_go(&mut self, what: Kept, micro: usize, chunk: usize) {
        let bytes = self.held.remove(&(what, micro, chunk)).unwrap_or_else(|| panic!("{what:?} of micro-batch {micro} (chunk {chunk}) let go but not held"));
        self.now -= bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::pipeline::{schedule, Action, ScheduleKind, Shape};

    /// Per chunk: the input's bytes, the output's, and what B keeps for W (the first chunk's
    /// output and gradient; another chunk's captured gradients).
    fn sizes(chunk: usize) -> (usize, usize, usize) {
        let (input, output) = (100 * (chunk + 1), 100 * (chunk + 2));
        (input, output, if chunk == 0 { 2 * output } else { 30 })
    }

    /// Replays `stage`'s schedule of `shape` as the executor enters its actions into the count;
    /// gives the peak and what is held after each action.
    fn replay(shape: &Shape, stage: usize, recompute: bool) -> (usize, Vec<(Action, usize)>) {
        let last = shape.chunks() - 1;
        let mut held = HeldBytes::default();
        let mut after = Vec::new();
        for action in schedule(shape, stage) {
            match action {
                Action::Forward { micro, chunk } => {
                    let (input, output, _) = sizes(chunk);
                    held.forward(micro, chunk, input, output);
                }
                Action::SendActivation { micro, chunk } if recompute => held.output_sent(micro, chunk),
                Action::Backward { micro, chunk } => held.backward(micro, chunk),
                Action::BackwardInput { micro, chunk } => held.input_grad(micro, chunk, sizes(chunk).2),
                Action::BackwardWeight { micro, chunk } => held.weight_grad(micro, chunk),
                Action::SendGradient { micro, chunk } => held.gradient_sent(micro, chunk),
                _ => {}
            }
            after.push((action, held.now()));
        }
        assert_eq!(held.now(), 0, "{shape:?} stage {stage}: everything held is let go by the step's end (last chunk {last})");
        (held.peak(), after)
    }

    /// Every schedule's every stage lets go all it kept by the step's end, each thing once
    /// (with and without --recompute where it runs).
    #[test]
    fn every_schedule_lets_go_what_it_kept() {
        for (kind, v) in [(ScheduleKind::Gpipe, 1), (ScheduleKind::OneFOneB, 1), (ScheduleKind::Interleaved, 2), (ScheduleKind::ZbH1, 1), (ScheduleKind::ZbV, 2)] {
            for (p, m) in [(2, 4), (3, 6), (4, 8)] {
                let shape = Shape::new(kind, p, m, v).unwrap();
                for stage in 0..p {
                    replay(&shape, stage, false);
                    if !kind.splits_backward() {
                        replay(&shape, stage, true);
                    }
                }
            }
        }
    }

    /// B keeps the first chunk's output and its gradient until W, and another chunk's captured
    /// gradients: between a B and its W they count, where B used to let everything go. At P = 2,
    /// M = 4, ZB-H1's first stage holds more at its worst than 1F1B's, which frees all at each
    /// backward.
    #[test]
    fn what_b_keeps_for_w_counts_until_w() {
        let shape = Shape::new(ScheduleKind::ZbH1, 2, 4, 1).unwrap();
        for stage in 0..2 {
            let (_, after) = replay(&shape, stage, false);
            let chunk = stage;
            let (input, _, for_weights) = sizes(chunk);
            for (i, (action, now)) in after.iter().enumerate() {
                let Action::BackwardInput { micro, .. } = *action else { continue };
                // Held after B: at least what it kept; on stage 1 (the input's gradient not
                // sent yet) the input as well.
                let at_least = for_weights + if chunk == 0 { 0 } else { input };
                assert!(*now >= at_least, "stage {stage} after B of {micro}: {now} < {at_least}");
                let w = after[i..].iter().position(|(a, _)| *a == Action::BackwardWeight { micro, chunk }).expect("W after B") + i;
                let before_w = after[w - 1].1;
                assert!(before_w >= for_weights, "stage {stage}: just before W of {micro}, {before_w} held");
                assert_eq!(after[w].1, before_w - for_weights, "stage {stage}: W of {micro} lets go what its B kept");
            }
        }
        let one_f_one_b = Shape::new(ScheduleKind::OneFOneB, 2, 4, 1).unwrap();
        let (zb, _) = replay(&shape, 0, false);
        let (plain, _) = replay(&one_f_one_b, 0, false);
        assert!(zb > plain, "ZB-H1's first stage peaks at {zb}, 1F1B's at {plain}");
    }

    #[test]
    #[should_panic(expected = "kept twice")]
    fn keeping_the_same_thing_twice_is_a_bug() {
        let mut held = HeldBytes::default();
        held.forward(0, 1, 4, 4);
        held.forward(0, 1, 4, 4);
    }
}
