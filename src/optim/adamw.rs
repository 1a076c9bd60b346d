//! AdamW, PyTorch's `torch.optim.AdamW` rule (Loshchilov and Hutter, "Decoupled Weight Decay
//! Regularization", 2019), at step t counted from 1:
//!
//! ```text
//! w = w (1 - lr weight_decay)
//! m = m + (1 - beta1) (g - m)                     (m, v start at 0)
//! v = beta2 v + (1 - beta2) g^2
//! w = w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//! ```
//!
//! Element-wise, so a shard or a flat buffer steps as the whole tensors would. The update is
//! libtorch's fused AdamW kernel (that of `torch.optim.AdamW(fused=True)`, on the CPU and on
//! CUDA): one pass over the four tensors where separate kernels take seven.

use tch::Tensor;

use crate::error::Result;

use super::rule::{fusable, Step};

pub(super) fn update(
    step: &Step,
    params: &mut [Tensor],
    grads: &mut [Tensor],
    exp_avg: &mut [Option<Tensor>],
    exp_avg_sq: &mut [Option<Tensor>],
    which: &[usize],
) -> Result<()> {
    let Some(&first) = which.first() else { return Ok(()) };
    for &i in which {
        for buffer in [&mut exp_avg[i], &mut exp_avg_sq[i]] {
            if buffer.is_none() {
                *buffer = Some(params[i].f_zeros_like()?);
            }
        }
    }
    let c = step.config;
    let (fused, by_hand): (Vec<usize>, Vec<usize>) = which.iter().partition(|&&i| {
        fusable(&params[i], &grads[i], &params[first]) && [&exp_avg[i], &exp_avg_sq[i]].iter().all(|b| b.as_ref().is_some_and(|b| b.stride() == grads[i].stride()))
    });
    if !fused.is_empty() {
        let pick = |list: &[Option<Tensor>]| -> Vec<Tensor> { fused.iter().map(|&i| list[i].as_ref().expect("made above").shallow_clone()).collect() };
        let w: Vec<&Tensor> = fused.iter().map(|&i| &params[i]).collect();
        let g: Vec<&Tensor> = fused.iter().map(|&i| &grads[i]).collect();
        let (m, v) = (pick(exp_avg), pick(exp_avg_sq));
        crate::raw::fused_adamw(&w, &g, &m.iter().collect::<Vec<_>>(), &v.iter().collect::<Vec<_>>(), step.lr, c.beta1, c.beta2, c.weight_decay, c.eps, step.count, step.skip_if)?;
    }
    if by_hand.is_empty() || step.skipped()? {
        return Ok(());
    }
    for &i in &by_hand {
        let (w, g) = (&mut params[i], &grads[i]);
        let m = exp_avg[i].as_mut().expect("made above");
        let v = exp_avg_sq[i].as_mut().expect("made above");
        if c.weight_decay != 0.0 {
            let _ = w.f_mul_scalar_(1.0 - step.lr * c.weight_decay)?;
        }
        let _ = m.f_lerp_(g, 1.0 - c.beta1)?;
        let _ = v.f_mul_scalar_(c.beta2)?;
        let _ = v.f_addcmul_(g, &g.f_mul_scalar(1.0 - c.beta2)?)?;
        let t = step.count as f64;
        let step_size = step.lr / (1.0 - c.beta1.powf(t));
        let denom = v.f_sqrt()?.f_div_scalar((1.0 - c.beta2.powf(t)).sqrt())?.f_add_scalar(c.eps)?;
        let _ = w.f_sub_(&m.f_div(&denom)?.f_mul_scalar(step_size)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::config::{OptimizerConfig, OptimizerKind};

    fn config(weight_decay: f64) -> OptimizerConfig {
        OptimizerConfig { kind: OptimizerKind::Adamw, ..OptimizerConfig::sgd(0.0, 0.0, weight_decay) }
    }

    /// `steps` updates of `w` at rate `lr`; returns the two moments.
    fn run(config: &OptimizerConfig, lr: f64, w: &mut [Tensor], steps: usize, grad: impl Fn(usize) -> Vec<Tensor>) -> (Vec<Option<Tensor>>, Vec<Option<Tensor>>) {
        let (mut m, mut v): (Vec<Option<Tensor>>, Vec<Option<Tensor>>) = (w.iter().map(|_| None).collect(), w.iter().map(|_| None).collect());
        let all: Vec<usize> = (0..w.len()).collect();
        for k in 0..steps {
            let step = Step { lr, count: k as u64 + 1, config, skip_if: None };
            tch::no_grad(|| update(&step, w, &mut grad(k), &mut m, &mut v, &all)).unwrap();
        }
        (m, v)
    }

    /// The rule of the file's header in f64 against both kernels: the fused one (dense
    /// gradients) and the separate ones (a gradient laid out transposed).
    #[test]
    fn both_kernels_follow_the_pytorch_rule() {
        let (lr, wd, b1, b2, eps) = (0.01, 0.1, 0.9, 0.999, 1e-8);
        let w0: Vec<f64> = (0..12).map(|i| (i as f64 * 0.37).cos()).collect();
        let grad = |step: usize| -> Vec<f64> { (0..12).map(|i| ((i + 3 * step) as f64 * 0.61).sin()).collect() };
        let (mut w_ref, mut m_ref, mut v_ref) = (w0.clone(), vec![0.0; 12], vec![0.0; 12]);
        for step in 0..5 {
            let g = grad(step);
            let t = (step + 1) as f64;
            for i in 0..12 {
                w_ref[i] *= 1.0 - lr * wd;
                m_ref[i] += (1.0 - b1) * (g[i] - m_ref[i]);
                v_ref[i] = b2 * v_ref[i] + (1.0 - b2) * g[i] * g[i];
                w_ref[i] -= lr / (1.0 - b1.powf(t)) * m_ref[i] / (v_ref[i].sqrt() / (1.0 - b2.powf(t)).sqrt() + eps);
            }
        }
        let as_f32 = |v: &[f64]| Tensor::from_slice(&v.iter().map(|&x| x as f32).collect::<Vec<_>>()).view([3, 4]);
        for transposed in [false, true] {
            let mut w = vec![as_f32(&w0)];
            let layout = |g: Tensor| if transposed { g.tr().contiguous().tr() } else { g };
            assert_eq!(fusable(&w[0], &layout(as_f32(&grad(0))), &w[0]), !transposed);
            let (m, v) = run(&config(wd), lr, &mut w, 5, |k| vec![layout(as_f32(&grad(k)))]);
            let got: Vec<f32> = Vec::try_from(w[0].contiguous().view([-1])).unwrap();
            for i in 0..12 {
                assert!((got[i] as f64 - w_ref[i]).abs() < 2e-6, "transposed {transposed}: {} vs {}", got[i], w_ref[i]);
            }
            assert!(m[0].is_some() && v[0].is_some(), "both moments kept");
        }
    }

    #[test]
    fn a_tensor_split_in_pieces_steps_as_the_whole() {
        let w0: Vec<f32> = (0..10).map(|i| i as f32 * 0.1 - 0.3).collect();
        let g0: Vec<f32> = (0..10).map(|i| (i as f32 * 0.7).sin()).collect();
        let t = Tensor::from_slice::<f32>;
        let (mut split_w, mut flat_w) = (vec![t(&w0[..3]), t(&w0[3..])], vec![t(&w0)]);
        run(&config(0.01), 0.05, &mut split_w, 3, |_| vec![t(&g0[..3]), t(&g0[3..])]);
        run(&config(0.01), 0.05, &mut flat_w, 3, |_| vec![t(&g0)]);
        let diff = (Tensor::cat(&split_w, 0) - &flat_w[0]).abs().max().double_value(&[]);
        assert!(diff < 1e-7, "{diff}");
    }
}
