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
    /// A one-element flag on the device ([`super::Optimizer::skip_if`]): where it is set, the
    /// update changes nothing. The fused kernels read it on the device; the others read it on
    /// the host ([`Step::skipped`]), once, when they have tensors to update.
    pub(super) skip_if: Option<&'a Tensor>,
}

impl Step<'_> {
    /// Whether the skip flag is set: a read of the device (the kernels without a flag of their
    /// own: LARS, and tensors the fused kernels cannot take).
    pub(super) fn skipped(&self) -> Result<bool> {
        match self.skip_if {
            Some(flag) => Ok(flag.f_double_value(&[0])? != 0.0),
            None => Ok(false),
        }
    }
}

/// Whether libtorch's fused kernels (those of `fused=True` in torch.optim, on the CPU and on
/// CUDA) can update `w` from `g`: a floating kind, and one dense layout shared with `g` and with
/// `first` (the call's first parameter), on one device: the CPU kernel walks all of a call's
/// tensors as flat arrays of one kind, and the CUDA one refuses tensors that differ in device,
/// kind or strides (`check_fast_path_restrictions`). On a GPU the separate kernels were four
/// launches per tensor, 3.2 ms of host time per ResNet-50 step on the H200 (2026-11-26), where
/// the fused kernel is a few multi-tensor launches.
pub(super) fn fusable(w: &Tensor, g: &Tensor, first: &Tensor) -> bool {
    matches!(w.kind(), Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16)
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
