//! SGD with momentum and weight decay, PyTorch's `torch.optim.SGD` rule:
//!
//! ```text
//! d = g + weight_decay * w
//! v = d                      (first step)
//! v = momentum * v + d       (later steps)
//! w = w - lr * v
//! ```
//!
//! One implementation serves every strategy: the workers of the averaging strategies call it
//! on whole parameter tensors, a parameter server on its flat shard of them. The update is
//! element-wise, so both give the same weights. It allocates nothing after the first step, and
//! on the host makes one pass over each tensor (libtorch's fused SGD kernel, that of
//! `torch.optim.SGD(fused=True)`).

use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use crate::error::Result;

#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct SgdConfig {
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
}

pub struct Sgd {
    pub config: SgdConfig,
    /// One momentum buffer per parameter tensor, made at the first step.
    momentum: Vec<Option<Tensor>>,
    /// -lr and weight_decay as 0-dim tensors on the parameters' device.
    neg_lr: Option<Tensor>,
    weight_decay: Option<Tensor>,
    steps: u64,
    /// Time spent in `step` since the last `take_busy`.
    busy: Duration,
}

impl Sgd {
    pub fn new(config: SgdConfig) -> Sgd {
        Sgd { config, momentum: Vec::new(), neg_lr: None, weight_decay: None, steps: 0, busy: Duration::ZERO }
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Applies one update to `params` from `grads` (same shapes, same order). `grads` may be
    /// used as scratch.
    pub fn step(&mut self, params: &mut [Tensor], grads: &mut [Tensor]) -> Result<()> {
        let all: Vec<usize> = (0..params.len()).collect();
        self.step_some(params, grads, &all)?;
        self.count_step();
        Ok(())
    }

    /// Counts a step made of several `step_some` calls (one per bucket).
    pub fn count_step(&mut self) {
        self.steps += 1;
    }

    /// Updates only the parameters at `which` (their momentum buffers are theirs alone, so a
    /// step made bucket by bucket equals one made at once). Does not count a step.
    ///
    /// Host tensors whose parameter, gradient and momentum buffer share one dense layout (all of
    /// them, in practice) go through libtorch's fused SGD kernel: one pass over the three where
    /// separate kernels made four (10 of ResNet-18's 490 ms step on 2 cores were the optimizer).
    /// Any other tensor takes the same rule in separate in-place kernels.
    pub fn step_some(&mut self, params: &mut [Tensor], grads: &mut [Tensor], which: &[usize]) -> Result<()> {
        let started = Instant::now();
        assert_eq!(params.len(), grads.len(), "one gradient per parameter");
        if self.momentum.len() != params.len() {
            self.momentum = (0..params.len()).map(|_| None).collect();
        }
        let uses_momentum = self.config.momentum != 0.0;
        let (mut first_step, mut later_step, mut by_hand) = (Vec::new(), Vec::new(), Vec::new());
        for &i in which {
            let buffer = self.momentum[i].as_ref();
            if !fusable(&params[i], &grads[i], &params[which[0]]) || buffer.is_some_and(|v| v.stride() != grads[i].stride()) {
                by_hand.push(i);
            } else if uses_momentum && buffer.is_none() {
                first_step.push(i);
            } else {
                later_step.push(i);
            }
        }
        tch::no_grad(|| -> Result<()> {
            for &i in &first_step {
                self.momentum[i] = Some(grads[i].f_empty_like()?);
            }
            for (group, is_first_step) in [(&first_step, true), (&later_step, false)] {
                if group.is_empty() {
                    continue;
                }
                let w: Vec<&Tensor> = group.iter().map(|&i| &params[i]).collect();
                let g: Vec<&Tensor> = group.iter().map(|&i| &grads[i]).collect();
                let v: Vec<&Tensor> = if uses_momentum { group.iter().map(|&i| self.momentum[i].as_ref().expect("made above")).collect() } else { Vec::new() };
                crate::raw::fused_sgd(&w, &g, &v, self.config.weight_decay, self.config.momentum, self.config.lr, is_first_step)?;
            }
            self.step_by_hand(params, grads, &by_hand)
        })?;
        self.busy += started.elapsed();
        Ok(())
    }

    /// The same rule in separate in-place kernels, for tensors the fused kernel cannot take;
    /// `grads` holds `g + weight_decay * w` afterwards. The scalars live in 0-dim tensors, so
    /// that `addcmul_` fuses each multiply-add.
    fn step_by_hand(&mut self, params: &mut [Tensor], grads: &mut [Tensor], which: &[usize]) -> Result<()> {
        let Some(&first) = which.first() else { return Ok(()) };
        let (device, kind) = (params[first].device(), params[first].kind());
        let scalar = |v: f64| Tensor::f_from_slice(&[v as f32]).and_then(|t| t.f_to_kind(kind)?.f_to_device(device)?.f_reshape([]));
        if self.neg_lr.as_ref().is_none_or(|t| t.device() != device || t.kind() != kind) {
            self.neg_lr = Some(scalar(-self.config.lr)?);
            self.weight_decay = Some(scalar(self.config.weight_decay)?);
        }
        let (neg_lr, weight_decay) = (self.neg_lr.as_ref().unwrap(), self.weight_decay.as_ref().unwrap());
        let momentum = self.config.momentum;
        for &i in which {
            let (w, g, v) = (&mut params[i], &mut grads[i], &mut self.momentum[i]);
            if self.config.weight_decay != 0.0 {
                let _ = g.f_addcmul_(w, weight_decay)?;
            }
            let direction = if momentum != 0.0 {
                match v {
                    None => *v = Some(g.f_detach_copy()?),
                    Some(v) => {
                        let _ = v.f_mul_scalar_(momentum)?;
                        let _ = v.f_add_(g)?;
                    }
                }
                v.as_ref().unwrap()
            } else {
                &*g
            };
            let _ = w.f_addcmul_(direction, neg_lr)?;
        }
        Ok(())
    }

    /// Time spent stepping since the last call.
    pub fn take_busy(&mut self) -> Duration {
        std::mem::take(&mut self.busy)
    }

    /// The momentum buffers, for checkpoints (`None` before the first step).
    pub fn momentum_buffers(&self) -> &[Option<Tensor>] {
        &self.momentum
    }

    /// Restores the state saved in a checkpoint.
    pub fn restore(&mut self, momentum: Vec<Option<Tensor>>, steps: u64) {
        self.momentum = momentum;
        self.steps = steps;
    }
}

/// Whether the fused kernel can update `w` from `g`: a host tensor, of the kind of `first` (the
/// call's first parameter), a floating kind the kernel handles, and one dense layout, since the
/// CPU kernel walks w, g and the momentum buffer (made like `g`) as flat arrays. GPU tensors keep
/// the separate kernels: the CUDA fused kernel has not been run by this project yet (no GPU in
/// CI), and on a GPU the four passes cost well under a millisecond.
fn fusable(w: &Tensor, g: &Tensor, first: &Tensor) -> bool {
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

/// Whether a step's gradients are all finite, gathered on the device bucket by bucket and read
/// once at the step's end: a read of a device value makes the host wait for the GPU, and with
/// overlap a read per bucket made each bucket's exchange wait for every backward kernel queued
/// so far. Each tensor adds its minimum and maximum (one pass, `aminmax`, no temporary as large
/// as the tensor), in f64: NaN carries through both, an infinity shows in one of them, and the
/// extremes of finite values add up to a finite f64, so the total is finite exactly when every
/// element is.
#[derive(Default)]
pub struct FiniteCheck {
    total: Option<Tensor>,
}

impl FiniteCheck {
    /// Adds `t`'s elements (queued on the device; nothing is read).
    pub fn add(&mut self, t: &Tensor) -> Result<()> {
        if !t.defined() || t.numel() == 0 {
            return Ok(());
        }
        let (low, high) = t.f_aminmax(None, false)?;
        let extremes = low.f_to_kind(Kind::Double)?.f_add(&high.f_to_kind(Kind::Double)?)?;
        self.total = Some(match self.total.take() {
            None => extremes,
            Some(total) => total.f_add(&extremes)?,
        });
        Ok(())
    }

    /// Whether every element added so far is finite: one read of the device.
    pub fn all_finite(&self) -> Result<bool> {
        match &self.total {
            None => Ok(true),
            Some(total) => Ok(total.f_double_value(&[])?.is_finite()),
        }
    }
}

/// Whether every element of every tensor is finite, in one pass over them: a sum per tensor in
/// its own kind, then a single device-to-host read for all of them (a read per tensor would stall
/// a GPU once per parameter). NaN and infinities carry through a sum, so a finite total proves
/// every element finite. A total that is not finite may also come from finite values whose sum
/// overflows, so only then is each element checked (`isfinite`), which is exact but four passes
/// and a mask as large as the tensors. The sum must stay in the tensor's kind: asked for in f64,
/// libtorch first copies the tensor to f64 (a scalar cast loop), which made this check cost
/// 12 ms of a 490 ms ResNet-18 step on 2 cores, against 5 ms for the plain sum.
pub fn all_finite(tensors: &[Tensor]) -> Result<bool> {
    let defined: Vec<&Tensor> = tensors.iter().filter(|t| t.defined()).collect();
    let sums: Vec<Tensor> = defined.iter().map(|t| t.f_sum(t.kind())?.f_to_kind(Kind::Float)).collect::<std::result::Result<_, _>>()?;
    let total_finite = match sums.as_slice() {
        [] => return Ok(true),
        [one] => one.f_double_value(&[])?.is_finite(),
        many => Tensor::f_stack(many, 0)?.f_sum(Kind::Double)?.f_double_value(&[])?.is_finite(),
    };
    if total_finite {
        return Ok(true);
    }
    for t in defined {
        if t.f_isfinite()?.f_all()?.f_int64_value(&[])? == 0 {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Zeroes every gradient in place (keeping its storage, which the exchange buffers rely on);
/// a gradient that was let go (ZeRO stage 2) stays undefined until backward makes it.
pub fn zero_grads(grads: &mut [Tensor]) -> Result<()> {
    for g in grads.iter_mut().filter(|g| g.defined()) {
        let _ = g.f_zero_()?;
    }
    Ok(())
}

/// Makes every parameter's gradient defined (zero), so that a parameter unused by a step still
/// has a gradient to exchange and every rank exchanges the same set.
pub fn define_grads(params: &[Tensor]) -> Result<Vec<Tensor>> {
    let touch = params.iter().try_fold(Tensor::f_zeros([], (Kind::Float, params[0].device()))?, |acc, p| {
        acc.f_add(&p.f_sum(Kind::Float)?.f_mul_scalar(0.0)?)
    })?;
    touch.f_backward()?;
    Ok(params.iter().map(|p| p.grad()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_slice(v)
    }

    #[test]
    fn matches_the_pytorch_rule_by_hand() {
        let cfg = SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.01 };
        let mut sgd = Sgd::new(cfg);
        let mut w = vec![t(&[1.0, -2.0])];
        let mut w_ref = [1.0f64, -2.0];
        let mut v_ref = [0.0f64; 2];
        for step in 0..3 {
            let g_vals = [0.5f32 * (step as f32 + 1.0), -0.25];
            let mut g = vec![t(&g_vals)];
            sgd.step(&mut w, &mut g).unwrap();
            for i in 0..2 {
                let d = g_vals[i] as f64 + 0.01 * w_ref[i];
                v_ref[i] = if step == 0 { d } else { 0.9 * v_ref[i] + d };
                w_ref[i] -= 0.1 * v_ref[i];
            }
        }
        let got = Vec::<f32>::try_from(&w[0]).unwrap();
        for i in 0..2 {
            assert!((got[i] as f64 - w_ref[i]).abs() < 1e-6, "{got:?} vs {w_ref:?}");
        }
        assert_eq!(sgd.steps(), 3);
    }

    /// The fused kernel and the separate kernels (taken by a gradient whose strides differ from
    /// its parameter's) follow one rule, with and without momentum and weight decay.
    #[test]
    fn fused_and_separate_kernels_give_the_same_weights() {
        for (momentum, weight_decay) in [(0.9, 1e-2), (0.0, 0.0), (0.9, 0.0), (0.0, 1e-2)] {
            let cfg = SgdConfig { lr: 0.05, momentum, weight_decay };
            let w0 = Tensor::from_slice(&(0..35).map(|i| (i as f32 * 0.37).cos()).collect::<Vec<_>>()).view([5, 7]);
            let (mut fused_w, mut separate_w) = (vec![w0.copy()], vec![w0.copy()]);
            let (mut fused, mut separate) = (Sgd::new(cfg), Sgd::new(cfg));
            for step in 0..4 {
                let g = Tensor::from_slice(&(0..35).map(|i| ((i + step) as f32 * 0.61).sin()).collect::<Vec<_>>()).view([5, 7]);
                let g_transposed_layout = g.tr().contiguous().tr();
                assert!(!fusable(&separate_w[0], &g_transposed_layout, &separate_w[0]));
                assert!(fusable(&fused_w[0], &g, &fused_w[0]));
                fused.step(&mut fused_w, &mut [g]).unwrap();
                separate.step(&mut separate_w, &mut [g_transposed_layout]).unwrap();
            }
            let diff = (&fused_w[0] - &separate_w[0]).abs().max().double_value(&[]);
            assert!(diff < 1e-6, "momentum {momentum}, weight decay {weight_decay}: {diff}");
            assert!((&fused_w[0] - &w0).abs().max().double_value(&[]) > 1e-3, "the weights moved");
        }
    }

    #[test]
    fn the_deferred_check_sees_one_bad_element_and_no_false_one() {
        let t = |v: &[f32]| Tensor::from_slice(v);
        let verdict = |tensors: &[Tensor]| {
            let mut check = FiniteCheck::default();
            tensors.iter().for_each(|x| check.add(x).unwrap());
            check.all_finite().unwrap()
        };
        assert!(verdict(&[]));
        assert!(verdict(&[t(&[1.0, -2.0]), t(&[0.0])]));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            assert!(!verdict(&[t(&[1.0]), t(&[0.0, bad, 2.0])]), "{bad}");
        }
        assert!(!verdict(&[t(&[f32::INFINITY, f32::NEG_INFINITY])]), "opposite infinities");
        // Finite values whose f32 sum overflows, in many tensors: still finite.
        assert!(verdict(&[t(&[f32::MAX; 8]), t(&[f32::MAX, -f32::MAX]), t(&[f32::MAX])]));
        let half = Tensor::from_slice(&[60000.0f32; 4]).to_kind(Kind::Half);
        assert!(verdict(&[half.shallow_clone(), half]), "f16 values whose f16 sum overflows");
    }

    #[test]
    fn all_finite_sees_one_bad_element_among_many_tensors() {
        let good = [t(&[1.0, 2.0]), t(&[3.0])];
        assert!(all_finite(&good).unwrap());
        assert!(all_finite(&[]).unwrap());
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            assert!(!all_finite(&[t(&[1.0]), t(&[0.0, bad, 2.0])]).unwrap(), "{bad}");
            assert!(!all_finite(&[t(&[bad])]).unwrap(), "{bad}");
        }
        assert!(!all_finite(&[t(&[f32::INFINITY, f32::NEG_INFINITY])]).unwrap(), "opposite infinities");
        assert!(all_finite(&[t(&[f32::MAX; 8]), t(&[f32::MAX])]).unwrap(), "large finite values whose f32 sum overflows");
        assert!(!all_finite(&[t(&[f32::MAX, f32::MAX, f32::NAN])]).unwrap(), "a NaN among values whose sum overflows");
        let half = |v: &[f32]| t(v).to_kind(Kind::Half);
        assert!(all_finite(&[half(&[60000.0; 4])]).unwrap(), "f16 values whose f16 sum overflows");
        assert!(!all_finite(&[half(&[1.0, f32::INFINITY])]).unwrap(), "an f16 infinity");
    }

    #[test]
    fn flat_and_split_layouts_give_the_same_weights() {
        let cfg = SgdConfig { lr: 0.05, momentum: 0.9, weight_decay: 5e-4 };
        let w0: Vec<f32> = (0..10).map(|i| i as f32 * 0.1 - 0.3).collect();
        let g0: Vec<f32> = (0..10).map(|i| (i as f32 * 0.7).sin()).collect();
        let mut split_w = vec![t(&w0[..4]), t(&w0[4..])];
        let mut flat_w = vec![t(&w0)];
        let (mut a, mut b) = (Sgd::new(cfg), Sgd::new(cfg));
        for _ in 0..3 {
            a.step(&mut split_w, &mut [t(&g0[..4]), t(&g0[4..])]).unwrap();
            b.step(&mut flat_w, &mut [t(&g0)]).unwrap();
        }
        let joined = Tensor::cat(&split_w, 0);
        let diff = (joined - &flat_w[0]).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{diff}");
        assert_eq!(flat_w[0].device(), Device::Cpu);
    }
}
