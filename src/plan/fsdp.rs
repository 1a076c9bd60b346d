//! `--zero 3` (fully sharded data parallelism) as data: which of the model's blocks make a unit
//! (`--fsdp-unit`), and each unit's parameters laid out in one flat buffer, the buffer that is
//! sharded over the ranks, all-gathered before the unit computes and reduce-scattered after
//! its backward. Computed and tested without MPI or tensors.
//!
//! A unit is what PyTorch FSDP calls a wrapped module and DeepSpeed ZeRO-3 a parameter group:
//! the granularity of communication. Smaller units hold less gathered at a time and overlap
//! more finely; larger ones send fewer, bigger messages.

use std::ops::Range;

use crate::plan::buckets::{Bucket, Slot};

/// How the model is cut into units.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnitSize {
    /// Each block: ResNet's stem, every residual block, the head; the tiny CNN's every layer.
    Block,
    /// Blocks of one stage together: ResNet's stem, layer1 to layer4, the head.
    Stage,
    /// The whole model as one unit (gathered whole once per step: stage 3's memory only
    /// between steps).
    Model,
}

impl UnitSize {
    pub fn name(self) -> &'static str {
        match self {
            UnitSize::Block => "block",
            UnitSize::Stage => "stage",
            UnitSize::Model => "model",
        }
    }
}

/// The stage a block belongs to, from its name: "layer2.1" is in "layer2"; "stem" and "head"
/// are stages of their own.
fn stage_of(block: &str) -> &str {
    block.split('.').next().unwrap_or(block)
}

/// The blocks of each unit, consecutive and in model order, covering every block once.
pub fn group_blocks(block_names: &[String], size: UnitSize) -> Vec<Range<usize>> {
    let n = block_names.len();
    match size {
        UnitSize::Model => std::iter::once(0..n).collect(),
        UnitSize::Block => (0..n).map(|b| b..b + 1).collect(),
        UnitSize::Stage => {
            let mut groups: Vec<Range<usize>> = Vec::new();
            for (b, name) in block_names.iter().enumerate() {
                match groups.last_mut() {
                    Some(last) if stage_of(&block_names[last.start]) == stage_of(name) => last.end = b + 1,
                    _ => groups.push(b..b + 1),
                }
            }
            groups
        }
    }
}

/// One unit: its blocks, and its parameters' flat layout (the tensors in parameter order, each
/// at its offset). `layout.len` elements are gathered whole while the unit computes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    /// "stem", "layer1.0", or "layer1" (a stage), or "conv1..fc" for several blocks.
    pub name: String,
    pub blocks: Range<usize>,
    pub layout: Bucket,
}

/// The units of a model: `groups` of blocks, `block_of[t]` the block of parameter tensor t, and
/// `sizes[t]` its element count.
pub fn lay_out(block_names: &[String], groups: &[Range<usize>], block_of: &[usize], sizes: &[usize]) -> Vec<Unit> {
    assert_eq!(block_of.len(), sizes.len(), "one block per parameter");
    groups
        .iter()
        .map(|blocks| {
            let mine = block_of.iter().zip(sizes).enumerate().filter(|(_, (block, _))| blocks.contains(block)).map(|(tensor, (_, &len))| (tensor, len));
            let layout = flat_layout(mine);
            let name = if blocks.len() == 1 {
                block_names[blocks.start].clone()
            } else if stage_of(&block_names[blocks.start]) == stage_of(&block_names[blocks.end - 1]) {
                stage_of(&block_names[blocks.start]).to_string()
            } else {
                format!("{}..{}", block_names[blocks.start], block_names[blocks.end - 1])
            };
            Unit { name, blocks: blocks.clone(), layout }
        })
        .collect()
}

/// A pipeline stage's one unit under `--zero 3`: every parameter of the stage (`sizes`, in
/// parameter order), gathered whole once per step.
pub fn whole_stage(sizes: &[usize]) -> Bucket {
    flat_layout(sizes.iter().copied().enumerate())
}

/// `(tensor, len)` pairs laid out one after another in one flat buffer.
fn flat_layout(tensors: impl Iterator<Item = (usize, usize)>) -> Bucket {
    let mut slots = Vec::new();
    let mut offset = 0;
    for (tensor, len) in tensors {
        slots.push(Slot { tensor, offset, len });
        offset += len;
    }
    Bucket { slots, len: offset }
}

/// Elements this rank holds between steps: its shard of every unit (`shard_len(len)`).
pub fn held_elements(units: &[Unit], shard_len: impl Fn(usize) -> usize) -> usize {
    units.iter().map(|u| shard_len(u.layout.len)).sum()
}

/// The most elements gathered at once: a unit and, with prefetch, the next one beside it (in
/// forward order, and in backward order, which is the same pairs).
pub fn peak_gathered_elements(units: &[Unit], prefetch: bool) -> usize {
    let lens: Vec<usize> = units.iter().map(|u| u.layout.len).collect();
    if prefetch {
        lens.windows(2).map(|w| w[0] + w[1]).max().unwrap_or_else(|| lens.iter().copied().max().unwrap_or(0))
    } else {
        lens.iter().copied().max().unwrap_or(0)
    }
}

/// A stretch of a step's clock, in milliseconds from the step's start: a unit's compute on the
/// compute thread (its stream, on a GPU), or one collective on the MPI thread (the
/// communication stream).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    pub start_ms: f64,
    pub end_ms: f64,
}

impl Span {
    pub fn len_ms(self) -> f64 {
        (self.end_ms - self.start_ms).max(0.0)
    }

    /// How much of this span `cover` runs beside.
    pub fn overlap_ms(self, cover: Span) -> f64 {
        (self.end_ms.min(cover.end_ms) - self.start_ms.max(cover.start_ms)).max(0.0)
    }
}

/// One window of a `--zero 3` step: a unit's compute (None where this rank computed nothing) and
/// the collectives made beside it with prefetch, or after it without: the reduce-scatter of a
/// unit's gradients, then the gather of another unit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WindowSpans {
    pub compute: Option<Span>,
    pub reduce: Option<Span>,
    pub gather: Option<Span>,
}

/// A step's collectives in all and the part of them no compute ran beside, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Exposure {
    pub gather_ms: f64,
    pub exposed_gather_ms: f64,
    pub reduce_ms: f64,
    pub exposed_reduce_ms: f64,
}

/// What the windows' compute hid of their collectives: each collective is exposed where it ran
/// past (or outside) its own window's compute. Measured spans, so that a compute that started
/// late (its stream still busy) or a collective that queued behind another is counted as it ran,
/// not as if both had started together.
pub fn exposure(windows: &[WindowSpans]) -> Exposure {
    let mut e = Exposure::default();
    for w in windows {
        let exposed = |span: Span| span.len_ms() - w.compute.map_or(0.0, |c| span.overlap_ms(c));
        if let Some(r) = w.reduce {
            e.reduce_ms += r.len_ms();
            e.exposed_reduce_ms += exposed(r);
        }
        if let Some(g) = w.gather {
            e.gather_ms += g.len_ms();
            e.exposed_gather_ms += exposed(g);
        }
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::shard::ShardInfo;

    fn span(start_ms: f64, end_ms: f64) -> Span {
        Span { start_ms, end_ms }
    }

    /// Collectives that start with the compute: the part past its end is exposed, the gather's
    /// first (it runs last), as the host-clock reckoning before spans had it.
    #[test]
    fn collectives_beside_compute_are_exposed_past_its_end() {
        let w = |compute: f64, reduce: f64, gather: f64| WindowSpans {
            compute: Some(span(0.0, compute)),
            reduce: Some(span(0.0, reduce)),
            gather: Some(span(reduce, reduce + gather)),
        };
        // All hidden.
        assert_eq!(exposure(&[w(10.0, 3.0, 4.0)]), Exposure { gather_ms: 4.0, exposed_gather_ms: 0.0, reduce_ms: 3.0, exposed_reduce_ms: 0.0 });
        // 2 ms past the compute: the gather's.
        assert_eq!(exposure(&[w(5.0, 3.0, 4.0)]), Exposure { gather_ms: 4.0, exposed_gather_ms: 2.0, reduce_ms: 3.0, exposed_reduce_ms: 0.0 });
        // Past the compute by more than the gather: the rest is the reduce-scatter's.
        assert_eq!(exposure(&[w(1.0, 3.0, 4.0)]), Exposure { gather_ms: 4.0, exposed_gather_ms: 4.0, reduce_ms: 3.0, exposed_reduce_ms: 2.0 });
        // The old formula: past = max(0, R + G - C), the gather's share min(past, G).
        for (c, r, g) in [(0.5, 2.0, 1.0), (2.5, 2.0, 1.0), (7.0, 2.0, 1.0), (3.0, 0.0, 4.0)] {
            let e = exposure(&[w(c, r, g)]);
            let past = (r + g - c).max(0.0);
            assert!((e.exposed_gather_ms - past.min(g)).abs() < 1e-12 && (e.exposed_reduce_ms - (past - past.min(g))).abs() < 1e-12, "{c} {r} {g}: {e:?}");
        }
    }

    /// Without prefetch the collectives follow the compute, and a compute that starts late
    /// hides only what runs beside it; windows add up; a rank with nothing to compute hides nothing.
    #[test]
    fn only_what_runs_beside_compute_is_hidden() {
        let after = WindowSpans { compute: Some(span(0.0, 5.0)), reduce: Some(span(5.0, 6.0)), gather: Some(span(6.0, 8.0)) };
        let late = WindowSpans { compute: Some(span(9.0, 12.0)), reduce: None, gather: Some(span(8.0, 10.0)) };
        let idle = WindowSpans { compute: None, reduce: Some(span(12.0, 13.5)), gather: Some(span(13.5, 14.0)) };
        let e = exposure(&[after, late, idle]);
        assert_eq!(e, Exposure { gather_ms: 2.0 + 2.0 + 0.5, exposed_gather_ms: 2.0 + 1.0 + 0.5, reduce_ms: 1.0 + 1.5, exposed_reduce_ms: 1.0 + 1.5 });
        assert_eq!(exposure(&[]), Exposure::default());
    }

    fn resnet18_blocks() -> Vec<String> {
        let mut names = vec!["stem".to_string()];
        for layer in 1..=4 {
            for i in 0..2 {
                names.push(format!("layer{layer}.{i}"));
            }
        }
        names.push("head".into());
        names
    }

    #[test]
    fn units_group_blocks_by_size() {
        let names = resnet18_blocks();
        assert_eq!(group_blocks(&names, UnitSize::Block).len(), 10);
        assert_eq!(group_blocks(&names, UnitSize::Model), std::iter::once(0..10).collect::<Vec<_>>());
        assert_eq!(group_blocks(&names, UnitSize::Stage), vec![0..1, 1..3, 3..5, 5..7, 7..9, 9..10]);
        let tiny: Vec<String> = ["conv1", "conv2", "pool", "fc"].iter().map(|s| s.to_string()).collect();
        assert_eq!(group_blocks(&tiny, UnitSize::Stage), vec![0..1, 1..2, 2..3, 3..4]);
    }

    #[test]
    fn every_parameter_is_in_one_unit_at_its_own_offset() {
        let names = resnet18_blocks();
        // Two tensors per block, except a block without parameters (like the tiny CNN's pool).
        let block_of: Vec<usize> = (0..10).filter(|&b| b != 4).flat_map(|b| [b, b]).collect();
        let sizes: Vec<usize> = (0..block_of.len()).map(|t| 3 + t * 7).collect();
        for size in [UnitSize::Block, UnitSize::Stage, UnitSize::Model] {
            let units = lay_out(&names, &group_blocks(&names, size), &block_of, &sizes);
            let mut seen = vec![0; sizes.len()];
            for unit in &units {
                let mut next = 0;
                for slot in &unit.layout.slots {
                    assert_eq!(slot.offset, next, "{size:?}: slots follow each other");
                    assert_eq!(slot.len, sizes[slot.tensor]);
                    assert!(unit.blocks.contains(&block_of[slot.tensor]));
                    next += slot.len;
                    seen[slot.tensor] += 1;
                }
                assert_eq!(next, unit.layout.len);
            }
            assert!(seen.iter().all(|&s| s == 1), "{size:?}: {seen:?}");
            assert_eq!(units.iter().map(|u| u.layout.len).sum::<usize>(), sizes.iter().sum::<usize>());
        }
        // A pipeline stage's one unit: the model's one unit, laid out alike.
        let model = lay_out(&names, &group_blocks(&names, UnitSize::Model), &block_of, &sizes);
        assert_eq!(whole_stage(&sizes), model[0].layout);
        let stages = lay_out(&names, &group_blocks(&names, UnitSize::Stage), &block_of, &sizes);
        let unit_names: Vec<&str> = stages.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(unit_names, ["stem", "layer1", "layer2", "layer3", "layer4", "head"]);
        // The block without parameters makes an empty unit, which is never gathered.
        let blocks = lay_out(&names, &group_blocks(&names, UnitSize::Block), &block_of, &sizes);
        assert_eq!(blocks[4].layout.len, 0);
    }

    #[test]
    fn a_rank_holds_its_share_within_one_element_per_unit() {
        let names = resnet18_blocks();
        let block_of: Vec<usize> = (0..10).flat_map(|b| [b, b, b]).collect();
        let sizes: Vec<usize> = (0..30).map(|t| 1 + t * t * 11).collect();
        let total: usize = sizes.iter().sum();
        for size in [UnitSize::Block, UnitSize::Stage, UnitSize::Model] {
            let units = lay_out(&names, &group_blocks(&names, size), &block_of, &sizes);
            for n in [1, 2, 3, 4, 5, 16] {
                let mut all = 0;
                for r in 0..n {
                    let held = held_elements(&units, |len| ShardInfo::split(len, n, r).len);
                    assert!(held.abs_diff(total / n) <= units.len(), "{size:?} n {n} rank {r}: {held} of {total}");
                    all += held;
                }
                assert_eq!(all, total, "{size:?} n {n}: the shards tile the model");
            }
        }
    }

    #[test]
    fn prefetch_holds_two_neighbouring_units_at_most() {
        let names = resnet18_blocks();
        let block_of: Vec<usize> = (0..10).collect();
        let sizes = vec![5, 1, 1, 9, 1, 1, 1, 1, 20, 2];
        let units = lay_out(&names, &group_blocks(&names, UnitSize::Block), &block_of, &sizes);
        assert_eq!(peak_gathered_elements(&units, false), 20);
        assert_eq!(peak_gathered_elements(&units, true), 22);
        let whole = lay_out(&names, &group_blocks(&names, UnitSize::Model), &block_of, &sizes);
        assert_eq!(peak_gathered_elements(&whole, true), 42);
    }
}
