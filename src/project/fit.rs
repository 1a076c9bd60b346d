//! `hpc-train model fit`: the cost model's unknowns from measured bench rows, by least squares
//! (the formulas and the solvers are src/cost.rs's), written as a model file with every row's
//! prediction beside its measurement.

use std::path::{Path, PathBuf};

use clap::Args;
use serde::{Deserialize, Serialize};

use crate::cost::{coefficients, fit_network, fit_two, Algorithm, Coefficients, CostModel, LinkCost, MeasuredCurve, MeasuredPoint};
use crate::error::{Error, Result, WithPath};
use crate::project::predict::{algorithm_of, median, residual, BenchRow, Predictor, Residual};
use crate::results;

/// Options of `hpc-train model fit`.
#[derive(Args, Debug, Clone)]
pub struct FitArgs {
    /// Bench rows (host f32, one tensor): ring, rhd and ps within a node and, for the network
    /// link and the fabric, across nodes; MPI_Allreduce's rows become its measured curve; every
    /// row is predicted and shown beside its measurement (MPI_Allreduce's from the others).
    #[arg(long, default_value = "results/bench.jsonl")]
    pub bench: PathBuf,
    /// Only the rows across nodes recorded with this --link-mbit (rows within one node all count).
    #[arg(long)]
    pub link_mbit: Option<f64>,
    /// The model file to write (JSON).
    #[arg(long, default_value = "results/cost-model.json")]
    pub out: PathBuf,
    /// Parameter servers in the ps rows (as bench --servers).
    #[arg(long, default_value_t = 1)]
    pub servers: usize,
    /// Network links per node in the rows across nodes: the node's ranks that cross the network
    /// in the same step share them (rhd's steps between nodes; the node-aware ring crosses with
    /// one flow each way). Written into the model. [default: a link per rank]
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub nics_per_node: Option<u16>,
    /// Horovod cycle time of the horovod rows (as bench --cycle-time-ms).
    #[arg(long, default_value_t = 1.0)]
    pub cycle_time_ms: f64,
}

/// What `model fit` writes.
#[derive(Serialize, Deserialize)]
pub struct ModelFile {
    pub model: CostModel,
    /// MPI_Allreduce's measured times (absent in files fitted before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mpi_allreduce: Option<MeasuredCurve>,
    pub link_mbit: Option<f64>,
    pub fitted_from: String,
    pub rows: usize,
    pub residuals: Vec<Residual>,
}

/// `hpc-train model fit`.
pub fn fit(args: &FitArgs) -> Result<()> {
    let rows: Vec<(usize, BenchRow)> = results::read_numbered_json_lines(&args.bench)?;
    // --link-mbit picks the network rows; rows within one node never crossed it and all count.
    let rows: Vec<(usize, BenchRow)> = rows.into_iter().filter(|(_, r)| r.usable() && (args.link_mbit.is_none() || r.nodes <= 1 || r.link_mbit == args.link_mbit)).collect();
    // A time of 0 (a bench of no iterations) would fit links that cost nothing.
    for (line, r) in &rows {
        let bad_add = r.memory_add_gbs.filter(|g| !(g.is_finite() && *g > 0.0));
        if !(r.time_us.is_finite() && r.time_us > 0.0) || bad_add.is_some() {
            let (what, value) = match bad_add {
                Some(g) => ("memory_add_gbs", g),
                None => ("time_us", r.time_us),
            };
            return Err(Error::usage(format!(
                "{}:{line}: the {} row of {} bytes on {} rank(s) has {what} {value}, not a positive measurement; remove the row (or measure again)",
                args.bench.display(), r.strategy, r.size, r.ranks
            )));
        }
    }
    let rows: Vec<BenchRow> = rows.into_iter().map(|(_, r)| r).collect();
    let adds: Vec<f64> = rows.iter().filter_map(|r| r.memory_add_gbs).collect();
    if adds.is_empty() {
        return Err(Error::usage(format!(
            "{}: no usable row with memory_add_gbs (host f32 rows from `hpc-train bench` on more than one rank{})",
            args.bench.display(),
            args.link_mbit.map_or(String::new(), |m| format!(" at --link-mbit {m}"))
        )));
    }
    let gamma = 1.0 / (median(adds) * 1e9);
    // The algorithms' own rows (ring over MPI, rhd, ps), with their coefficients and seconds.
    let algorithm_rows = |inter: bool| -> Vec<(Coefficients, f64)> {
        rows.iter()
            .filter(|r| (r.nodes > 1) == inter && matches!(r.strategy.as_str(), "ring" | "rhd" | "ps") && !r.shared_ring())
            .map(|r| {
                let algorithm = algorithm_of(&r.strategy, args.servers, false).expect("ring, rhd or ps");
                (coefficients(algorithm, r.layout(), r.size as f64, args.nics_per_node.map(usize::from)), r.time_us * 1e-6)
            })
            .collect()
    };
    let mut model = CostModel { gamma_s_per_byte: gamma, nics_per_node: args.nics_per_node.map(usize::from), ..CostModel::default() };
    // Relative errors: every size counts alike.
    let node_rows: Vec<(f64, f64, f64, f64)> = algorithm_rows(false).iter().map(|(c, t)| (c[0], c[1], t - c[4] * gamma, 1.0 / t)).collect();
    let intra = fit_two(&node_rows).ok_or_else(|| Error::usage("no ring, rhd or ps rows within one node to fit the node's links"))?;
    model.intra = LinkCost { alpha_s: intra.0, beta_s_per_byte: intra.1 };
    match fit_network(&algorithm_rows(true), &model) {
        Some((inter, fabric)) => (model.inter, model.fabric_s_per_byte) = (inter, fabric),
        None => log::warn!("no ring, rhd or ps rows across nodes: the network link keeps the built-in default"),
    }
    // The ring through node-shared memory, from its own rows (the adds known).
    let shared_rows: Vec<(f64, f64, f64, f64)> = rows
        .iter()
        .filter(|r| r.strategy == "ring" && r.shared_ring() && r.nodes <= 1)
        .map(|r| {
            let c = coefficients(Algorithm::SharedRing, r.layout(), r.size as f64, None);
            let t = r.time_us * 1e-6;
            (c[5], c[6], t - c[4] * gamma, 1.0 / t)
        })
        .collect();
    model.shared = fit_two(&shared_rows).map(|(alpha, beta)| LinkCost { alpha_s: alpha, beta_s_per_byte: beta });
    let mpi_allreduce = measured_curve(&rows);
    // Every row predicted; MPI_Allreduce's from the curve without that row (held out).
    let predictor = Predictor { model: &model, mpi_allreduce: mpi_allreduce.as_ref(), servers: args.servers, cycle_s: args.cycle_time_ms * 1e-3, cycle_share: 1.0 };
    let residuals: Vec<Residual> = rows
        .iter()
        .filter_map(|r| {
            let predicted = predictor.exchange(r.strategy(), r.layout(), r.size as f64, r.shared_ring(), true)?;
            Some(residual(r.strategy(), r.ranks, r.nodes.max(1), r.link_mbit, Some(r.size), r.time_us, predicted * 1e6))
        })
        .collect();
    print_fit(&model, mpi_allreduce.as_ref(), &residuals);
    let file = ModelFile { model, mpi_allreduce, link_mbit: args.link_mbit, fitted_from: args.bench.display().to_string(), rows: rows.len(), residuals };
    write_json(&args.out, &file)?;
    println!("wrote {}", args.out.display());
    Ok(())
}

/// MPI_Allreduce's rows as its measured curve (None without such rows).
fn measured_curve(rows: &[BenchRow]) -> Option<MeasuredCurve> {
    let points: Vec<MeasuredPoint> = rows
        .iter()
        .filter(|r| r.strategy == "allreduce")
        .map(|r| {
            let layout = r.layout();
            MeasuredPoint { ranks: layout.ranks, per_node: layout.per_node, size_bytes: r.size as f64, time_s: r.time_us * 1e-6 }
        })
        .collect();
    (!points.is_empty()).then_some(MeasuredCurve { points })
}

fn print_fit(model: &CostModel, mpi_allreduce: Option<&MeasuredCurve>, residuals: &[Residual]) {
    println!("# cost model: alpha (us), bandwidth 1/beta (GB/s), add rate 1/gamma (GB/s)");
    for (name, l) in [("within a node", model.intra), ("between nodes", model.inter)] {
        println!("#   {name:<14} alpha {:>8.2}  bandwidth {:>7.3}", l.alpha_s * 1e6, 1e-9 / l.beta_s_per_byte.max(1e-30));
    }
    if let Some(l) = model.shared {
        println!("#   {:<14} alpha {:>8.2}  bandwidth {:>7.3}", "shared memory", l.alpha_s * 1e6, 1e-9 / l.beta_s_per_byte.max(1e-30));
    }
    match model.fabric_s_per_byte {
        Some(f) => println!("#   the network as a whole carries {:.3} GB/s (all nodes' traffic together)", 1e-9 / f),
        None => println!("#   a non-blocking network (no fabric limit fits the rows better)"),
    }
    println!("#   adds {:.3} GB/s", 1e-9 / model.gamma_s_per_byte);
    match model.nics_per_node {
        Some(k) => println!("#   {k} network link(s) per node, shared by the node's ranks crossing at once"),
        None => println!("#   a network link per rank"),
    }
    match mpi_allreduce {
        Some(c) => println!("#   MPI_Allreduce: a measured curve of {} point(s); its rows below are each predicted from the others", c.points.len()),
        None => println!("#   MPI_Allreduce: no rows, taken as the faster of the algorithms"),
    }
    println!("# {:>10} {:>6} {:>6} {:>12} {:>12} {:>12} {:>8}", "strategy", "ranks", "nodes", "size (B)", "measured us", "predicted", "error %");
    for r in residuals {
        println!(
            "  {:>10} {:>6} {:>6} {:>12} {:>12.1} {:>12.1} {:>8.1}",
            r.strategy, r.ranks, r.nodes, r.size_bytes.map_or("-".into(), |s| s.to_string()), r.measured_us, r.predicted_us, r.error_pct
        );
    }
    let errors: Vec<f64> = residuals.iter().map(|r| r.error_pct.abs()).collect();
    if !errors.is_empty() {
        println!("# median |error| {:.1}%, max {:.1}%, {} rows", median(errors.clone()), errors.iter().cloned().fold(0.0, f64::max), errors.len());
    }
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).at(dir)?;
    }
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::Results(e.to_string()))?;
    std::fs::write(path, text).at(path)
}
