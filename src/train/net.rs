//! The network: the model, its parameters and buffers by name ([`Net`]), and the normalisation
//! of raw image bytes into the input it trains on ([`Normalizer`]).

use tch::nn::{self};
use tch::{Device, Kind, Tensor};

use crate::data::DatasetInfo;
use crate::error::Result;
use crate::model::{self, InputSpec};
use crate::raw;

use super::options::TrainArgs;
use super::stages::StageCut;

/// How the model is held: whole, as one pipeline stage's chunks, or as `--zero 3`'s units.
pub(super) enum NetLayout<'a> {
    Whole,
    Stage(&'a StageCut),
    /// The blocks of each unit, consecutive and in model order.
    Units(&'a [std::ops::Range<usize>]),
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
}

impl Net {
    /// The whole model, or with `stage` the chunks of one pipeline stage (its blocks'
    /// variables only; the others are drawn in a scratch store and dropped, so that the seed
    /// gives every variable the value it has in the whole model).
    pub(super) fn new(args: &TrainArgs, info: &DatasetInfo, device: Device, layout: NetLayout) -> Result<(Net, InputSpec)> {
        let spec = input_spec(info);
        // The same initial weights on every rank and every device: initialised on the CPU from
        // the seed, then moved. CUDA's random stream differs from the CPU's, so weights drawn on
        // the GPU would differ from a CPU run's with the same seed. Moving keeps each variable's
        // identity (set_data), so the model's layers see the moved tensors.
        tch::manual_seed(args.seed as i64);
        let mut vs = nn::VarStore::new(Device::Cpu);
        let chunks = match layout {
            NetLayout::Whole => {
                let model = model::build(args.model, &vs.root(), spec);
                model::check_forward(&model, spec, Device::Cpu)?;
                vec![(0, model)]
            }
            NetLayout::Units(groups) => {
                let blocks = model::build_blocks(args.model, spec, |_| vs.root());
                if args.model == model::ModelKind::TinyUnused {
                    // As model::build: created after the used layers, never given a gradient.
                    let _unused = nn::linear(vs.root() / "unused", 8, 8, Default::default());
                }
                sequences(blocks, groups.iter().cloned().enumerate())
            }
            NetLayout::Stage(cut) => {
                let scratch = nn::VarStore::new(Device::Cpu);
                stage_chunks(model::build_blocks(args.model, spec, |b| if cut.holds(b) { vs.root() } else { scratch.root() }), cut)
            }
        };
        vs.set_device(device);
        Ok((Net::from_store(vs, chunks), spec))
    }

    /// The network of the variables in `vs` (on their device) and the modules that use them.
    pub(super) fn from_store(vs: nn::VarStore, chunks: Vec<(usize, nn::FuncT<'static>)>) -> Net {
        let params = vs.trainable_variables();
        let param_addrs: Vec<usize> = params.iter().map(raw::data_address).collect();
        let variables = vs.variables();
        let param_names: Vec<String> = param_addrs
            .iter()
            .map(|a| variables.iter().find(|(_, t)| raw::data_address(t) == *a).map(|(n, _)| n.clone()).expect("every parameter is a variable"))
            .collect();
        let mut buffers: Vec<(String, Tensor)> =
            variables.into_iter().filter(|(_, t)| !param_addrs.contains(&raw::data_address(t))).collect();
        buffers.sort_by(|a, b| a.0.cmp(&b.0));
        Net { vs, chunks, params, param_names, buffers }
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

    /// Copies every variable from a safetensors file of the model's variables by name
    /// (`--init-weights`: what --save-weights and checkpoints write, or a torchvision
    /// state_dict saved with safetensors). Every variable must be there with its shape.
    pub(super) fn load_weights(&self, path: &std::path::Path) -> Result<()> {
        let refuse = |reason: String| crate::error::Error::usage(format!("--init-weights {}: {reason}", path.display()));
        let file: std::collections::BTreeMap<String, Tensor> = Tensor::read_safetensors(path)
            .map_err(|e| refuse(format!("not a readable safetensors file ({e})")))?
            .into_iter()
            .collect();
        tch::no_grad(|| -> Result<()> {
            for (name, variable) in self.named_variables() {
                let saved = file.get(&name).ok_or_else(|| refuse(format!("no tensor {name} among its {} (weights of another model?)", file.len())))?;
                if saved.size() != variable.size() {
                    return Err(refuse(format!("{name} has shape {:?}, the model's is {:?}", saved.size(), variable.size())));
                }
                variable.shallow_clone().f_copy_(saved)?;
            }
            Ok(())
        })
    }

    pub(super) fn grads(&self) -> Vec<Tensor> {
        self.params.iter().map(|p| p.grad()).collect()
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

/// The names of `kind`'s blocks, and the block that creates each variable (by name): a build
/// into one store per block. It draws from libtorch's random stream, so it comes before the
/// seed is set for the real build.
pub(super) fn variable_blocks(kind: model::ModelKind, spec: InputSpec) -> (Vec<String>, std::collections::HashMap<String, usize>) {
    let count = model::block_count(kind);
    let stores: Vec<nn::VarStore> = (0..count).map(|_| nn::VarStore::new(Device::Cpu)).collect();
    let blocks = model::build_blocks(kind, spec, |b| stores[b].root());
    let names = blocks.iter().map(|b| b.name.clone()).collect();
    let of = stores.iter().enumerate().flat_map(|(b, vs)| vs.variables().into_keys().map(move |name| (name, b))).collect();
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

    pub(super) fn labels(&self, labels: &[i64]) -> Result<Tensor> {
        Ok(Tensor::f_from_slice(labels)?.f_to_device(self.device)?)
    }
}
