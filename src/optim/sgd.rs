//! SGD with momentum and weight decay, PyTorch's `torch.optim.SGD` rule:
//!
//! ```text
//! d = g + weight_decay * w
//! v = d                      (first step)
//! v = momentum * v + d       (later steps)
//! w = w - lr * v
//! ```
//!
//! It allocates nothing after the first step, and makes one pass over each tensor (libtorch's
//! fused SGD kernel, that of `torch.optim.SGD(fused=True)`, on the CPU and on CUDA).

use tch::Tensor;

use crate::error::Result;

use super::rule::{fusable, scalar_like, Step};

/// Updates the tensors at `which`. Tensors whose parameter, gradient and momentum buffer share
/// one dense layout (all of them, in practice) go through libtorch's fused SGD kernel: one pass
/// over the three where separate kernels made four (10 of ResNet-18's 490 ms step on 2 cores
/// were the optimizer; on a GPU, four launches per tensor). Any other tensor takes the same rule
/// in separate in-place kernels.
pub(super) fn update(step: &Step, params: &mut [Tensor], grads: &mut [Tensor], momentum: &mut [Option<Tensor>], which: &[usize]) -> Result<()> {
    let Some(&first) = which.first() else { return Ok(()) };
    let c = step.config;
    let uses_momentum = c.momentum != 0.0;
    let (mut first_step, mut later_step, mut by_hand) = (Vec::new(), Vec::new(), Vec::new());
    for &i in which {
        let buffer = momentum[i].as_ref();
        if !fusable(&params[i], &grads[i], &params[first]) || buffer.is_some_and(|v| v.stride() != grads[i].stride()) {
            by_hand.push(i);
        } else if uses_momentum && buffer.is_none() {
            first_step.push(i);
        } else {
            later_step.push(i);
        }
    }
    for &i in &first_step {
        momentum[i] = Some(grads[i].f_empty_like()?);
    }
    for (group, is_first_step) in [(&first_step, true), (&later_step, false)] {
        if group.is_empty() {
            continue;
        }
        let w: Vec<&Tensor> = group.iter().map(|&i| &params[i]).collect();
        let g: Vec<&Tensor> = group.iter().map(|&i| &grads[i]).collect();
        let v: Vec<&Tensor> = if uses_momentum { group.iter().map(|&i| momentum[i].as_ref().expect("made above")).collect() } else { Vec::new() };
        crate::raw::fused_sgd(&w, &g, &v, c.weight_decay, c.momentum, step.lr, is_first_step, step.skip_if)?;
    }
    if by_hand.is_empty() || step.skipped()? {
        return Ok(());
    }
    by_hand_update(step, params, grads, momentum, &by_hand)
}

/// The same rule in separate in-place kernels, for tensors the fused kernel cannot take;
/// `grads` holds `g + weight_decay * w` afterwards. The scalars live in 0-dim tensors, so that
/// `addcmul_` fuses each multiply-add.
fn by_hand_update(step: &Step, params: &mut [Tensor], grads: &mut [Tensor], momentum: &mut [Option<Tensor>], which: &[usize]) -> Result<()> {
    let Some(&first) = which.first() else { return Ok(()) };
    let c = step.config;
    let neg_lr = scalar_like(-step.lr, &params[first])?;
    let weight_decay = scalar_like(c.weight_decay, &params[first])?;
    for &i in which {
        let (w, g, v) = (&mut params[i], &mut grads[i], &mut momentum[i]);
        if c.weight_decay != 0.0 {
            let _ = g.f_addcmul_(w, &weight_decay)?;
        }
        let direction = if c.momentum != 0.0 {
            match v {
                None => *v = Some(g.f_detach_copy()?),
                Some(v) => {
                    let _ = v.f_mul_scalar_(c.momentum)?;
                    let _ = v.f_add_(g)?;
                }
            }
            v.as_ref().unwrap()
        } else {
            &*g
        };
        let _ = w.f_addcmul_(direction, &neg_lr)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::config::OptimizerConfig;

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_slice(v)
    }

    /// `steps` updates of `w` at rate `lr`, the gradients of each step from `grad(step)`.
    fn run(config: &OptimizerConfig, lr: f64, w: &mut [Tensor], steps: usize, grad: impl Fn(usize) -> Vec<Tensor>) {
        let mut momentum: Vec<Option<Tensor>> = w.iter().map(|_| None).collect();
        let all: Vec<usize> = (0..w.len()).collect();
        for k in 0..steps {
            let step = Step { lr, count: k as u64 + 1, config, skip_if: None };
            tch::no_grad(|| update(&step, w, &mut grad(k), &mut momentum, &all)).unwrap();
        }
    }

    #[test]
    fn matches_the_pytorch_rule_by_hand() {
        let config = OptimizerConfig::sgd(0.1, 0.9, 0.01);
        let mut w = vec![t(&[1.0, -2.0])];
        let g_of = |step: usize| [0.5f32 * (step as f32 + 1.0), -0.25];
        run(&config, 0.1, &mut w, 3, |k| vec![t(&g_of(k))]);
        let (mut w_ref, mut v_ref) = ([1.0f64, -2.0], [0.0f64; 2]);
        for step in 0..3 {
            for i in 0..2 {
                let d = g_of(step)[i] as f64 + 0.01 * w_ref[i];
                v_ref[i] = if step == 0 { d } else { 0.9 * v_ref[i] + d };
                w_ref[i] -= 0.1 * v_ref[i];
            }
        }
        let got = Vec::<f32>::try_from(&w[0]).unwrap();
        for i in 0..2 {
            assert!((got[i] as f64 - w_ref[i]).abs() < 1e-6, "{got:?} vs {w_ref:?}");
        }
    }

    /// The fused kernel and the separate kernels (taken by a gradient whose strides differ from
    /// its parameter's) follow one rule, with and without momentum and weight decay.
    #[test]
    fn fused_and_separate_kernels_give_the_same_weights() {
        for (momentum, weight_decay) in [(0.9, 1e-2), (0.0, 0.0), (0.9, 0.0), (0.0, 1e-2)] {
            let config = OptimizerConfig::sgd(0.05, momentum, weight_decay);
            let w0 = Tensor::from_slice(&(0..35).map(|i| (i as f32 * 0.37).cos()).collect::<Vec<_>>()).view([5, 7]);
            let grad = |step: usize| Tensor::from_slice(&(0..35).map(|i| ((i + step) as f32 * 0.61).sin()).collect::<Vec<_>>()).view([5, 7]);
            let (mut fused_w, mut separate_w) = (vec![w0.copy()], vec![w0.copy()]);
            assert!(fusable(&fused_w[0], &grad(0), &fused_w[0]));
            assert!(!fusable(&separate_w[0], &grad(0).tr().contiguous().tr(), &separate_w[0]));
            run(&config, 0.05, &mut fused_w, 4, |k| vec![grad(k)]);
            run(&config, 0.05, &mut separate_w, 4, |k| vec![grad(k).tr().contiguous().tr()]);
            let diff = (&fused_w[0] - &separate_w[0]).abs().max().double_value(&[]);
            assert!(diff < 1e-6, "momentum {momentum}, weight decay {weight_decay}: {diff}");
            assert!((&fused_w[0] - &w0).abs().max().double_value(&[]) > 1e-3, "the weights moved");
        }
    }

    #[test]
    fn flat_and_split_layouts_give_the_same_weights() {
        let config = OptimizerConfig::sgd(0.05, 0.9, 5e-4);
        let w0: Vec<f32> = (0..10).map(|i| i as f32 * 0.1 - 0.3).collect();
        let g0: Vec<f32> = (0..10).map(|i| (i as f32 * 0.7).sin()).collect();
        let mut split_w = vec![t(&w0[..4]), t(&w0[4..])];
        let mut flat_w = vec![t(&w0)];
        run(&config, 0.05, &mut split_w, 3, |_| vec![t(&g0[..4]), t(&g0[4..])]);
        run(&config, 0.05, &mut flat_w, 3, |_| vec![t(&g0)]);
        let diff = (Tensor::cat(&split_w, 0) - &flat_w[0]).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{diff}");
    }
}
