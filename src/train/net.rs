//! The network: the model, its parameters and buffers by name ([`Net`]), and the normalisation
//! of raw image bytes into the input it trains on ([`Normalizer`]).

use tch::nn::{self};
use tch::{Device, Kind, Tensor};

use crate::checkpoint::{self, index::Section, reader::CheckpointReader, region::Region};
use crate::data::DatasetInfo;
use crate::error::Result;
use crate::model::{self, InputSpec, Variable};
use crate::plan::tensor::{held, vit_split, Split};
use crate::raw;

use super::options::TrainArgs;
use super::stages::StageCut;
use super::weights_file::WeightsFile;

/// How the model is held: whole, as one pipeline stage's chunks, or as `--zero 3`'s units.
pub(super) enum NetLayout<'a> {
    Whole,
    Stage(&'a StageCut),
    /// The blocks of each unit, consecutive and in model order. The parameters stay empty:
    /// the exchange keeps this rank's shards of them ([`Net::initial_value`]).
    Units(&'a [std::ops::Range<usize>]),
}

/// A tensor-parallel rank's part of the model: it builds the group's layers and holds its part
/// of each cut variable.
#[derive(Clone, Copy)]
pub(super) struct TensorPart {
    pub(super) split: crate::model::vit::TensorSplit,
    pub(super) rank: usize,
    pub(super) size: usize,
}

/// Where the initial values come from: drawn from the seed, read from `--init-weights` or from
/// the checkpoint a run resumes from.
pub(super) enum InitialValues {
    Seeded(u64),
    File(WeightsFile),
    /// A sharded checkpoint (one file per rank and an index): each variable assembled from the
    /// pieces that hold it. Shared with the optimizer state's reader (checkpoints.rs).
    Sharded(std::rc::Rc<CheckpointReader>),
}

impl InitialValues {
    /// The checkpoint's weights when the run resumes (the checkpoint every rank found and
    /// verified together: find_resume_point), else `--init-weights`, else the seed.
    pub(super) fn of(args: &TrainArgs, resumed_from: Option<&checkpoint::Checkpoint>) -> Result<InitialValues> {
        Ok(match (resumed_from, &args.init_weights) {
            (Some(found), _) => {
                // A whole checkpoint: every rank reads its own variables from its weights file.
                if found.meta.is_sharded() {
                    InitialValues::Sharded(std::rc::Rc::new(CheckpointReader::open(found)?))
                } else {
                    InitialValues::File(WeightsFile::open("the checkpoint's weights", &found.dir.join(checkpoint::meta::WEIGHTS_FILE))?)
                }
            }
            (None, Some(path)) => InitialValues::File(WeightsFile::open("--init-weights", path)?),
            (None, None) => InitialValues::Seeded(args.seed),
        })
    }

    /// `variable`'s whole initial value, on the CPU.
    pub(super) fn value(&self, variable: &Variable) -> Result<Tensor> {
        match self {
            InitialValues::Seeded(seed) => Ok(variable.draw(*seed)?),
            InitialValues::File(file) => file.read(&variable.name, &variable.shape),
            InitialValues::Sharded(reader) => {
                check_shape(reader, variable)?;
                Ok(reader.read_whole(Section::Weights, &variable.name)?.f_to_kind(Kind::Float)?)
            }
        }
    }

    /// Elements `at .. at + len` of `variable`'s whole initial value, flattened row-major, on the
    /// CPU (a `--zero 3` shard's piece of it). A sharded checkpoint is read for that range
    /// only: read whole, every rank touched every part file's weights (mapped, 1.2 GB for
    /// ViT-L/16), and a rank under a 2 GiB memory limit was killed resuming as --zero 3 from a
    /// 2 x 2 layout's checkpoint (results/beyond-one-rank/cgroup). A seed draws the whole tensor
    /// (its values depend on the whole), one tensor at a time.
    ///
    /// With `part` (a tensor-parallel rank's place in its group and the group's size), elements
    /// of this rank's part of the variable, flattened: a checkpoint is read for the regions of
    /// the whole tensor that the range is ([`part_range_regions`]).
    pub(super) fn range(&self, variable: &Variable, part: Option<(usize, usize)>, at: i64, len: i64) -> Result<Tensor> {
        let split = part.map_or(Split::Whole, |_| vit_split(&variable.name));
        let (rank, size) = part.unwrap_or((0, 1));
        match self {
            InitialValues::Sharded(reader) => {
                check_shape(reader, variable)?;
                let mut pieces = part_range_regions(&variable.shape, split, rank, size, at, len)
                    .into_iter()
                    .map(|(region, _)| Ok(reader.read(Section::Weights, &variable.name, &region)?.f_reshape([-1])?))
                    .collect::<Result<Vec<Tensor>>>()?;
                let range = if pieces.len() == 1 { pieces.pop().expect("one") } else { Tensor::f_cat(&pieces, 0)? };
                Ok(range.f_to_kind(Kind::Float)?)
            }
            _ => Ok(cut_tensor(&self.value(variable)?, split, rank, size)?.f_contiguous()?.f_reshape([-1])?.f_narrow(0, at, len)?.f_contiguous()?),
        }
    }
}

/// The checkpoint's weight `variable.name` has the model's shape (checked from the index, before
/// anything is read); a tensor the checkpoint lacks is left to the read, which names it.
fn check_shape(reader: &CheckpointReader, variable: &Variable) -> Result<()> {
    match reader.shape(Section::Weights, &variable.name) {
        Some(shape) if shape != variable.shape.as_slice() => {
            Err(crate::error::Error::usage(format!("the checkpoint's {} has shape {shape:?}, the model's is {:?}", variable.name, variable.shape)))
        }
        _ => Ok(()),
    }
}

/// The network and its parameters: the whole model, or a pipeline stage's chunks of it.
pub(super) struct Net {
    pub(super) vs: nn::VarStore,
    /// The model's pieces this rank runs, by global chunk index: one chunk, the whole model,
    /// outside pipelines; a stage's chunks (V of them, model order) in a pipeline; every unit
    /// under `--zero 3`.
    pub(super) chunks: Vec<(usize, nn::FuncT<'static>)>,
    pub(super) params: Vec<Tensor>,
    /// The name of every parameter, in `params` order.
    pub(super) param_names: Vec<String>,
    /// Non-trainable state (batch-norm running statistics), by name.
    pub(super) buffers: Vec<(String, Tensor)>,
    /// Every parameter as declared (its whole shape and initialisation), in `params` order.
    pub(super) declared: Vec<Variable>,
    /// A tensor-parallel rank's place in its group and the group's size: it holds its part of
    /// each cut parameter.
    part: Option<(usize, usize)>,
}

impl Net {
    /// The model this rank holds: whole, a pipeline stage's chunks, or `--zero 3`'s units (with
    /// `part`, a tensor-parallel rank's part of each). Each variable this rank holds is given
    /// its initial value one at a time, whole from `values` and then cut to this rank's part,
    /// so that no rank ever holds more than its part and one whole variable; the blocks of
    /// other stages are declared (they hold no memory) and dropped. Every layout draws every
    /// variable from its name, so every layout starts from the same weights.
    pub(super) fn new(args: &TrainArgs, info: &DatasetInfo, device: Device, layout: NetLayout, part: Option<TensorPart>, values: &InitialValues) -> Result<(Net, InputSpec)> {
        let spec = input_spec(info);
        let vs = nn::VarStore::new(device);
        let scratch = nn::VarStore::new(Device::Cpu);
        let holds = |b: usize| match &layout {
            NetLayout::Stage(cut) => cut.holds(b),
            NetLayout::Whole | NetLayout::Units(_) => true,
        };
        let path_of = |b: usize| if holds(b) { vs.root() } else { scratch.root() };
        let blocks = match part {
            Some(p) => model::build_blocks_tensor_parallel(args.model, spec, path_of, p.split)
                .ok_or_else(|| crate::error::Error::usage(format!("--tensor-parallel cuts attention heads, and --model {} has none", args.model.name())))?,
            None => model::build_blocks(args.model, spec, path_of),
        };
        let held: Vec<Variable> = blocks.iter().enumerate().filter(|(b, _)| holds(*b)).flat_map(|(_, block)| block.variables.iter().map(Variable::shallow_clone)).collect();
        // Under --zero 3 the parameters stay empty until the exchange cuts its shards from
        // their values; the buffers (batch norm's statistics) are held whole by every rank.
        for variable in &held {
            if matches!(layout, NetLayout::Units(_)) && variable.trainable {
                // Empty, on the device the shards will be gathered to.
                variable.set(&Tensor::f_empty([0], (Kind::Float, device))?)?;
                continue;
            }
            let whole = values.value(variable)?;
            let mine = match part {
                Some(p) => cut_tensor(&whole, vit_split(&variable.name), p.rank, p.size)?,
                None => whole,
            };
            variable.set(&mine.f_to_device(device)?)?;
        }
        let chunks = match layout {
            NetLayout::Whole => {
                let model = model::sequence(blocks.into_iter().map(|b| b.module).collect());
                if part.is_none() {
                    model::check_forward(&model, spec, device)?;
                }
                vec![(0, model)]
            }
            NetLayout::Units(groups) => sequences(blocks, groups.iter().cloned().enumerate()),
            NetLayout::Stage(cut) => stage_chunks(blocks, cut),
        };
        // The parameters in declaration order (the store's order, and the order backward
        // produces their gradients in, reversed); named from the declarations, since under
        // --zero 3 they are all empty and their data cannot tell them apart.
        let (declared, buffers): (Vec<Variable>, Vec<Variable>) = held.into_iter().partition(|v| v.trainable);
        let mut buffers: Vec<(String, Tensor)> = buffers.into_iter().map(|v| (v.name, v.tensor)).collect();
        buffers.sort_by(|a, b| a.0.cmp(&b.0));
        let net = Net {
            vs,
            chunks,
            params: declared.iter().map(|v| v.tensor.shallow_clone()).collect(),
            param_names: declared.iter().map(|v| v.name.clone()).collect(),
            buffers,
            declared,
            part: part.map(|p| (p.rank, p.size)),
        };
        Ok((net, spec))
    }

    /// Elements `at .. at + len` of parameter `index`'s initial value, flattened, on the CPU
    /// (for `--zero 3`'s shards).
    /// Under tensor parallelism, of this rank's part of it.
    pub(super) fn initial_range(&self, index: usize, at: i64, len: i64, values: &InitialValues) -> Result<Tensor> {
        values.range(&self.declared[index], self.part, at, len)
    }

    /// Parameter `index`'s shape as this rank holds it: its part's under tensor parallelism
    /// (the whole shape with the cut dimension's extent over the group's size).
    pub(super) fn held_shape(&self, index: usize) -> Vec<i64> {
        let variable = &self.declared[index];
        let mut shape = variable.shape.clone();
        if let Some((_, size)) = self.part {
            match vit_split(&variable.name) {
                Split::Whole => {}
                Split::Rows { .. } => shape[0] /= size as i64,
                Split::Columns => shape[1] /= size as i64,
            }
        }
        shape
    }

    /// The elements of the parameters this rank holds while it computes (its parts under
    /// tensor parallelism), whether or not they are gathered now (`--zero 3`).
    pub(super) fn held_elements(&self) -> usize {
        (0..self.declared.len()).map(|i| self.held_shape(i).iter().product::<i64>() as usize).sum()
    }

    /// The whole model (outside pipelines, where the one chunk is all of it).
    pub(super) fn model(&self) -> &nn::FuncT<'static> {
        assert!(self.chunks.len() == 1 && self.chunks[0].0 == 0, "the whole model is asked of a pipeline stage");
        &self.chunks[0].1
    }

    /// Every variable, sorted by name (the same order on every rank).
    pub(super) fn named_variables(&self) -> Vec<(String, Tensor)> {
        let mut all: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    pub(super) fn grads(&self) -> Vec<Tensor> {
        self.params.iter().map(|p| p.grad()).collect()
    }
}

/// Rank `rank` of `size`'s part of the whole tensor `w` (tensor parallelism: plan/tensor.rs
/// says which rows or columns).
pub(super) fn cut_tensor(w: &Tensor, split: Split, rank: usize, size: usize) -> Result<Tensor> {
    let dim = match split {
        Split::Whole => return Ok(w.shallow_clone()),
        Split::Rows { .. } => 0,
        Split::Columns => 1,
    };
    let ranges = held(split, w.size()[dim] as usize, rank, size);
    let pieces: Vec<Tensor> = ranges.iter().map(|r| w.f_narrow(dim as i64, r.start as i64, r.len() as i64)).collect::<std::result::Result<_, _>>()?;
    Ok(Tensor::f_cat(&pieces, dim as i64)?)
}

/// The rectangles of a whole tensor of `shape` that rank `rank` of a tensor-parallel group of
/// `size` holds of a variable cut by `split`, in the order its part holds them.
pub(super) fn cut_regions(shape: &[i64], split: Split, rank: usize, size: usize) -> Vec<Region> {
    let dim = match split {
        Split::Whole => return vec![Region::Whole],
        Split::Rows { .. } => 0,
        Split::Columns => 1,
    };
    held(split, shape[dim] as usize, rank, size)
        .into_iter()
        .map(|r| {
            let mut offsets = vec![0; shape.len()];
            let mut lengths = shape.to_vec();
            offsets[dim] = r.start as i64;
            lengths[dim] = r.len() as i64;
            Region::Rect { offsets, lengths }
        })
        .collect()
}

/// Where elements `at .. at + len` of rank `rank`'s part (of a group of `size`, cut by `split`)
/// of a whole tensor of `shape` lie in that tensor: regions of it, each with the offset of its
/// first element within the range (its length is the region's element count). A ZeRO or FSDP
/// shard is a flat range of the part, which is no flat range of the whole tensor: a row cut's
/// part is its blocks of whole rows one after another, so a range is a flat range of the whole
/// per block it touches; a column cut's part is a few columns of every row, so a range is a
/// partial first row, the whole rows between and a partial last row, each a rectangle.
pub(super) fn part_range_regions(shape: &[i64], split: Split, rank: usize, size: usize, at: i64, len: i64) -> Vec<(Region, i64)> {
    let end = at + len;
    match split {
        Split::Whole => vec![(Region::Flat { at, len }, 0)],
        Split::Rows { .. } => {
            // Elements per row: the row cut keeps every other dimension whole.
            let inner: i64 = shape[1..].iter().product();
            let mut local_row = 0;
            let mut regions = Vec::new();
            for rows in held(split, shape[0] as usize, rank, size) {
                let (first, count) = (rows.start as i64, rows.len() as i64);
                let (from, to) = ((local_row * inner).max(at), ((local_row + count) * inner).min(end));
                if from < to {
                    regions.push((Region::Flat { at: first * inner + (from - local_row * inner), len: to - from }, from - at));
                }
                local_row += count;
            }
            regions
        }
        Split::Columns => {
            assert_eq!(shape.len(), 2, "a column cut is of a matrix");
            let columns = held(split, shape[1] as usize, rank, size);
            let (first_column, width) = (columns[0].start as i64, columns[0].len() as i64);
            let rect = |row: i64, column: i64, rows: i64, columns: i64| Region::Rect { offsets: vec![row, first_column + column], lengths: vec![rows, columns] };
            let mut regions = Vec::new();
            let mut from = at;
            if from % width != 0 && from < end {
                let to = end.min((from / width + 1) * width);
                regions.push((rect(from / width, from % width, 1, to - from), from - at));
                from = to;
            }
            let rows = (end - from) / width;
            if rows > 0 {
                regions.push((rect(from / width, 0, rows, width), from - at));
                from += rows * width;
            }
            if from < end {
                regions.push((rect(from / width, 0, 1, end - from), from - at));
            }
            regions
        }
    }
}

/// A pipeline stage's chunks, each its blocks in sequence, from the whole model's `blocks`.
pub(super) fn stage_chunks(blocks: Vec<model::Block>, cut: &StageCut) -> Vec<(usize, nn::FuncT<'static>)> {
    sequences(blocks, cut.chunks.iter().cloned())
}

/// Modules of consecutive blocks, by index: each range of `blocks` (taken once) run in sequence.
fn sequences(blocks: Vec<model::Block>, ranges: impl IntoIterator<Item = (usize, std::ops::Range<usize>)>) -> Vec<(usize, nn::FuncT<'static>)> {
    let mut blocks: Vec<Option<model::Block>> = blocks.into_iter().map(Some).collect();
    ranges
        .into_iter()
        .map(|(index, range)| (index, model::sequence(range.map(|b| blocks[b].take().expect("a block is in one module").module).collect())))
        .collect()
}

/// The names of `kind`'s blocks, and the block that declares each variable (by name).
/// Declared only: nothing is allocated.
pub(super) fn variable_blocks(kind: model::ModelKind, spec: InputSpec) -> (Vec<String>, std::collections::HashMap<String, usize>) {
    let scratch = nn::VarStore::new(Device::Cpu);
    let blocks = model::build_blocks(kind, spec, |_| scratch.root());
    let names = blocks.iter().map(|b| b.name.clone()).collect();
    let of = blocks.iter().enumerate().flat_map(|(b, block)| block.variables.iter().map(move |v| (v.name.clone(), b))).collect();
    (names, of)
}

/// The input the model must fit, from the dataset.
pub(super) fn input_spec(info: &DatasetInfo) -> InputSpec {
    InputSpec { channels: info.meta.channels as i64, height: info.meta.height as i64, width: info.meta.width as i64, classes: info.meta.classes as i64 }
}

/// Scales raw bytes to the normalised input the model trains on, on the device.
pub(super) struct Normalizer {
    pub(super) shape: [i64; 3],
    pub(super) channels_last: bool,
    /// Per-channel mean and 1/std, in units of raw byte values, shaped [1, C, 1, 1].
    pub(super) mean: Tensor,
    pub(super) inv_std: Tensor,
    pub(super) device: Device,
}

impl Normalizer {
    pub(super) fn new(info: &DatasetInfo, device: Device, channels_last: bool) -> Result<Normalizer> {
        let c = info.meta.channels as i64;
        let mean: Vec<f32> = info.mean.iter().map(|m| m * 255.0).collect();
        let inv_std: Vec<f32> = info.std.iter().map(|s| 1.0 / (s * 255.0)).collect();
        Ok(Normalizer {
            shape: [c, info.meta.height as i64, info.meta.width as i64],
            channels_last,
            mean: Tensor::f_from_slice(&mean)?.f_view([1, c, 1, 1])?.f_to_device(device)?,
            inv_std: Tensor::f_from_slice(&inv_std)?.f_view([1, c, 1, 1])?.f_to_device(device)?,
            device,
        })
    }

    /// `n` samples' bytes (a flat uint8 host tensor, pinned for a GPU by the loader) as the
    /// model's normalised input on the training device.
    pub(super) fn images(&self, bytes: &Tensor, n: usize) -> Result<Tensor> {
        let [c, h, w] = self.shape;
        let host = bytes.f_view([n as i64, c, h, w])?;
        // To a GPU without waiting for the copy (the stream orders it before the kernels that
        // read it; from pinned memory it does not block the host); the bytes travel as uint8, a
        // quarter of the floats.
        let x = if self.device.is_cuda() { host.f_to_device_(self.device, Kind::Uint8, true, false)? } else { host };
        let x = x.f_to_kind(Kind::Float)?.f_sub(&self.mean)?.f_mul(&self.inv_std)?;
        if self.channels_last { raw::channels_last(&x) } else { Ok(x) }
    }

    /// As [`Normalizer::images`], from bytes in a plain buffer (evaluation's reads).
    pub(super) fn images_from_bytes(&self, bytes: &[u8], n: usize) -> Result<Tensor> {
        self.images(&Tensor::f_from_slice(bytes)?, n)
    }

    /// A batch's labels on the device. To a GPU from pinned memory without waiting: a copy from
    /// pageable memory makes the host wait for the device (libtorch stages it), once per step.
    /// The pinned block goes back to libtorch's cache once the copy is done (it records the
    /// copy's stream), so the host allocates nothing after the first steps.
    pub(super) fn labels(&self, labels: &[i64]) -> Result<Tensor> {
        let host = Tensor::f_from_slice(labels)?;
        if !self.device.is_cuda() {
            return Ok(host);
        }
        Ok(raw::pin_memory(&host)?.f_to_device_(self.device, Kind::Int64, true, false)?)
    }
}
/// Batch-norm buffers as a recomputed forward found them, to put back after its backward, so
/// that a micro-batch or unit counts once in the running statistics (`--recompute` in a
/// pipeline, `--zero 3`'s units).
pub(super) struct BuffersAsFound {
    /// Each buffer and its copy.
    buffers: Vec<(Tensor, Tensor)>,
}

impl BuffersAsFound {
    pub(super) fn take(buffers: &[Tensor]) -> Result<BuffersAsFound> {
        let copies = tch::no_grad(|| buffers.iter().map(|b| Ok((b.shallow_clone(), b.f_detach_copy()?))).collect::<Result<Vec<_>>>())?;
        Ok(BuffersAsFound { buffers: copies })
    }

    pub(super) fn put_back(self) -> Result<()> {
        tch::no_grad(|| self.buffers.iter().try_for_each(|(b, found)| b.shallow_clone().f_copy_(found).map(drop)))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_is_the_rectangles_its_rank_holds() {
        // q, k, v rows of a [12, 4] in-projection, rank 1 of 2: rows 2-3, 6-7, 10-11.
        let rects = cut_regions(&[12, 4], Split::Rows { parts: 3 }, 1, 2);
        let starts: Vec<Vec<i64>> = rects.iter().map(|r| match r { Region::Rect { offsets, .. } => offsets.clone(), _ => unreachable!() }).collect();
        assert_eq!(starts, vec![vec![2, 0], vec![6, 0], vec![10, 0]]);
        assert_eq!(cut_regions(&[4, 6], Split::Columns, 1, 2), vec![Region::Rect { offsets: vec![0, 3], lengths: vec![4, 3] }]);
        assert_eq!(cut_regions(&[4], Split::Whole, 0, 2), vec![Region::Whole]);
    }

    /// ZeRO's flat shards of a tensor-parallel part, as regions of the whole tensor: every range
    /// of every rank's part, for shard counts that cut rows anywhere, reads back its own elements
    /// from the whole, and the ranges of all ranks cover the whole once.
    #[test]
    fn a_flat_range_of_a_part_is_regions_of_the_whole() {
        use tch::Kind;
        let region_of = |t: &Tensor, region: &Region| -> Tensor {
            match region {
                Region::Flat { at, len } => t.view([-1]).narrow(0, *at, *len),
                Region::Rect { offsets, lengths } => (0..offsets.len()).fold(t.shallow_clone(), |r, d| r.narrow(d as i64, offsets[d], lengths[d])),
                Region::Whole => t.shallow_clone(),
            }
        };
        for (shape, split) in [(vec![12i64, 4], Split::Rows { parts: 3 }), (vec![12], Split::Rows { parts: 3 }), (vec![8, 5], Split::Rows { parts: 1 }), (vec![5, 8], Split::Columns), (vec![6], Split::Whole)] {
            let whole = Tensor::arange(shape.iter().product::<i64>(), (Kind::Float, Device::Cpu)).view(shape.as_slice());
            for size in [1, 2, 4] {
                for shards in [1, 2, 3, 7] {
                    let covered = whole.zeros_like();
                    for rank in 0..size {
                        let part = cut_tensor(&whole, split, rank, size).unwrap().contiguous().view([-1]);
                        let n = part.numel() as i64;
                        let bounds: Vec<i64> = (0..=shards).map(|s| n * s / shards).collect();
                        for range in bounds.windows(2) {
                            let (at, len) = (range[0], range[1] - range[0]);
                            let regions = part_range_regions(&shape, split, rank, size, at, len);
                            assert_eq!(regions.iter().map(|(r, _)| r.elements(&shape)).sum::<i64>(), len, "{shape:?} {split:?} {rank}/{size} {at}+{len}");
                            if let Split::Columns = split {
                                assert!(regions.len() <= 3, "a partial row, whole rows, a partial row: {regions:?}");
                            }
                            for (region, from) in &regions {
                                region.check("t", &shape).unwrap();
                                let wanted = part.narrow(0, at + from, region.elements(&shape));
                                assert!(region_of(&whole, region).contiguous().view([-1]).equal(&wanted), "{shape:?} {split:?} {rank}/{size} {at}+{len}: {region:?}");
                                let _ = region_of(&covered, region).f_add_scalar_(1.0).unwrap();
                            }
                        }
                        if split == Split::Whole {
                            // Every rank holds it whole: one writes.
                            break;
                        }
                    }
                    let counts = Vec::<f32>::try_from(&covered.view([-1])).unwrap();
                    assert!(counts.iter().all(|&c| c == 1.0), "{shape:?} {split:?} {size} {shards}: each element once, {counts:?}");
                }
            }
        }
        // Rows 2-3 of a [8, 5] cut in 4 (rank 1), from its element 3 on: the rest of row 2's
        // elements and all of row 3's, one flat range of the whole.
        assert_eq!(part_range_regions(&[8, 5], Split::Rows { parts: 1 }, 1, 4, 3, 7), vec![(Region::Flat { at: 13, len: 7 }, 0)]);
        // Columns 4-7 of a [5, 8] (rank 1 of 2), its elements 2 to 13: two of row 0, rows 1-2,
        // two of row 3.
        assert_eq!(
            part_range_regions(&[5, 8], Split::Columns, 1, 2, 2, 12),
            vec![
                (Region::Rect { offsets: vec![0, 6], lengths: vec![1, 2] }, 0),
                (Region::Rect { offsets: vec![1, 4], lengths: vec![2, 4] }, 2),
                (Region::Rect { offsets: vec![3, 4], lengths: vec![1, 2] }, 10),
            ]
        );
    }
}
