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
//! element-wise, so both give the same weights. It allocates nothing after the first step: the
//! scalars live in 0-dim tensors and `addcmul_` fuses the multiply-adds.

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

    /// Applies one update to `params` from `grads` (same shapes, same order). `grads` is used as
    /// scratch: it holds `g + weight_decay * w` afterwards.
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
    pub fn step_some(&mut self, params: &mut [Tensor], grads: &mut [Tensor], which: &[usize]) -> Result<()> {
        let started = Instant::now();
        assert_eq!(params.len(), grads.len(), "one gradient per parameter");
        if self.momentum.len() != params.len() {
            self.momentum = (0..params.len()).map(|_| None).collect();
        }
        let Some(first) = params.first() else { return Ok(()) };
        let (device, kind) = (first.device(), first.kind());
        let scalar = |v: f64| Tensor::f_from_slice(&[v as f32]).and_then(|t| t.f_to_kind(kind)?.f_to_device(device)?.f_reshape([]));
        if self.neg_lr.as_ref().is_none_or(|t| t.device() != device) {
            self.neg_lr = Some(scalar(-self.config.lr)?);
            self.weight_decay = Some(scalar(self.config.weight_decay)?);
        }
        let (neg_lr, weight_decay) = (self.neg_lr.as_ref().unwrap(), self.weight_decay.as_ref().unwrap());
        let momentum = self.config.momentum;

        tch::no_grad(|| -> Result<()> {
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
        })?;
        self.busy += started.elapsed();
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

/// Whether every element of every tensor is finite: one sum per tensor, then a single
/// device-to-host read for all of them (a read per tensor would stall a GPU once per
/// parameter). A sum taken in f64 is finite exactly when every element is: NaN and infinities
/// carry through it, and no sum of f32 (or 16-bit) values can overflow an f64. One pass over
/// the gradients, where `isfinite().all()` made four and a mask as large as them.
pub fn all_finite(tensors: &[Tensor]) -> Result<bool> {
    let sums: Vec<Tensor> = tensors.iter().filter(|t| t.defined()).map(|t| t.f_sum(Kind::Double)).collect::<std::result::Result<_, _>>()?;
    match sums.as_slice() {
        [] => Ok(true),
        [one] => Ok(one.f_double_value(&[])?.is_finite()),
        many => Ok(Tensor::f_stack(many, 0)?.f_sum(Kind::Double)?.f_double_value(&[])?.is_finite()),
    }
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
