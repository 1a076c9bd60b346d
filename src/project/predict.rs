//! What the fit and the projection share: the bench rows they read ([`BenchRow`]) and the
//! prediction of one strategy's exchange from the cost model ([`Predictor`]), set beside a
//! measurement as a [`Residual`].

use serde::{Deserialize, Serialize};

use crate::cost::{Algorithm, CostModel, Layout, MeasuredCurve};

/// The bench.jsonl fields the fit reads.
#[derive(Clone, Debug, Deserialize)]
pub(super) struct BenchRow {
    pub(super) size: usize,
    pub(super) strategy: String,
    pub(super) ranks: usize,
    #[serde(default)]
    pub(super) nodes: usize,
    pub(super) time_us: f64,
    pub(super) wrong: u64,
    #[serde(rename = "type")]
    pub(super) dtype: String,
    #[serde(default)]
    pub(super) layout: String,
    pub(super) device: String,
    #[serde(default)]
    pub(super) memory_add_gbs: Option<f64>,
    #[serde(default)]
    pub(super) link_mbit: Option<f64>,
    /// "shared-memory" for a ring that ran through node-shared memory (not MPI messages).
    #[serde(default)]
    pub(super) ring_transport: Option<String>,
    /// Horovod-style rows: a hierarchical all-reduce (absent: flat).
    #[serde(default)]
    pub(super) hierarchical: Option<bool>,
}

impl BenchRow {
    pub(super) fn layout(&self) -> Layout {
        let nodes = self.nodes.max(1);
        Layout { ranks: self.ranks, per_node: self.ranks.div_ceil(nodes) }
    }

    /// Rows the model describes: host f32, one tensor, right results, more than one rank.
    pub(super) fn usable(&self) -> bool {
        self.device == "cpu" && self.dtype == "float" && (self.layout.is_empty() || self.layout == "single") && self.wrong == 0 && self.ranks > 1 && self.size > 0
    }

    /// The strategy as the model knows it: Horovod's hierarchical all-reduce apart from its flat one.
    pub(super) fn strategy(&self) -> &str {
        match (self.strategy.as_str(), self.hierarchical) {
            ("horovod", Some(true)) => HOROVOD_HIERARCHICAL,
            (s, _) => s,
        }
    }

    /// Whether the row's ring ran through node-shared memory rather than MPI messages.
    pub(super) fn shared_ring(&self) -> bool {
        self.ring_transport.as_deref() == Some("shared-memory")
    }
}

/// Horovod-style with `--hierarchical`, as the model and the tables name it.
pub(super) const HOROVOD_HIERARCHICAL: &str = "horovod-hierarchical";

#[derive(Clone, Serialize, Deserialize)]
pub struct Residual {
    pub strategy: String,
    pub ranks: usize,
    pub nodes: usize,
    pub link_mbit: Option<f64>,
    pub size_bytes: Option<usize>,
    pub measured_us: f64,
    pub predicted_us: f64,
    pub error_pct: f64,
}

/// The algorithm of a strategy's rows; `shared_ring` when the ring ran through node-shared
/// memory.
pub(super) fn algorithm_of(strategy: &str, servers: usize, shared_ring: bool) -> Option<Algorithm> {
    match strategy {
        "ring" if shared_ring => Some(Algorithm::SharedRing),
        "ring" => Some(Algorithm::Ring),
        "rhd" => Some(Algorithm::Rhd),
        "ps" => Some(Algorithm::Ps { servers }),
        _ => None,
    }
}

/// What predicts a strategy's exchange time: the formulas of cost.rs, MPI_Allreduce's measured
/// curve where there is one, the parameter servers' count and Horovod's cycle.
#[derive(Clone, Copy)]
pub(super) struct Predictor<'a> {
    pub(super) model: &'a CostModel,
    pub(super) mpi_allreduce: Option<&'a MeasuredCurve>,
    pub(super) servers: usize,
    pub(super) cycle_s: f64,
    /// The share of a cycle a Horovod-style exchange waits for it: half on average in a
    /// training step (the tensors come at any point of a cycle), a whole one in a bench row,
    /// whose exchange is enqueued just after the cycle that ended the previous one (so the real
    /// Horovod's 1 MiB all-reduce took 20.45 ms at a 20 ms cycle, issue 32).
    pub(super) cycle_share: f64,
}

impl Predictor<'_> {
    /// Predicted seconds of a strategy's all-reduce of `bytes`. MPI_Allreduce is its measured
    /// curve, or without one MPI's choice between the algorithms taken as the faster; Horovod
    /// is MPI_Allreduce plus its wait for the cycle (`cycle_share`), and hierarchical Horovod a
    /// reduce within the node (an all-reduce's bytes), MPI_Allreduce among the nodes' first
    /// ranks and a broadcast within the node; auto picks the fastest itself, with its ring
    /// through node-shared memory when `shared_ring`. `held_out`: a measured row being
    /// checked, which MPI's curve must not contain.
    pub(super) fn exchange(&self, strategy: &str, layout: Layout, bytes: f64, shared_ring: bool, held_out: bool) -> Option<f64> {
        let model = self.model;
        let best = |ring, layout, bytes| model.predict(model.choose(ring, layout, bytes), layout, bytes);
        let mpi = |layout: Layout, held_out| {
            let formula = |l, b| best(Algorithm::Ring, l, b);
            self.mpi_allreduce.and_then(|c| c.predict(layout, bytes, held_out, formula)).unwrap_or_else(|| formula(layout, bytes))
        };
        let hierarchical = || {
            let per_node = layout.per_node.clamp(1, layout.ranks);
            let node = Layout { ranks: per_node, per_node };
            let leaders = Layout { ranks: layout.nodes(), per_node: 1 };
            let broadcast = model.intra.alpha_s * (per_node as f64).log2().ceil() + bytes * model.intra.beta_s_per_byte;
            let within = if per_node > 1 { mpi(node, false) + broadcast } else { 0.0 };
            within + if leaders.ranks > 1 { mpi(leaders, false) } else { 0.0 }
        };
        match strategy {
            "allreduce" => Some(mpi(layout, held_out)),
            "horovod" => Some(mpi(layout, held_out) + self.cycle_s * self.cycle_share),
            HOROVOD_HIERARCHICAL => Some(hierarchical() + self.cycle_s * self.cycle_share),
            "auto" => Some(best(if shared_ring { Algorithm::SharedRing } else { Algorithm::Ring }, layout, bytes)),
            s => algorithm_of(s, self.servers, shared_ring).map(|a| model.predict(a, layout, bytes)),
        }
    }
}

pub(super) fn residual(strategy: &str, ranks: usize, nodes: usize, link_mbit: Option<f64>, size: Option<usize>, measured_us: f64, predicted_us: f64) -> Residual {
    Residual {
        strategy: strategy.into(),
        ranks,
        nodes,
        link_mbit,
        size_bytes: size,
        measured_us,
        predicted_us,
        error_pct: (predicted_us - measured_us) / measured_us * 100.0,
    }
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return 0.0;
    }
    let m = v.len() / 2;
    if v.len() % 2 == 1 { v[m] } else { (v[m - 1] + v[m]) / 2.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(extra: &str) -> BenchRow {
        let text = format!(r#"{{"size":1024,"strategy":"ring","ranks":2,"nodes":1,"time_us":10.0,"wrong":0,"type":"float","layout":"single","device":"cpu"{extra}}}"#);
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn rows_say_whether_their_ring_sent_mpi_messages() {
        // Rows recorded before the field existed went over MPI.
        assert!(!row("").shared_ring());
        assert!(!row(r#","ring_transport":"mpi""#).shared_ring());
        assert!(row(r#","ring_transport":"shared-memory""#).shared_ring());
        assert_eq!(algorithm_of("ring", 1, true), Some(Algorithm::SharedRing));
        assert_eq!(algorithm_of("rhd", 1, true), Some(Algorithm::Rhd));
    }

    #[test]
    fn hierarchical_horovod_reduces_on_the_node_then_among_the_nodes_first_ranks() {
        let horovod = |hierarchical| BenchRow { strategy: "horovod".into(), hierarchical, ..row("") };
        assert_eq!(horovod(None).strategy(), "horovod");
        assert_eq!(horovod(Some(false)).strategy(), "horovod");
        assert_eq!(horovod(Some(true)).strategy(), HOROVOD_HIERARCHICAL);
        let model = CostModel::default();
        let p = Predictor { model: &model, mpi_allreduce: None, servers: 1, cycle_s: 1e-3, cycle_share: 0.5 };
        let s = 1e7;
        let best = |l: Layout| model.predict(model.choose(Algorithm::Ring, l, s), l, s);
        let (node, leaders) = (Layout { ranks: 4, per_node: 4 }, Layout { ranks: 8, per_node: 1 });
        let broadcast = 2.0 * model.intra.alpha_s + s * model.intra.beta_s_per_byte;
        let expected = best(node) + broadcast + best(leaders) + 0.5e-3;
        let got = p.exchange(HOROVOD_HIERARCHICAL, Layout { ranks: 32, per_node: 4 }, s, false, false).unwrap();
        assert!((got - expected).abs() < 1e-12, "{got} {expected}");
        // One rank per node: only the nodes' all-reduce; one node: only the node's work.
        let one_each = p.exchange(HOROVOD_HIERARCHICAL, leaders, s, false, false).unwrap();
        assert!((one_each - best(leaders) - 0.5e-3).abs() < 1e-12);
        let one_node = p.exchange(HOROVOD_HIERARCHICAL, node, s, false, false).unwrap();
        assert!((one_node - best(node) - broadcast - 0.5e-3).abs() < 1e-12);
        // A bench row's lone all-reduce waits a whole cycle.
        let lone = Predictor { cycle_share: 1.0, ..p };
        let flat = lone.exchange("horovod", leaders, s, false, false).unwrap();
        assert!((flat - best(leaders) - 1e-3).abs() < 1e-12);
    }
}
