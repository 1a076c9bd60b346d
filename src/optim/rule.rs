//! What the update rules (sgd.rs, lars.rs, adamw.rs) share: the step they make, where their
//! tensors come from, and the checks and scalars of their kernels.

use tch::{Kind, Tensor};

use crate::error::Result;

use super::config::OptimizerConfig;

/// Where the pieces of one update come from: whole parameter tensors, or parts of them (ZeRO's
/// shards, a server's share) that LARS must see as parts of their layers.
pub enum Pieces<'a> {
    /// Index i is parameter tensor i.
    Whole,
    /// Index i is a part of parameter tensor `layer_of[i]`. `layers` lists the tensors the
    /// update covers, in an order every rank shares; `sum_over_ranks` adds a vector of
    /// per-layer figures over the ranks that hold the other parts (in place; identity when
    /// this rank holds whole layers).
    Parts { layer_of: &'a [usize], layers: &'a [usize], sum_over_ranks: &'a mut dyn FnMut(&mut Tensor) -> Result<()> },
}

/// What one update needs to know beside the tensors.
pub(super) struct Step<'a> {
    pub(super) lr: f64,
    /// The update's number, counting from 1 (AdamW's bias correction).
    pub(super) count: u64,
    pub(super) config: &'a OptimizerConfig,
}

/// Whether libtorch's fused CPU kernels (those of `fused=True` in torch.optim) can update `w`
/// from `g`: a host tensor of a floating kind, and one dense layout shared with `g` and with
/// `first` (the call's first parameter), since the kernel walks all of a call's tensors as flat
/// arrays of one kind. GPU tensors take separate kernels: the CUDA fused kernels have not been
/// run by this project yet (no GPU in CI), and on a GPU the extra passes cost well under a
/// millisecond.
pub(super) fn fusable(w: &Tensor, g: &Tensor, first: &Tensor) -> bool {
    w.device() == tch::Device::Cpu
        && matches!(w.kind(), Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16)
        && g.defined()
        && w.kind() == g.kind()
        && w.kind() == first.kind()
        && w.device() == g.device()
        && w.device() == first.device()
        && w.size() == g.size()
        && w.stride() == g.stride()
        && crate::raw::flat_dense_view(w).is_ok()
}

/// A 0-dim tensor of `value` of `like`'s kind on its device: a factor that `addcmul_` and `mul_`
/// take without a host round trip.
pub(super) fn scalar_like(value: f64, like: &Tensor) -> Result<Tensor> {
    Ok(Tensor::f_from_slice(&[value])?.f_to_kind(like.kind())?.f_to_device(like.device())?.f_reshape([])?)
}
