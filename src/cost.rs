//! The alpha-beta-gamma cost model of the exchange algorithms (Thakur, Rabenseifner and Gropp,
//! "Optimization of Collective Communication Operations in MPICH", 2005; Patarasuk and Yuan,
//! "Bandwidth optimal all-reduce algorithms for clusters of workstations", 2009).
//!
//! A message of b bytes over a link takes alpha + b beta; adding b bytes into a buffer takes
//! b gamma. A link is within a node or between nodes; a step that crosses nodes anywhere takes
//! the between-nodes cost (the slowest link sets the pace of a step every rank takes together).
//!
//! Every algorithm's time is written as coefficients of the unknowns (alpha and beta within a
//! node, alpha and beta between nodes, gamma, and alpha and beta of the ring through node-shared
//! memory), so that one formula serves both the prediction (`auto`, `hpc-train project`) and the
//! least-squares fit (`hpc-train model fit`). One more coefficient, the bytes all ranks together
//! send across the network, meets the fabric's capacity where the model has one: the network
//! part of a step is the slower of its busiest link and the whole fabric's load.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::plan::rhd::{Extra, RhdSchedule};

/// Costs of one kind of link, in seconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkCost {
    /// Latency of one message.
    pub alpha_s: f64,
    /// Time per byte on the wire.
    pub beta_s_per_byte: f64,
}

/// Link costs within a node and between nodes, and the cost of adding.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    pub intra: LinkCost,
    pub inter: LinkCost,
    /// Time per byte added into a buffer.
    pub gamma_s_per_byte: f64,
    /// Network links (NICs) per node: the ranks of a node that cross the network in the same
    /// step share them. None: a link per rank (rail-optimized GPU nodes; models fitted before
    /// this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nics_per_node: Option<usize>,
    /// The ring through node-shared memory (`--ring-transport`, one node): alpha is a step's
    /// wait for the neighbour's progress counter, beta the time per byte of reading the
    /// neighbour's part. None (models fitted without such rows): that ring is costed as the
    /// ring over MPI messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared: Option<LinkCost>,
    /// Time per byte of the network fabric as a whole: what all nodes together can move at
    /// once (an oversubscribed fat tree's core, a switch's backplane, or, for nodes that are
    /// namespaces of one host, that host's cores running every node's network stack). None: a
    /// non-blocking fabric, every link at its own rate whatever the others do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric_s_per_byte: Option<f64>,
}

impl Default for CostModel {
    /// Shared memory on one node (Open MPI's vader: ~2 us a message, ~5 GB/s copies) and a
    /// 10 Gbit/s TCP network (~30 us, 1.25 GB/s); additions at ~5 GB/s. Measured figures replace
    /// these through `--cost-model FILE` (see `hpc-train model fit`).
    fn default() -> Self {
        CostModel {
            intra: LinkCost { alpha_s: 2e-6, beta_s_per_byte: 1.0 / 5e9 },
            inter: LinkCost { alpha_s: 30e-6, beta_s_per_byte: 1.0 / 1.25e9 },
            gamma_s_per_byte: 1.0 / 5e9,
            nics_per_node: None,
            shared: None,
            fabric_s_per_byte: None,
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

/// The exchange algorithms the model knows in closed form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    Ring,
    /// The ring on one node through node-shared memory: the ring's steps and bytes, at the
    /// shared-memory costs.
    SharedRing,
    /// Recursive halving (reduce-scatter) and doubling (all-gather): Rabenseifner's.
    Rhd,
    /// Recursive doubling: every step swaps and adds the whole buffer (short messages).
    RecursiveDoubling,
    /// Parameter servers: `servers` dedicated ranks serving all the others.
    Ps { servers: usize },
}

/// Coefficients of (alpha intra, beta intra, alpha inter, beta inter, gamma, alpha shared, beta
/// shared), and last the bytes sent across the network by all ranks together (the fabric's
/// load, see [`CostModel::fabric_s_per_byte`]).
pub type Coefficients = [f64; 8];

/// Index of the fabric's load in [`Coefficients`].
pub const FABRIC_LOAD: usize = 7;

fn add_link(c: &mut Coefficients, crosses: bool, messages: f64, bytes: f64) {
    let at = if crosses { 2 } else { 0 };
    c[at] += messages;
    c[at + 1] += bytes;
}

/// How many times slower each flow is when `flows` ranks of a node cross the network at once
/// over its `nics` links (None: a link per rank).
fn sharing(flows: usize, nics: Option<usize>) -> f64 {
    nics.map_or(1.0, |k| flows.div_ceil(k.max(1)).max(1) as f64)
}

/// The time of `algorithm` for `bytes` on `layout`, as coefficients of the unknowns, with
/// `nics` network links per node (see [`CostModel::nics_per_node`]).
pub fn coefficients(algorithm: Algorithm, layout: Layout, bytes: f64, nics: Option<usize>) -> Coefficients {
    let mut c = [0.0; 8];
    let n = layout.ranks;
    if n <= 1 {
        return c;
    }
    match algorithm {
        Algorithm::SharedRing if layout.nodes() == 1 => {
            let nf = n as f64;
            c[5] += 2.0 * (nf - 1.0);
            c[6] += 2.0 * (nf - 1.0) / nf * bytes;
            c[4] += (nf - 1.0) / nf * bytes;
        }
        // Across nodes the ring never runs through shared memory.
        Algorithm::SharedRing => return coefficients(Algorithm::Ring, layout, bytes, nics),
        Algorithm::Ring => {
            // 2(n-1) steps of S/n bytes, (n-1) S/n added; the node-aware ring crosses the
            // network at two links per node (one flow each way), which then set every step's
            // pace.
            let nf = n as f64;
            let per_link = 2.0 * (nf - 1.0) / nf * bytes;
            add_link(&mut c, layout.nodes() > 1, 2.0 * (nf - 1.0), per_link);
            c[4] += (nf - 1.0) / nf * bytes;
            if layout.nodes() > 1 {
                c[FABRIC_LOAD] += layout.nodes() as f64 * per_link;
            }
        }
        Algorithm::Rhd | Algorithm::RecursiveDoubling => {
            // Every member of the power-of-two group takes every step; rank 1 is one of them in
            // every layout (it absorbs rank 0 when the count is not a power of two). Both walk
            // the same partners: rhd swaps a shrinking part each way (the halving step and its
            // mirror in the doubling), recursive doubling the whole buffer once per partner.
            // A step that crosses nodes sends from every rank of a node at once (node-major
            // numbering: the partner of each is on the other node), sharing the node's links.
            let probe = if n.is_power_of_two() { 0 } else { 1 };
            let unit = 1usize << 20;
            let schedule = RhdSchedule::new(unit, n, probe);
            let group = 1usize << (usize::BITS - 1 - n.leading_zeros()); // the power-of-two group
            let crossing_share = sharing(layout.per_node.min(n), nics);
            for step in &schedule.halving {
                let crosses = !layout.same_node(probe, step.partner);
                let share = if crosses { crossing_share } else { 1.0 };
                let (messages, part) = match algorithm {
                    Algorithm::Rhd => (2.0, step.recv.len() as f64 / unit as f64 * bytes),
                    _ => (1.0, bytes),
                };
                add_link(&mut c, crosses, messages, messages * part * share);
                c[4] += part;
                if crosses {
                    c[FABRIC_LOAD] += group as f64 * messages * part;
                }
            }
            if let Extra::Absorbs { partner } = schedule.extra {
                let crosses = !layout.same_node(probe, partner);
                add_link(&mut c, crosses, 2.0, 2.0 * bytes);
                c[4] += bytes;
                if crosses {
                    c[FABRIC_LOAD] += (n - group) as f64 * 2.0 * bytes;
                }
            }
        }
        Algorithm::Ps { servers } => {
            // The servers are the last K ranks; each takes a share S / K from every worker,
            // sums it, and sends as much back. Shares from workers on the server's own node stay
            // on the node; the others cross its network links, which the node's servers share.
            // The server with the most crossing traffic sets the pace.
            let k = servers.clamp(1, n - 1);
            let workers = n - k;
            let share = bytes / k as f64;
            let node_of = |r: usize| r / layout.per_node.max(1);
            let local_to = |s: usize| (0..workers).filter(|&w| node_of(w) == node_of(s)).count();
            // (crossing shares, as slowed by the node's other servers; local shares), the most
            // crossing first.
            let (crossing, local) = (workers..n)
                .map(|s| {
                    let servers_here = (workers..n).filter(|&t| node_of(t) == node_of(s)).count();
                    ((workers - local_to(s)) as f64 * sharing(servers_here, nics), local_to(s) as f64)
                })
                .max_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal))
                .unwrap_or((0.0, 0.0));
            c[FABRIC_LOAD] += (workers..n).map(|s| (workers - local_to(s)) as f64 * 2.0 * share).sum::<f64>();
            if crossing > 0.0 {
                add_link(&mut c, true, 2.0, 2.0 * crossing * share);
            }
            if local > 0.0 {
                add_link(&mut c, false, 2.0, 2.0 * local * share);
            }
            c[4] += workers as f64 * share;
        }
    }
    c
}

impl CostModel {
    /// The unknowns in [`Coefficients`] order, the fabric's time per byte last (0: none).
    pub fn as_vector(&self) -> Coefficients {
        let shared = self.shared.unwrap_or(LinkCost { alpha_s: 0.0, beta_s_per_byte: 0.0 });
        [
            self.intra.alpha_s, self.intra.beta_s_per_byte, self.inter.alpha_s, self.inter.beta_s_per_byte, self.gamma_s_per_byte,
            shared.alpha_s, shared.beta_s_per_byte, self.fabric_s_per_byte.unwrap_or(0.0),
        ]
    }

    /// Predicted seconds of `algorithm` for `bytes` on `layout`.
    pub fn predict(&self, algorithm: Algorithm, layout: Layout, bytes: f64) -> f64 {
        // Without shared-memory costs, that ring is costed as the ring over MPI.
        let algorithm = if algorithm == Algorithm::SharedRing && self.shared.is_none() { Algorithm::Ring } else { algorithm };
        time_of(&coefficients(algorithm, layout, bytes, self.nics_per_node), &self.as_vector())
    }

    /// The fastest of the all-reduce algorithms for `bytes` on `layout` (ties to the earlier
    /// of ring, rhd, recursive doubling), `ring` being the ring as it runs (Ring or SharedRing).
    pub fn choose(&self, ring: Algorithm, layout: Layout, bytes: f64) -> Algorithm {
        self.fastest(&[ring, Algorithm::Rhd, Algorithm::RecursiveDoubling], layout, bytes)
    }

    /// The fastest of `candidates` (the first on a tie).
    pub fn fastest(&self, candidates: &[Algorithm], layout: Layout, bytes: f64) -> Algorithm {
        let mut best = candidates[0];
        for &a in &candidates[1..] {
            if self.predict(a, layout, bytes) < self.predict(best, layout, bytes) {
                best = a;
            }
        }
        best
    }

    /// `--cost-model FILE`, or the defaults without one.
    pub fn from_option(path: Option<&std::path::Path>) -> Result<CostModel> {
        path.map_or(Ok(CostModel::default()), CostModel::load)
    }

    /// Reads a model file written by `hpc-train model fit` (its `model` field), or a bare model.
    pub fn load(path: &std::path::Path) -> Result<CostModel> {
        Ok(CostModel::load_file(path)?.0)
    }

    /// As [`CostModel::load`], with the whole file's JSON for what else it holds (MPI's
    /// measured curve).
    pub fn load_file(path: &std::path::Path) -> Result<(CostModel, serde_json::Value)> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::usage(format!("{}: not JSON: {e}", path.display())))?;
        let model = value.get("model").cloned().unwrap_or_else(|| value.clone());
        let model = serde_json::from_value(model).map_err(|e| Error::usage(format!("{}: not a cost model ({e})", path.display())))?;
        Ok((model, value))
    }
}

/// The time of `c` at the unknowns `v`: the sum of the terms, the network's bytes costed at the
/// slower of the busiest link and the fabric.
pub fn time_of(c: &Coefficients, v: &Coefficients) -> f64 {
    let network_bytes = (c[3] * v[3]).max(c[FABRIC_LOAD] * v[FABRIC_LOAD]);
    c.iter().zip(v).take(FABRIC_LOAD).enumerate().filter(|&(i, _)| i != 3).map(|(_, (c, v))| c * v).sum::<f64>() + network_bytes
}

/// One measured time of MPI_Allreduce.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MeasuredPoint {
    pub ranks: usize,
    pub per_node: usize,
    pub size_bytes: f64,
    pub time_s: f64,
}

impl MeasuredPoint {
    fn layout(&self) -> Layout {
        Layout { ranks: self.ranks, per_node: self.per_node }
    }
}

/// MPI_Allreduce as a measured curve. What the library does inside (its algorithm switch
/// points, segmenting, its transport's habits) is its own, so no closed form describes it;
/// its bench rows do. A prediction is the model's best algorithm for the layout and size times
/// the ratio of measured to modelled time, interpolated in log size between the measured sizes
/// (held at the ends), from the measured layout nearest to the one asked for: the same side of
/// the node boundary first, then the nearest rank count and ranks per node.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MeasuredCurve {
    pub points: Vec<MeasuredPoint>,
}

impl MeasuredCurve {
    /// Predicted seconds for `bytes` on `layout`, `formula` being the model's time for a layout
    /// and size. `held_out` leaves out the points of exactly this layout and size, so that a
    /// measured row is checked against the others only. None: no point to go by.
    pub fn predict(&self, layout: Layout, bytes: f64, held_out: bool, formula: impl Fn(Layout, f64) -> f64) -> Option<f64> {
        let points: Vec<&MeasuredPoint> = self.points.iter().filter(|p| !(held_out && p.layout() == layout && p.size_bytes == bytes)).collect();
        let log_gap = |a: usize, b: usize| ((a.max(1) as f64).ln() - (b.max(1) as f64).ln()).abs();
        let distance = |l: Layout| ((l.nodes() > 1) != (layout.nodes() > 1), log_gap(l.ranks, layout.ranks), log_gap(l.per_node, layout.per_node));
        let nearest = points.iter().map(|p| p.layout()).min_by(|a, b| distance(*a).partial_cmp(&distance(*b)).unwrap_or(std::cmp::Ordering::Equal))?;
        // (log size, measured / modelled), repeated sizes averaged.
        let mut ratios: Vec<(f64, f64, usize)> = Vec::new();
        for p in points.iter().filter(|p| p.layout() == nearest) {
            let (x, r) = (p.size_bytes.ln(), p.time_s / formula(nearest, p.size_bytes));
            match ratios.iter_mut().find(|q| q.0 == x) {
                Some(q) => (q.1, q.2) = (q.1 + r, q.2 + 1),
                None => ratios.push((x, r, 1)),
            }
        }
        let mut ratios: Vec<(f64, f64)> = ratios.into_iter().map(|(x, sum, k)| (x, sum / k as f64)).collect();
        ratios.sort_by(|a, b| a.0.total_cmp(&b.0));
        let x = bytes.ln();
        let ratio = match ratios.iter().position(|q| q.0 >= x) {
            Some(0) => ratios[0].1,
            None => ratios.last()?.1,
            Some(i) => {
                let (a, b) = (ratios[i - 1], ratios[i]);
                a.1 + (b.1 - a.1) * (x - a.0) / (b.0 - a.0)
            }
        };
        Some(formula(layout, bytes) * ratio)
    }
}

/// Least squares for two unknowns (x, y) from rows (a, b, target, weight), clamped at zero:
/// a negative unknown is set to zero and the other refitted.
pub fn fit_two(rows: &[(f64, f64, f64, f64)]) -> Option<(f64, f64)> {
    let (mut saa, mut sab, mut sbb, mut sat, mut sbt) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(a, b, t, w) in rows {
        let w2 = w * w;
        saa += a * a * w2;
        sab += a * b * w2;
        sbb += b * b * w2;
        sat += a * t * w2;
        sbt += b * t * w2;
    }
    let det = saa * sbb - sab * sab;
    let one = |s: f64, st: f64| if s > 0.0 { (st / s).max(0.0) } else { 0.0 };
    if det.abs() <= 1e-30 * (saa * sbb).max(1e-300) {
        return (sbb > 0.0 || saa > 0.0).then(|| if sbb > 0.0 { (0.0, one(sbb, sbt)) } else { (one(saa, sat), 0.0) });
    }
    let x = (sat * sbb - sbt * sab) / det;
    let y = (saa * sbt - sab * sat) / det;
    Some(match (x >= 0.0, y >= 0.0) {
        (true, true) => (x, y),
        (false, _) => (0.0, one(sbb, sbt)),
        (true, false) => (one(saa, sat), 0.0),
    })
}

/// The network's unknowns from rows that crossed it: `(coefficients, measured seconds)`, the
/// node's links, the adds and the shared ring known from `known`. Returns the link's alpha and
/// beta, and the fabric's time per byte when a fabric that saturates explains the rows better:
/// with a fabric, each row is costed by whichever of its busiest link and the fabric's load is
/// slower, and alpha and beta are fitted to the rows the link bounds (alpha to all). The
/// fabric's candidates are the rates the rows imply; one is kept only if it carries more than
/// one link, binds at least two rows and cuts the squared relative error by a tenth.
pub fn fit_network(rows: &[(Coefficients, f64)], known: &CostModel) -> Option<(LinkCost, Option<f64>)> {
    let mut fixed = known.as_vector();
    (fixed[2], fixed[3], fixed[FABRIC_LOAD]) = (0.0, 0.0, 0.0);
    let rest = |c: &Coefficients| time_of(c, &fixed);
    let with = |a: f64, b: f64, fabric: Option<f64>| {
        let mut v = fixed;
        (v[2], v[3], v[FABRIC_LOAD]) = (a, b, fabric.unwrap_or(0.0));
        v
    };
    let fabric_bound = |c: &Coefficients, b: f64, fabric: Option<f64>| fabric.is_some_and(|f| c[FABRIC_LOAD] * f > c[3] * b);
    let fit_for = |fabric: Option<f64>| -> Option<(f64, f64)> {
        let mut ab = fit_two(&rows.iter().map(|(c, t)| (c[2], c[3], t - rest(c), 1.0 / t)).collect::<Vec<_>>())?;
        for _ in 0..20 {
            let next = fit_two(
                &rows
                    .iter()
                    .map(|(c, t)| match fabric {
                        Some(f) if fabric_bound(c, ab.1, fabric) => (c[2], 0.0, t - rest(c) - c[FABRIC_LOAD] * f, 1.0 / t),
                        _ => (c[2], c[3], t - rest(c), 1.0 / t),
                    })
                    .collect::<Vec<_>>(),
            )?;
            if next == ab {
                break;
            }
            ab = next;
        }
        Some(ab)
    };
    let score = |(a, b): (f64, f64), fabric: Option<f64>| rows.iter().map(|(c, t)| ((time_of(c, &with(a, b, fabric)) - t) / t).powi(2)).sum::<f64>();
    let plain = fit_for(None)?;
    let plain_score = score(plain, None);
    let mut best = (plain, None, plain_score);
    for (c, t) in rows.iter().filter(|(c, _)| c[FABRIC_LOAD] > 0.0) {
        let mut fabric = Some((t - rest(c)) / c[FABRIC_LOAD]).filter(|f| *f > 0.0);
        let Some(mut ab) = fabric.and_then(|_| fit_for(fabric)) else { continue };
        // Alternate: the fabric from the rows it binds (their alpha known), then the link.
        for _ in 0..10 {
            let (mut scc, mut scy) = (0.0, 0.0);
            for (c, t) in rows.iter().filter(|(c, _)| fabric_bound(c, ab.1, fabric)) {
                let w2 = 1.0 / (t * t);
                scc += c[FABRIC_LOAD] * c[FABRIC_LOAD] * w2;
                scy += c[FABRIC_LOAD] * (t - rest(c) - c[2] * ab.0) * w2;
            }
            let refined = Some(scy / scc).filter(|f| scc > 0.0 && *f > 0.0);
            let Some(next) = refined.and_then(|_| fit_for(refined)) else { break };
            if (refined, next) == (fabric, ab) {
                break;
            }
            (fabric, ab) = (refined, next);
        }
        let bound = rows.iter().filter(|(c, _)| fabric_bound(c, ab.1, fabric)).count();
        let e = score(ab, fabric);
        // A fabric slower than one link, or links that cost nothing, would explain the rows by
        // the fabric alone: what one link can carry is the link's to explain.
        let plausible = fabric.is_some_and(|f| ab.1 > 0.0 && f < ab.1);
        if plausible && bound >= 2 && e < best.2 && e < 0.9 * plain_score {
            best = (ab, fabric, e);
        }
    }
    let ((alpha, beta), fabric, _) = best;
    Some((LinkCost { alpha_s: alpha, beta_s_per_byte: beta }, fabric))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_link(alpha: f64, beta: f64, gamma: f64) -> CostModel {
        let l = LinkCost { alpha_s: alpha, beta_s_per_byte: beta };
        CostModel { intra: l, inter: l, gamma_s_per_byte: gamma, nics_per_node: None, shared: None, fabric_s_per_byte: None }
    }

    #[test]
    fn ring_rhd_and_ps_follow_the_closed_forms() {
        let m = one_link(1e-5, 1e-9, 5e-10);
        let (n, s) = (8.0, 1e6);
        let layout = Layout { ranks: 8, per_node: 8 };
        let ring = 2.0 * (n - 1.0) * (1e-5 + s / n * 1e-9) + (n - 1.0) * s / n * 5e-10;
        assert!((m.predict(Algorithm::Ring, layout, s) - ring).abs() < 1e-12);
        // Power of two: 2 log2(p) alpha + 2 (p-1)/p S beta + (p-1)/p S gamma.
        let rhd = 2.0 * 3.0 * 1e-5 + 2.0 * 7.0 / 8.0 * s * 1e-9 + 7.0 / 8.0 * s * 5e-10;
        assert!((m.predict(Algorithm::Rhd, layout, s) - rhd).abs() < 1e-9);
        // Recursive doubling: log2(p) (alpha + S beta + S gamma).
        let rd = 3.0 * (1e-5 + s * 1e-9 + s * 5e-10);
        assert!((m.predict(Algorithm::RecursiveDoubling, layout, s) - rd).abs() < 1e-12);
        // Not a power of two (6 = 4 + 2): the pre- and post-step move the whole buffer.
        let six = Layout { ranks: 6, per_node: 6 };
        let rd6 = 2.0 * (1e-5 + s * 1e-9 + s * 5e-10) + 2.0 * (1e-5 + s * 1e-9) + s * 5e-10;
        assert!((m.predict(Algorithm::RecursiveDoubling, six, s) - rd6).abs() < 1e-12);
        // 2 servers, 6 workers: each server link carries 3 S each way.
        let ps = 2.0 * 1e-5 + 2.0 * 3.0 * s * 1e-9 + 3.0 * s * 5e-10;
        assert!((m.predict(Algorithm::Ps { servers: 2 }, layout, s) - ps).abs() < 1e-12);
    }

    #[test]
    fn latency_bound_buffers_go_to_doubling_middle_ones_to_rhd_and_large_ones_to_the_ring() {
        let m = CostModel::default();
        let cluster = Layout { ranks: 64, per_node: 8 };
        assert_eq!(m.choose(Algorithm::Ring, cluster, 4096.0), Algorithm::RecursiveDoubling);
        assert_eq!(m.choose(Algorithm::Ring, cluster, 4e6), Algorithm::Rhd);
        assert_eq!(m.fastest(&[Algorithm::Ring, Algorithm::Rhd], cluster, 4096.0), Algorithm::Rhd);
        assert_eq!(m.choose(Algorithm::Ring, Layout { ranks: 6, per_node: 6 }, 1e8), Algorithm::Ring, "the extra ranks' whole-buffer hand-over costs rhd");
    }

    #[test]
    fn ranks_crossing_the_network_at_once_share_the_nodes_links() {
        let own = CostModel { inter: LinkCost { alpha_s: 0.0, beta_s_per_byte: 1e-9 }, intra: LinkCost { alpha_s: 0.0, beta_s_per_byte: 0.0 }, gamma_s_per_byte: 0.0, nics_per_node: None, shared: None, fabric_s_per_byte: None };
        let one_nic = CostModel { nics_per_node: Some(1), ..own };
        let two_nodes = Layout { ranks: 8, per_node: 4 };
        let s = 1e6;
        // rhd's first step pairs every rank with one on the other node: 4 flows over one link.
        let first = 2.0 * s / 2.0 * 1e-9;
        let (alone, shared) = (own.predict(Algorithm::Rhd, two_nodes, s), one_nic.predict(Algorithm::Rhd, two_nodes, s));
        assert!((shared - alone - 3.0 * first).abs() < 1e-12, "{alone} {shared}");
        let (alone, shared) = (own.predict(Algorithm::RecursiveDoubling, two_nodes, s), one_nic.predict(Algorithm::RecursiveDoubling, two_nodes, s));
        assert!((shared - 4.0 * alone).abs() < 1e-12, "{alone} {shared}");
        // The node-aware ring crosses with one flow each way: no sharing.
        assert_eq!(own.predict(Algorithm::Ring, two_nodes, s), one_nic.predict(Algorithm::Ring, two_nodes, s));
        // Four links for four ranks: as good as a link per rank.
        let four = CostModel { nics_per_node: Some(4), ..own };
        assert_eq!(own.predict(Algorithm::Rhd, two_nodes, s), four.predict(Algorithm::Rhd, two_nodes, s));
    }

    #[test]
    fn the_shared_memory_ring_has_the_rings_steps_at_its_own_costs() {
        let mpi = one_link(1e-5, 1e-9, 5e-10);
        let shm = CostModel { shared: Some(LinkCost { alpha_s: 1e-6, beta_s_per_byte: 1e-10 }), ..mpi };
        let (one_node, s) = (Layout { ranks: 4, per_node: 4 }, 1e6);
        let expected = 2.0 * 3.0 * (1e-6 + s / 4.0 * 1e-10) + 3.0 * s / 4.0 * 5e-10;
        assert!((shm.predict(Algorithm::SharedRing, one_node, s) - expected).abs() < 1e-12);
        // Without its costs, or across nodes, it is the ring over MPI.
        assert_eq!(mpi.predict(Algorithm::SharedRing, one_node, s), mpi.predict(Algorithm::Ring, one_node, s));
        let two_nodes = Layout { ranks: 4, per_node: 2 };
        assert_eq!(shm.predict(Algorithm::SharedRing, two_nodes, s), shm.predict(Algorithm::Ring, two_nodes, s));
        // Cheap enough, it wins where the MPI ring loses to rhd.
        assert_ne!(mpi.choose(Algorithm::Ring, one_node, 1e4), Algorithm::Ring);
        assert_eq!(shm.choose(Algorithm::SharedRing, one_node, 1e4), Algorithm::SharedRing);
    }

    #[test]
    fn parameter_servers_take_their_own_nodes_workers_over_the_node() {
        let m = CostModel { inter: LinkCost { alpha_s: 0.0, beta_s_per_byte: 1e-8 }, intra: LinkCost { alpha_s: 0.0, beta_s_per_byte: 1e-10 }, gamma_s_per_byte: 0.0, nics_per_node: Some(1), shared: None, fabric_s_per_byte: None };
        let s = 1e6;
        // Rank 3 serves; workers 0 and 1 cross to it, worker 2 shares its node.
        let two_by_two = Layout { ranks: 4, per_node: 2 };
        let expected = 2.0 * 2.0 * s * 1e-8 + 2.0 * s * 1e-10;
        assert!((m.predict(Algorithm::Ps { servers: 1 }, two_by_two, s) - expected).abs() < 1e-12);
        // Two servers on the last node share its one link: each carries 2 x S/2 each way, twice
        // as slow as alone.
        let expected = 2.0 * 2.0 * (s / 2.0) * 2.0 * 1e-8;
        assert!((m.predict(Algorithm::Ps { servers: 2 }, two_by_two, s) - expected).abs() < 1e-12);
    }

    #[test]
    fn the_measured_curve_scales_the_formula_by_the_measured_ratio() {
        let m = one_link(0.0, 1e-9, 0.0);
        let formula = |l: Layout, b: f64| m.predict(m.choose(Algorithm::Ring, l, b), l, b);
        let two = Layout { ranks: 2, per_node: 1 };
        let point = |size: f64, ratio: f64| MeasuredPoint { ranks: 2, per_node: 1, size_bytes: size, time_s: ratio * formula(two, size) };
        let curve = MeasuredCurve { points: vec![point(1e6, 2.0), point(1e8, 3.0)] };
        // Measured sizes come back as measured; between them the ratio follows log size; beyond
        // them it holds.
        assert!((curve.predict(two, 1e6, false, formula).unwrap() - 2.0 * formula(two, 1e6)).abs() < 1e-12);
        assert!((curve.predict(two, 1e7, false, formula).unwrap() - 2.5 * formula(two, 1e7)).abs() < 1e-12);
        assert!((curve.predict(two, 1e9, false, formula).unwrap() - 3.0 * formula(two, 1e9)).abs() < 1e-12);
        // Held out, a measured size is predicted from the other points only.
        assert!((curve.predict(two, 1e6, true, formula).unwrap() - 3.0 * formula(two, 1e6)).abs() < 1e-12);
        // A layout never measured takes the ratio of the nearest one across nodes.
        let sixteen = Layout { ranks: 16, per_node: 4 };
        assert!((curve.predict(sixteen, 1e8, false, formula).unwrap() - 3.0 * formula(sixteen, 1e8)).abs() < 1e-12);
        let one_node = MeasuredPoint { ranks: 8, per_node: 8, size_bytes: 1e8, time_s: 5.0 * formula(Layout { ranks: 8, per_node: 8 }, 1e8) };
        let within = MeasuredCurve { points: vec![one_node, point(1e8, 3.0)] };
        assert!((within.predict(sixteen, 1e8, false, formula).unwrap() - 3.0 * formula(sixteen, 1e8)).abs() < 1e-12, "across nodes, not the nearer rank count on one node");
        assert_eq!(MeasuredCurve::default().predict(two, 1e6, false, formula), None);
    }

    #[test]
    fn a_saturated_fabric_slows_the_steps_that_load_it_and_the_fit_finds_it() {
        let link = LinkCost { alpha_s: 1e-4, beta_s_per_byte: 1e-8 };
        let free = CostModel { inter: link, nics_per_node: Some(1), ..one_link(0.0, 0.0, 0.0) };
        let free = CostModel { inter: link, ..free };
        let full = CostModel { fabric_s_per_byte: Some(5e-9), ..free };
        let s = 1e7;
        // Two nodes: the ring loads two links, 2 x S: the fabric at twice a link's rate keeps
        // up. Four nodes load four: the fabric sets the pace.
        let (two, four) = (Layout { ranks: 2, per_node: 1 }, Layout { ranks: 4, per_node: 1 });
        assert_eq!(free.predict(Algorithm::Ring, two, s), full.predict(Algorithm::Ring, two, s));
        let link_bytes = 2.0 * 3.0 / 4.0 * s;
        let expected = 6.0 * 1e-4 + 4.0 * link_bytes * 5e-9;
        assert!((full.predict(Algorithm::Ring, four, s) - expected).abs() < 1e-12);
        // One parameter server's link carries all the traffic: link-bound either way.
        assert_eq!(free.predict(Algorithm::Ps { servers: 1 }, four, s), full.predict(Algorithm::Ps { servers: 1 }, four, s));
        // The fit recovers the link and the fabric from rows of both kinds.
        let mut rows = Vec::new();
        for layout in [two, four, Layout { ranks: 8, per_node: 1 }, Layout { ranks: 4, per_node: 2 }] {
            for a in [Algorithm::Ring, Algorithm::Rhd, Algorithm::Ps { servers: 1 }] {
                for bytes in [1e5, 1e6, 1e7] {
                    rows.push((coefficients(a, layout, bytes, Some(1)), full.predict(a, layout, bytes)));
                }
            }
        }
        let (fitted, fabric) = fit_network(&rows, &free).unwrap();
        assert!((fitted.beta_s_per_byte / 1e-8 - 1.0).abs() < 1e-6 && (fitted.alpha_s / 1e-4 - 1.0).abs() < 1e-6, "{fitted:?}");
        assert!((fabric.unwrap() / 5e-9 - 1.0).abs() < 1e-6, "{fabric:?}");
        // Rows that never saturate it give no fabric.
        let rows: Vec<_> = rows.iter().map(|(c, _)| (*c, time_of(c, &free.as_vector()))).collect();
        assert_eq!(fit_network(&rows, &free).unwrap().1, None);
    }

    #[test]
    fn the_fit_recovers_known_costs() {
        let (alpha, beta) = (3e-6, 2e-10);
        let rows: Vec<(f64, f64, f64, f64)> = [1e3, 1e5, 1e6, 1e7]
            .iter()
            .map(|&s| {
                let c = coefficients(Algorithm::Ring, Layout { ranks: 4, per_node: 4 }, s, None);
                let t = c[0] * alpha + c[1] * beta;
                (c[0], c[1], t, 1.0 / t)
            })
            .collect();
        let (a, b) = fit_two(&rows).unwrap();
        assert!((a - alpha).abs() / alpha < 1e-6 && (b - beta).abs() / beta < 1e-6, "{a} {b}");
    }
}
