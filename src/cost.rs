//! The alpha-beta-gamma cost model of the all-reduce algorithms (Thakur, Rabenseifner and Gropp,
//! "Optimization of Collective Communication Operations in MPICH", 2005; Patarasuk and Yuan,
//! "Bandwidth optimal all-reduce algorithms for clusters of workstations", 2009).
//!
//! A message of b bytes over a link takes alpha + b beta; adding b bytes into a buffer takes
//! b gamma. A link is within a node or between nodes; a step that crosses nodes anywhere takes
//! the between-nodes cost (the slowest link sets the pace of a step every rank takes together).
//! `auto` asks this model which algorithm suits each bucket, as NCCL's tuner does.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::exchange::rhd::{Extra, RhdSchedule};

/// Costs of one kind of link, in seconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkCost {
    /// Latency of one message.
    pub alpha_s: f64,
    /// Time per byte on the wire.
    pub beta_s_per_byte: f64,
    /// Time per byte added into a buffer.
    pub gamma_s_per_byte: f64,
}

/// Link costs within a node and between nodes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    pub intra: LinkCost,
    pub inter: LinkCost,
}

impl Default for CostModel {
    /// Shared memory on one node (Open MPI's vader: ~2 us a message, ~5 GB/s copies) and a
    /// 10 Gbit/s TCP network (~30 us, 1.25 GB/s); additions at ~5 GB/s. Measured figures replace
    /// these through `--cost-model FILE` (see `hpc-train model fit`).
    fn default() -> Self {
        let gamma = 1.0 / 5e9;
        CostModel {
            intra: LinkCost { alpha_s: 2e-6, beta_s_per_byte: 1.0 / 5e9, gamma_s_per_byte: gamma },
            inter: LinkCost { alpha_s: 30e-6, beta_s_per_byte: 1.0 / 1.25e9, gamma_s_per_byte: gamma },
        }
    }
}

/// Where the ranks are: `ranks` in all, `per_node` on each node (node-major numbering).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub ranks: usize,
    pub per_node: usize,
}

impl Layout {
    pub fn nodes(&self) -> usize {
        self.ranks.div_ceil(self.per_node.max(1))
    }

    fn same_node(&self, a: usize, b: usize) -> bool {
        a / self.per_node.max(1) == b / self.per_node.max(1)
    }
}

/// The all-reduce algorithms the model knows in closed form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    Ring,
    Rhd,
}

impl CostModel {
    fn link(&self, crosses_nodes: bool) -> &LinkCost {
        if crosses_nodes { &self.inter } else { &self.intra }
    }

    /// Predicted seconds for an all-reduce of `bytes` on `layout`.
    pub fn predict(&self, algorithm: Algorithm, layout: Layout, bytes: f64) -> f64 {
        match algorithm {
            Algorithm::Ring => self.ring(layout, bytes),
            Algorithm::Rhd => self.rhd(layout, bytes),
        }
    }

    /// 2(n-1) steps of S/n bytes each, and (n-1) S/n bytes added; the node-aware ring crosses
    /// the network at two links per node, which then set every step's pace.
    pub fn ring(&self, layout: Layout, bytes: f64) -> f64 {
        let n = layout.ranks as f64;
        if layout.ranks <= 1 {
            return 0.0;
        }
        let link = self.link(layout.nodes() > 1);
        2.0 * (n - 1.0) * (link.alpha_s + bytes / n * link.beta_s_per_byte) + (n - 1.0) * bytes / n * link.gamma_s_per_byte
    }

    /// Recursive halving then doubling among the largest power of two of ranks (each step over
    /// the link between the partners, the halving adding what it receives), plus the whole
    /// buffer handed in and out by the extra ranks.
    pub fn rhd(&self, layout: Layout, bytes: f64) -> f64 {
        if layout.ranks <= 1 {
            return 0.0;
        }
        // Every member of the power-of-two group takes every step; rank 1 is one of them in every
        // layout (it absorbs rank 0 when the count is not a power of two), so it tells for all.
        let probe = if layout.ranks.is_power_of_two() { 0 } else { 1 };
        let schedule = RhdSchedule::new(1 << 20, layout.ranks, probe);
        let fraction = |len: usize| len as f64 / (1 << 20) as f64;
        let mut t = 0.0;
        for step in &schedule.halving {
            // Partners of a step are as far apart for every member: one rank tells for all.
            let link = self.link(!layout.same_node(probe, step.partner));
            let part = fraction(step.recv.len()) * bytes;
            t += 2.0 * (link.alpha_s + part * link.beta_s_per_byte) + part * link.gamma_s_per_byte;
        }
        if let Extra::Absorbs { partner } = schedule.extra {
            let link = self.link(!layout.same_node(probe, partner));
            t += 2.0 * (link.alpha_s + bytes * link.beta_s_per_byte) + bytes * link.gamma_s_per_byte;
        }
        t
    }

    /// The faster of ring and rhd for `bytes` on `layout`.
    pub fn choose(&self, layout: Layout, bytes: f64) -> Algorithm {
        let (ring, rhd) = (self.predict(Algorithm::Ring, layout, bytes), self.predict(Algorithm::Rhd, layout, bytes));
        if rhd < ring { Algorithm::Rhd } else { Algorithm::Ring }
    }

    /// `--cost-model FILE`, or the defaults without one.
    pub fn from_option(path: Option<&std::path::Path>) -> Result<CostModel> {
        path.map_or(Ok(CostModel::default()), CostModel::load)
    }

    /// Reads a model file written by `hpc-train model fit` (its `model` field), or a bare model.
    pub fn load(path: &std::path::Path) -> Result<CostModel> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::usage(format!("{}: not JSON: {e}", path.display())))?;
        let model = value.get("model").cloned().unwrap_or(value);
        serde_json::from_value(model).map_err(|e| Error::usage(format!("{}: not a cost model ({e})", path.display())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_link(alpha: f64, beta: f64, gamma: f64) -> CostModel {
        let l = LinkCost { alpha_s: alpha, beta_s_per_byte: beta, gamma_s_per_byte: gamma };
        CostModel { intra: l, inter: l }
    }

    #[test]
    fn ring_and_rhd_follow_the_closed_forms() {
        let m = one_link(1e-5, 1e-9, 5e-10);
        let (n, s) = (8.0, 1e6);
        let layout = Layout { ranks: 8, per_node: 8 };
        let ring = 2.0 * (n - 1.0) * (1e-5 + s / n * 1e-9) + (n - 1.0) * s / n * 5e-10;
        assert!((m.ring(layout, s) - ring).abs() < 1e-12);
        // Power of two: 2 log2(p) alpha + 2 (p-1)/p S beta + (p-1)/p S gamma.
        let rhd = 2.0 * 3.0 * 1e-5 + 2.0 * 7.0 / 8.0 * s * 1e-9 + 7.0 / 8.0 * s * 5e-10;
        assert!((m.rhd(layout, s) - rhd).abs() < 1e-9, "{} vs {rhd}", m.rhd(layout, s));
    }

    #[test]
    fn small_buffers_go_to_rhd_and_large_ones_to_the_ring_on_the_network() {
        let m = CostModel::default();
        let layout = Layout { ranks: 64, per_node: 8 };
        assert_eq!(m.choose(layout, 4096.0), Algorithm::Rhd);
        assert_eq!(m.choose(Layout { ranks: 6, per_node: 6 }, 1e8), Algorithm::Ring, "the extra ranks' whole-buffer hand-over costs rhd");
    }
}
