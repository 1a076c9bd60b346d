//! `hpc-train project --plan`: for a transformer, a cluster (its cost model), a global batch
//! and a memory limit per GPU, every 3D layout (D data-parallel replicas x P pipeline stages x
//! T tensor-parallel ranks, with a micro-batch size b) that fits, each with its projected step
//! split into compute, pipeline bubble, tensor-parallel, pipeline and data-parallel
//! communication, the fastest first.
//!
//! The model is Narayanan et al. (SC 2021, "Efficient large-scale language model training on
//! GPU clusters using Megatron-LM"), sections 2-3, with the exchanges priced by the cluster's
//! cost model (cost.rs) instead of assumed:
//! - FLOPs per step: passes x B s l (8h^2 + 4hm + 4sh) + 6 B s h V, with 3 passes (forward,
//!   backward) or 4 with activation recomputation (their equation 3 for m = 4h);
//! - compute: the FLOPs over N GPUs at the rate the GPU sustains on the model's layers;
//!   bubble: (P - 1) / m of it with m micro-batches per pipeline under 1F1B, (P - 1) / 3m under
//!   ZB-H1 and (P - 1) / 6m under ZB-V (plan/pipeline/schedule.rs's idle_per_busy, `--schedule`);
//! - tensor parallelism: per layer and micro-batch, 2 all-reduces in forward and 2 in backward
//!   (2 more when the forward is recomputed) of b s h half-precision values over the T ranks;
//! - pipelines: per micro-batch an activation forward and its gradient back, b s h / T values
//!   each (the scatter/gather of their section 4.1), over the m + P - 1 slots of the schedule;
//! - data parallelism: the rank's gradients (fp32) all-reduced by the ring over D ranks after
//!   backward (not overlapped);
//! - memory: 16 bytes per parameter (mixed-precision Adam: fp16 weights and gradients, fp32
//!   master weights and two moments) of the largest stage's part, and the activations of the
//!   first stage (P micro-batches in flight under 1F1B) as Korthikanti et al. (2022) count them:
//!   s b h (10 + 24/T + 5 a s / (h T)) bytes per layer, or with recomputation the layer inputs
//!   (2 s b h bytes) and one layer's working set; recomputation only where the layout needs it.
//!
//! Pure arithmetic over the cost model; unit-tested below.

use serde::Serialize;

use crate::cost::{Algorithm, CostModel, Layout};
use crate::plan::pipeline::{idle_per_busy, ScheduleKind, Shape};

/// A transformer's shape, as the FLOP and memory formulas read it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Transformer {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    /// The MLP's width (4 hidden in GPT and ViT).
    pub mlp: usize,
    /// Sequence length, or a ViT's tokens (patches and the class token).
    pub tokens: usize,
    /// Vocabulary (its embedding and logits), or a ViT's classes.
    pub vocab: usize,
}

impl Transformer {
    /// GPT-3 175B (Brown et al. 2020, table 2.1).
    pub const GPT3_175B: Transformer = Transformer { layers: 96, hidden: 12288, heads: 96, mlp: 4 * 12288, tokens: 2048, vocab: 51200 };
    /// Narayanan et al.'s 145.6-billion-parameter row of table 1 (their 175B-class run).
    pub const MEGATRON_145B: Transformer = Transformer { layers: 80, hidden: 12288, heads: 96, mlp: 4 * 12288, tokens: 2048, vocab: 51200 };
    /// ViT-H/14 at 224x224 (Dosovitskiy et al. 2021): 256 patches and the class token.
    pub const VIT_H14: Transformer = Transformer { layers: 32, hidden: 1280, heads: 16, mlp: 5120, tokens: 257, vocab: 1000 };
    /// ViT-B/16 at 224x224, hpc-train's vit-b16.
    pub const VIT_B16: Transformer = Transformer { layers: 12, hidden: 768, heads: 12, mlp: 3072, tokens: 197, vocab: 1000 };

    /// Parameters of one layer: the attention's four projections and the MLP, with biases and
    /// two layer norms.
    pub fn layer_parameters(&self) -> f64 {
        let (h, m) = (self.hidden as f64, self.mlp as f64);
        4.0 * h * h + 2.0 * h * m + 9.0 * h + m
    }

    /// Parameters outside the layers: the embedding (tied with the logits) and positions.
    pub fn embedding_parameters(&self) -> f64 {
        // In f64: the sizes are the user's, and their product may not fit a usize.
        (self.vocab as f64 + self.tokens as f64) * self.hidden as f64
    }

    pub fn parameters(&self) -> f64 {
        self.layers as f64 * self.layer_parameters() + self.embedding_parameters()
    }

    /// FLOPs of one training step of `batch` sequences, with or without recomputing forwards.
    pub fn step_flops(&self, batch: usize, recompute: bool) -> f64 {
        let (b, s, l, h, m, v) = (batch as f64, self.tokens as f64, self.layers as f64, self.hidden as f64, self.mlp as f64, self.vocab as f64);
        let passes = if recompute { 4.0 } else { 3.0 };
        passes * b * s * l * (8.0 * h * h + 4.0 * h * m + 4.0 * s * h) + 6.0 * b * s * h * v
    }
}

/// The cluster and the run the layouts are for.
#[derive(Clone, Copy, Debug)]
pub struct Setting<'a> {
    pub model: &'a CostModel,
    pub gpus: usize,
    pub per_node: usize,
    /// Sequences (or images) per step, over all replicas.
    pub global_batch: usize,
    pub memory_bytes: f64,
    /// FLOP/s one GPU sustains on the model's layers.
    pub flops_per_gpu: f64,
    /// The pipelines' schedule (gpipe, 1f1b, zb-h1 or zb-v).
    pub schedule: ScheduleKind,
}

/// One layout and its projected step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Planned {
    pub data: usize,
    pub pipeline: usize,
    pub tensor: usize,
    /// Sequences per micro-batch, and micro-batches per pipeline and step.
    pub micro_batch: usize,
    pub micro_batches: usize,
    pub recompute: bool,
    /// The first stage's model state and activations per GPU.
    pub state_bytes: f64,
    pub activation_bytes: f64,
    pub compute_s: f64,
    pub bubble_s: f64,
    pub tensor_s: f64,
    pub pipeline_s: f64,
    pub data_s: f64,
    pub step_s: f64,
    /// What the step achieves per GPU (the paper's metric: the step's FLOPs over N GPUs and the step time).
    pub achieved_flops_per_gpu: f64,
}

impl Planned {
    pub fn memory_bytes(&self) -> f64 {
        self.state_bytes + self.activation_bytes
    }
}

/// Every layout of `shape` on `setting` that fits its memory, fastest first. T divides the
/// heads and P the layers (equal stages); b runs over the powers of two that divide a
/// replica's batch.
pub fn plan(shape: &Transformer, setting: &Setting) -> Vec<Planned> {
    let mut out = Vec::new();
    let n = setting.gpus;
    for tensor in divisors(n).into_iter().filter(|t| shape.heads.is_multiple_of(*t) && shape.mlp.is_multiple_of(*t)) {
        for pipeline in divisors(n / tensor).into_iter().filter(|p| shape.layers.is_multiple_of(*p)) {
            let data = n / (tensor * pipeline);
            if !setting.global_batch.is_multiple_of(data) {
                continue;
            }
            let replica_batch = setting.global_batch / data;
            // The powers of two up to the replica's batch; the doubling stops where it would
            // overflow (a batch of 2^64 - 1 would otherwise wrap it to 0).
            let mut micro_batch = Some(1usize);
            while let Some(b) = micro_batch.filter(|&b| b <= replica_batch) {
                if replica_batch.is_multiple_of(b) {
                    // A split backward keeps the forward's graph until its W: no recomputation.
                    let recompute: &[bool] = if setting.schedule.splits_backward() { &[false] } else { &[false, true] };
                    let fits = recompute.iter().map(|&recompute| evaluate(shape, setting, data, pipeline, tensor, b, recompute)).find(|p| p.memory_bytes() <= setting.memory_bytes);
                    out.extend(fits);
                }
                micro_batch = b.checked_mul(2);
            }
        }
    }
    out.sort_by(|a, b| a.step_s.total_cmp(&b.step_s));
    out
}

/// One layout's memory and step.
pub fn evaluate(shape: &Transformer, setting: &Setting, data: usize, pipeline: usize, tensor: usize, micro_batch: usize, recompute: bool) -> Planned {
    let (s, h, a) = (shape.tokens as f64, shape.hidden as f64, shape.heads as f64);
    let (t, p, b) = (tensor as f64, pipeline as f64, micro_batch as f64);
    let micro_batches = setting.global_batch / data / micro_batch;
    let m = micro_batches as f64;
    let layers_per_stage = (shape.layers / pipeline) as f64;

    // Memory of the first stage: its layers' part and the embedding's, 16 bytes each.
    let stage_parameters = (layers_per_stage * shape.layer_parameters() + shape.embedding_parameters()) / t;
    let state_bytes = 16.0 * stage_parameters;
    let layer_activations = s * b * h * (10.0 + 24.0 / t + 5.0 * a * s / (h * t));
    let in_flight = p.min(m);
    let activation_bytes = if recompute {
        in_flight * layers_per_stage * 2.0 * s * b * h + layer_activations
    } else {
        in_flight * layers_per_stage * layer_activations
    };

    // Time.
    let flops = shape.step_flops(setting.global_batch, recompute);
    let compute_s = flops / (setting.gpus as f64 * setting.flops_per_gpu);
    let bubble_s = match Shape::new(setting.schedule, pipeline, micro_batches, 1) {
        Ok(schedule) if pipeline > 1 => idle_per_busy(&schedule) * compute_s,
        _ => 0.0,
    };
    let model = setting.model;
    let within_node = |ranks: usize| Layout { ranks, per_node: setting.per_node.min(ranks).max(1) };
    let activation_bytes_fp16 = 2.0 * s * b * h;
    let tensor_s = if tensor > 1 {
        let per_layer = if recompute { 6.0 } else { 4.0 };
        m * layers_per_stage * per_layer * model.predict(Algorithm::Ring, within_node(tensor), activation_bytes_fp16)
    } else {
        0.0
    };
    let pipeline_s = if pipeline > 1 {
        // Neighbouring stages share a node when a node holds whole pipelines of groups.
        let link = if setting.per_node.is_multiple_of(tensor * pipeline) { model.intra } else { model.inter };
        let message = link.alpha_s + activation_bytes_fp16 / t * link.beta_s_per_byte;
        // ZB-V's chunks go down the stages and back up: twice the crossings.
        let crossings = if setting.schedule == ScheduleKind::ZbV { 2.0 } else { 1.0 };
        (m + p - 1.0) * 2.0 * message * crossings
    } else {
        0.0
    };
    let data_s = if data > 1 {
        let replicas = Layout { ranks: data, per_node: (setting.per_node / (tensor * pipeline)).max(1) };
        model.predict(Algorithm::Ring, replicas, 4.0 * stage_parameters)
    } else {
        0.0
    };
    let step_s = compute_s + bubble_s + tensor_s + pipeline_s + data_s;
    Planned {
        data,
        pipeline,
        tensor,
        micro_batch,
        micro_batches,
        recompute,
        state_bytes,
        activation_bytes,
        compute_s,
        bubble_s,
        tensor_s,
        pipeline_s,
        data_s,
        step_s,
        achieved_flops_per_gpu: flops / (setting.gpus as f64 * step_s),
    }
}

/// The divisors of `n` in increasing order, by trial division up to its square root (each
/// divisor d below it pairs with n / d above it): 2^32 steps at most, where walking 1..=n took
/// 22 s at n = 2^32 and for ever at 2^64.
fn divisors(n: usize) -> Vec<usize> {
    let (mut low, mut high) = (Vec::new(), Vec::new());
    let mut d = 1usize;
    // d <= n / d is d * d <= n without the overflow.
    while d <= n / d {
        if n.is_multiple_of(d) {
            low.push(d);
            if d != n / d {
                high.push(n / d);
            }
        }
        d += 1;
    }
    low.extend(high.into_iter().rev());
    low
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::LinkCost;

    fn a100_cluster() -> CostModel {
        CostModel {
            intra: LinkCost { alpha_s: 8e-6, beta_s_per_byte: 1.0 / 230e9 },
            inter: LinkCost { alpha_s: 5e-6, beta_s_per_byte: 1.0 / 23e9 },
            gamma_s_per_byte: 1.0 / 518e9,
            nics_per_node: Some(8),
            shared: None,
            fabric_s_per_byte: None,
        }
    }

    #[test]
    fn the_counts_are_the_published_ones() {
        // GPT-3: 175 billion parameters; Narayanan et al.'s row: 145.6 billion.
        assert!((Transformer::GPT3_175B.parameters() / 1e9 - 175.0).abs() < 1.0, "{}", Transformer::GPT3_175B.parameters());
        assert!((Transformer::MEGATRON_145B.parameters() / 1e9 - 145.6).abs() < 0.5, "{}", Transformer::MEGATRON_145B.parameters());
        // vit_b_16: 86.6 million with its 1000-class head (here the embedding stands for it).
        assert!((Transformer::VIT_B16.parameters() / 1e6 - 86.6).abs() < 1.0, "{}", Transformer::VIT_B16.parameters());
        // Equation 3 of the paper (with recomputation): 96 B s l h^2 (1 + s/6h + V/16lh).
        let g = Transformer::MEGATRON_145B;
        let (b, s, l, h, v) = (2304.0, 2048.0, 80.0, 12288.0, 51200.0);
        let paper = 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h));
        assert!((g.step_flops(2304, true) / paper - 1.0).abs() < 1e-12);
    }

    #[test]
    fn the_layouts_fit_and_divide() {
        let model = a100_cluster();
        let setting = Setting { model: &model, gpus: 64, per_node: 8, global_batch: 512, memory_bytes: 80e9, flops_per_gpu: 156e12, schedule: ScheduleKind::OneFOneB };
        let shape = Transformer { layers: 30, hidden: 3072, heads: 32, mlp: 4 * 3072, tokens: 2048, vocab: 51200 };
        let all = plan(&shape, &setting);
        assert!(!all.is_empty());
        for p in &all {
            assert_eq!(p.data * p.pipeline * p.tensor, 64);
            assert_eq!(shape.heads % p.tensor, 0);
            assert_eq!(shape.layers % p.pipeline, 0);
            assert_eq!(p.data * p.micro_batch * p.micro_batches, 512);
            assert!(p.memory_bytes() <= 80e9);
            let parts = p.compute_s + p.bubble_s + p.tensor_s + p.pipeline_s + p.data_s;
            assert!((p.step_s - parts).abs() < 1e-12);
        }
        assert!(all.windows(2).all(|w| w[0].step_s <= w[1].step_s), "fastest first");
        // A bubble only with pipelines, a tensor-parallel exchange only with groups, a
        // data-parallel one only with replicas.
        for p in &all {
            assert_eq!(p.bubble_s > 0.0, p.pipeline > 1, "{p:?}");
            assert_eq!(p.tensor_s > 0.0, p.tensor > 1, "{p:?}");
            assert_eq!(p.data_s > 0.0, p.data > 1, "{p:?}");
        }
        // Less memory leaves fewer layouts, some of them recomputing where they did not.
        let tight = plan(&shape, &Setting { memory_bytes: 30e9, ..setting });
        let key = |p: &Planned| (p.data, p.pipeline, p.tensor, p.micro_batch);
        assert!(tight.len() < all.len() && tight.iter().all(|p| p.memory_bytes() <= 30e9 && all.iter().any(|q| key(q) == key(p))));
        assert!(tight.iter().any(|p| p.recompute && all.iter().any(|q| key(q) == key(p) && !q.recompute)));
    }

    #[test]
    fn divisors_come_in_order_without_walking_to_n() {
        assert_eq!(divisors(1), vec![1]);
        assert_eq!(divisors(12), vec![1, 2, 3, 4, 6, 12]);
        assert_eq!(divisors(36), vec![1, 2, 3, 4, 6, 9, 12, 18, 36]);
        assert_eq!(divisors(97), vec![1, 97]);
        for n in 1..500usize {
            assert_eq!(divisors(n), (1..=n).filter(|d| n % d == 0).collect::<Vec<_>>(), "{n}");
        }
        // 2^40 would take minutes walked one by one; 2^20 steps here.
        assert_eq!(divisors(1 << 40), (0..=40).map(|k| 1usize << k).collect::<Vec<_>>());
    }

    #[test]
    fn a_batch_near_the_largest_usize_does_not_wrap_the_micro_batch() {
        // The doubling of the micro-batch wrapped to 0 and took a remainder by it.
        let model = a100_cluster();
        let setting = Setting { model: &model, gpus: 4, per_node: 8, global_batch: usize::MAX, memory_bytes: 1e30, flops_per_gpu: 156e12, schedule: ScheduleKind::OneFOneB };
        let shape = Transformer { layers: 2, hidden: 64, heads: 2, mlp: 256, tokens: 16, vocab: 100 };
        let all = plan(&shape, &setting);
        // 2^64 - 1 is odd: only micro-batches of 1, on one replica (D = 1: T = P = 2).
        assert!(!all.is_empty() && all.iter().all(|p| p.micro_batch == 1 && p.data == 1), "{all:?}");
        let wide = Transformer { hidden: usize::MAX / 2, vocab: usize::MAX / 2, ..shape };
        assert!(wide.embedding_parameters() > 1e37);
    }

    /// The zero-bubble schedules price a third (ZB-H1) and a sixth (ZB-V) of 1F1B's bubble, never
    /// recompute, and ZB-V pays twice the pipeline's messages.
    #[test]
    fn zero_bubble_schedules_price_their_bubble() {
        let model = a100_cluster();
        let shape = Transformer::GPT3_175B;
        let setting = Setting { model: &model, gpus: 64, per_node: 8, global_batch: 512, memory_bytes: 1e15, flops_per_gpu: 156e12, schedule: ScheduleKind::OneFOneB };
        let one = evaluate(&shape, &setting, 2, 4, 8, 1, false);
        let h1 = evaluate(&shape, &Setting { schedule: ScheduleKind::ZbH1, ..setting }, 2, 4, 8, 1, false);
        let v = evaluate(&shape, &Setting { schedule: ScheduleKind::ZbV, ..setting }, 2, 4, 8, 1, false);
        assert!((h1.bubble_s * 3.0 - one.bubble_s).abs() < 1e-12 * one.bubble_s && (v.bubble_s * 6.0 - one.bubble_s).abs() < 1e-12 * one.bubble_s);
        assert!((v.pipeline_s - 2.0 * one.pipeline_s).abs() < 1e-12 * one.pipeline_s && h1.pipeline_s == one.pipeline_s);
        let tight = Setting { memory_bytes: 80e9, schedule: ScheduleKind::ZbH1, ..setting };
        assert!(plan(&shape, &tight).iter().all(|p| !p.recompute), "a split backward never recomputes");
    }

    #[test]
    fn the_bubble_and_the_exchanges_follow_the_layout() {
        let model = a100_cluster();
        let setting = Setting { model: &model, gpus: 64, per_node: 8, global_batch: 512, memory_bytes: 1e15, flops_per_gpu: 156e12, schedule: ScheduleKind::OneFOneB };
        let shape = Transformer::GPT3_175B;
        let p = evaluate(&shape, &setting, 2, 4, 8, 1, true);
        assert_eq!(p.micro_batches, 256);
        assert!((p.bubble_s / p.compute_s - 3.0 / 256.0).abs() < 1e-12);
        // A tensor-parallel group across nodes pays the network: T = 16 on nodes of 8.
        let within = evaluate(&shape, &setting, 1, 8, 8, 1, true);
        let across = evaluate(&shape, &setting, 1, 4, 16, 1, true);
        let per_layer = |p: &Planned| p.tensor_s / (p.micro_batches * shape.layers / p.pipeline) as f64;
        assert!(per_layer(&across) > 4.0 * per_layer(&within), "{} against {}", per_layer(&across), per_layer(&within));
        // GPT-3 does not fit one 80 GB GPU (16 bytes x 175e9 alone is 2.8 TB).
        let small = Setting { memory_bytes: 80e9, gpus: 1, ..setting };
        assert!(plan(&shape, &small).is_empty());
        // Recomputation costs a third more compute, and is chosen only where needed.
        let full = evaluate(&shape, &setting, 1, 8, 8, 1, false);
        assert!((within.compute_s / full.compute_s - 4.0 / 3.0).abs() < 0.01);
    }
}
