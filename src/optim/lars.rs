//! LARS, layer-wise adaptive rate scaling (You, Gitman and Ginsburg, "Large Batch Training of
//! Convolutional Networks", 2017), in the form of MLPerf's ResNet-50 reference (its
//! `LARSOptimizer`), per parameter tensor ("layer") with momentum buffer v (starting at 0):
//!
//! ```text
//! adapted layers:  trust = eta ||w|| / (||g|| + weight_decay ||w||)   (1 if ||w|| or ||g|| is 0)
//!                  v = momentum v + lr trust (g + weight_decay w)
//!                  w = w - v
//! exempt layers:   v = momentum v + lr g;  w = w - v
//! ```
//!
//! Exempt are the batch-norm parameters and the biases (see `exempt_from_lars`): they take
//! neither adaptation nor weight decay, as in MLPerf's reference and NVIDIA's
//! DeepLearningExamples. The rate sits inside the momentum, as in the reference: a schedule's
//! change of rate applies to new gradients, not to the velocity already gathered.
//!
//! The norms are over whole layers. A caller holding parts of layers ([`Pieces::Parts`]) has
//! each part's squared norms added per layer, summed over the ranks by its `sum_over_ranks`,
//! before any part moves; the squared norms travel in f32, as the tensors are.

use tch::{Device, Kind, Tensor};

use crate::error::Result;

use super::rule::{scalar_like, Pieces, Step};

/// How a caller holding parts of layers sums per-layer figures over the ranks.
type SumOverRanks<'a> = dyn FnMut(&mut Tensor) -> Result<()> + 'a;

pub(super) fn update(step: &Step, params: &mut [Tensor], grads: &mut [Tensor], momentum: &mut [Option<Tensor>], which: &[usize], exempt: &[bool], pieces: Pieces) -> Result<()> {
    let c = step.config;
    let is_exempt = |layer: usize| exempt.get(layer).copied().unwrap_or(false);
    let (layer_of, layers, sum_over_ranks): (Vec<usize>, Vec<usize>, Option<&mut SumOverRanks>) = match pieces {
        Pieces::Whole => ((0..params.len()).collect(), which.to_vec(), None),
        Pieces::Parts { layer_of, layers, sum_over_ranks } => (layer_of.to_vec(), layers.to_vec(), Some(sum_over_ranks)),
    };
    // Squared norms of w and g per adapted layer, in `layers` order (the same on every rank).
    let adapted: Vec<usize> = layers.iter().copied().filter(|&l| !is_exempt(l)).collect();
    let position = |layer: usize| adapted.iter().position(|&l| l == layer);
    let (kind, device) = params.first().map_or((Kind::Float, Device::Cpu), |p| (p.kind(), p.device()));
    let mut sums = Tensor::f_zeros([adapted.len() as i64, 2], (kind, device))?;
    let mine: Vec<(usize, usize)> = which.iter().filter_map(|&i| position(layer_of[i]).map(|p| (i, p))).collect();
    if !mine.is_empty() {
        let mut figures = Vec::with_capacity(mine.len() * 2);
        for &(i, _) in &mine {
            let (w, g) = (crate::raw::flat_dense_view(&params[i])?, crate::raw::flat_dense_view(&grads[i])?);
            figures.push(w.f_dot(&w)?);
            figures.push(g.f_dot(&g)?);
        }
        let figures = Tensor::f_stack(&figures, 0)?.f_view([mine.len() as i64, 2])?;
        let at = Tensor::f_from_slice(&mine.iter().map(|&(_, p)| p as i64).collect::<Vec<_>>())?.f_to_device(device)?;
        let _ = sums.f_index_add_(0, &at, &figures)?;
    }
    if let Some(sum_over_ranks) = sum_over_ranks {
        if !adapted.is_empty() {
            sum_over_ranks(&mut sums)?;
        }
    }
    // lr x trust per adapted layer, on the device (no read back to the host).
    let norms = sums.f_sqrt()?;
    let (w_norm, g_norm) = (norms.f_select(1, 0)?, norms.f_select(1, 1)?);
    let ratio = w_norm.f_mul_scalar(c.lars_eta)?.f_div(&g_norm.f_add(&w_norm.f_mul_scalar(c.weight_decay)?)?)?;
    let both_positive = w_norm.f_gt(0.0)?.f_logical_and(&g_norm.f_gt(0.0)?)?;
    let trust = ratio.f_where_self(&both_positive, &ratio.f_ones_like()?)?;
    let scaled_lr = trust.f_mul_scalar(step.lr)?;

    let Some(&first) = which.first() else { return Ok(()) };
    let weight_decay = scalar_like(c.weight_decay, &params[first])?;
    for &i in which {
        if momentum[i].is_none() {
            momentum[i] = Some(params[i].f_zeros_like()?);
        }
        let (w, g, v) = (&mut params[i], &mut grads[i], momentum[i].as_mut().expect("made above"));
        match position(layer_of[i]) {
            None => drop(g.f_mul_scalar_(step.lr)?),
            Some(p) => {
                if c.weight_decay != 0.0 {
                    let _ = g.f_addcmul_(w, &weight_decay)?;
                }
                let _ = g.f_mul_(&scaled_lr.f_select(0, p as i64)?)?;
            }
        }
        let _ = v.f_mul_scalar_(c.momentum)?;
        let _ = v.f_add_(g)?;
        let _ = w.f_sub_(v)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::config::{OptimizerConfig, OptimizerKind};

    fn config(momentum: f64, weight_decay: f64) -> OptimizerConfig {
        OptimizerConfig { kind: OptimizerKind::Lars, lars_eta: 0.02, ..OptimizerConfig::sgd(0.0, momentum, weight_decay) }
    }

    fn values(n: usize, phase: f64) -> Vec<f64> {
        (0..n).map(|i| ((i as f64 + phase) * 0.73).sin()).collect()
    }

    fn t(v: &[f64]) -> Tensor {
        Tensor::from_slice(&v.iter().map(|&x| x as f32).collect::<Vec<_>>())
    }

    /// One update of every tensor of `w`, each a layer of its own.
    fn whole_step(config: &OptimizerConfig, lr: f64, w: &mut [Tensor], g: &mut [Tensor], v: &mut [Option<Tensor>], exempt: &[bool]) {
        let all: Vec<usize> = (0..w.len()).collect();
        tch::no_grad(|| update(&Step { lr, count: 1, config, skip_if: None }, w, g, v, &all, exempt, Pieces::Whole)).unwrap();
    }

    /// The rule of the file's header in f64, for an adapted layer and an exempt one.
    #[test]
    fn follows_the_paper_rule_by_hand() {
        let (lr, m, wd, eta) = (0.5, 0.9, 0.01, 0.02);
        let (w0, b0) = (values(6, 0.0), values(3, 1.5));
        let mut params = vec![t(&w0).view([2, 3]), t(&b0)];
        let mut state = vec![None, None];
        let (mut w, mut b) = (w0.clone(), b0.clone());
        let (mut vw, mut vb) = (vec![0.0; 6], vec![0.0; 3]);
        for step in 0..4 {
            let (gw, gb) = (values(6, 2.0 + step as f64), values(3, 7.0 + step as f64));
            let norm = |x: &[f64]| x.iter().map(|a| a * a).sum::<f64>().sqrt();
            let trust = eta * norm(&w) / (norm(&gw) + wd * norm(&w));
            for i in 0..6 {
                vw[i] = m * vw[i] + lr * trust * (gw[i] + wd * w[i]);
                w[i] -= vw[i];
            }
            for i in 0..3 {
                vb[i] = m * vb[i] + lr * gb[i];
                b[i] -= vb[i];
            }
            whole_step(&config(m, wd), lr, &mut params, &mut [t(&gw).view([2, 3]), t(&gb)], &mut state, &[false, true]);
        }
        let got_w: Vec<f32> = Vec::try_from(params[0].view([-1])).unwrap();
        let got_b: Vec<f32> = Vec::try_from(&params[1]).unwrap();
        for (got, want) in got_w.iter().zip(&w).chain(got_b.iter().zip(&b)) {
            assert!((*got as f64 - want).abs() < 1e-6, "{got} vs {want}");
        }
    }

    /// Parts of a layer held apart (two "ranks") step as the whole layer once their squared
    /// norms are summed over the ranks; left unsummed, they would not.
    #[test]
    fn parts_summed_over_ranks_step_as_the_whole_layer() {
        let cfg = config(0.9, 1e-3);
        let (w0, g0) = (values(10, 0.3), values(10, 4.0));
        let parts = [(0usize, 4usize), (4, 6)];
        for summed in [true, false] {
            let mut whole = vec![t(&w0)];
            let mut whole_state = vec![None];
            let mut held: Vec<Vec<Tensor>> = parts.iter().map(|&(at, len)| vec![t(&w0[at..at + len])]).collect();
            let mut held_state: Vec<Vec<Option<Tensor>>> = vec![vec![None], vec![None]];
            for step in 0..3 {
                let g: Vec<f64> = g0.iter().map(|x| x * (step + 1) as f64).collect();
                whole_step(&cfg, 0.1, &mut whole, &mut [t(&g)], &mut whole_state, &[false]);
                // What an all-reduce would add to each rank's figures: the other rank's.
                let own: Vec<Tensor> = parts
                    .iter()
                    .zip(&held)
                    .map(|(&(at, len), w)| {
                        let gp = t(&g[at..at + len]);
                        Tensor::stack(&[w[0].dot(&w[0]), gp.dot(&gp)], 0).view([1, 2])
                    })
                    .collect();
                for (r, &(at, len)) in parts.iter().enumerate() {
                    let other = own[1 - r].shallow_clone();
                    let mut sum_over_ranks = |sums: &mut Tensor| -> Result<()> {
                        if summed {
                            let _ = sums.f_add_(&other)?;
                        }
                        Ok(())
                    };
                    let pieces = Pieces::Parts { layer_of: &[0], layers: &[0], sum_over_ranks: &mut sum_over_ranks };
                    let step = Step { lr: 0.1, count: 1, config: &cfg, skip_if: None };
                    tch::no_grad(|| update(&step, &mut held[r], &mut [t(&g[at..at + len])], &mut held_state[r], &[0], &[false], pieces)).unwrap();
                }
            }
            let joined = Tensor::cat(&[&held[0][0], &held[1][0]], 0);
            let diff = (joined - &whole[0]).abs().max().double_value(&[]);
            assert_eq!(diff < 1e-6, summed, "summed {summed}: {diff}");
        }
    }

    #[test]
    fn a_zero_layer_takes_the_plain_rate() {
        // ||w|| = 0: trust 1, so the step is plain SGD.
        let mut w = vec![Tensor::zeros([3], (Kind::Float, Device::Cpu))];
        whole_step(&config(0.0, 0.0), 0.1, &mut w, &mut [t(&[1.0, -2.0, 0.5])], &mut [None], &[false]);
        let got: Vec<f32> = Vec::try_from(&w[0]).unwrap();
        assert_eq!(got, vec![-0.1, 0.2, -0.05]);
    }
}
