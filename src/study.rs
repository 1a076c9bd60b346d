//! `hpc-train study`: a whole scaling sweep inside one allocation.
//!
//! mpirun (or srun) starts the largest rank count once; each point of the sweep runs on a
//! sub-communicator of the first N ranks while the others wait, every strategy in turn, and
//! every run is appended to runs.jsonl tagged with the study id (so that `hpc-train report
//! --study ID` finds them). Ranks 0..N of one allocation are placed as the launcher placed
//! them, so a point of N ranks uses the first N slots (fill nodes in order with
//! `--map-by core` or Slurm's block distribution to keep nodes whole).

use clap::Args;
use mpi::topology::Color;
use mpi::traits::*;

use crate::error::{Error, Result};
use crate::exchange::config::{parse_strategies, StrategyKind};
use crate::topology::World;
use crate::train::options::{Scaling, TrainArgs};
use crate::train::{self, RunContext};

/// Options of `hpc-train study`.
#[derive(Args, Debug, Clone)]
pub struct StudyArgs {
    /// Rank counts of the sweep, comma-separated (each at most the launched ranks); the study's
    /// id is --study [default: scaling mode and UTC time].
    #[arg(long, default_value = "1,2,4", help_heading = "Study")]
    pub ranks: String,
    /// Strategies, comma-separated.
    #[arg(long, default_value = "ring,ps,allreduce,horovod", help_heading = "Study")]
    pub strategies: String,
    /// Pipeline stages per point, each run at every rank count it divides: 1 is
    /// plain data parallelism, P > 1 pipelines of P stages with --micro-batches and --schedule.
    #[arg(long, default_value = "1", help_heading = "Study")]
    pub stages: String,
    /// Runs of each point: the sweep runs this many times, each repeat starting the strategies
    /// of a rank count one further along (repeat r at offset r), so that drift over the study
    /// (a warming node, a neighbour's job) does not always favour the same strategy. The report
    /// shows each point's median with its range.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: u32,
    /// Training options for every run (--strategy is set by the sweep), from the command line
    /// and from --config's run file as for one run.
    #[command(flatten)]
    pub train: TrainArgs,
}

/// Parses `1,2,4`.
pub fn parse_ranks(list: &str, available: usize) -> Result<Vec<usize>> {
    let mut ranks: Vec<usize> = Vec::new();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let n: usize = item.parse().map_err(|_| Error::usage(format!("--ranks: {item:?} is not a rank count")))?;
        if n == 0 || n > available {
            return Err(Error::usage(format!(
                "--ranks: {n} is outside 1..={available} (the study runs inside this launch of {available} rank(s); launch the largest count)"
            )));
        }
        if !ranks.contains(&n) {
            ranks.push(n);
        }
    }
    if ranks.is_empty() {
        return Err(Error::usage("--ranks: name at least one rank count"));
    }
    ranks.sort_unstable();
    Ok(ranks)
}

pub fn run(world: &World, args: &StudyArgs) -> Result<()> {
    let ranks = world.agree(parse_ranks(&args.ranks, world.size as usize))?;
    let strategies = world.agree(parse_strategies(&args.strategies))?;
    let stage_counts = world.agree(parse_stages(&args.stages))?;
    // An option is fine when one strategy of the study reads it (each point gets them all).
    world.log_warnings(&world.agree(args.train.check_unused_options(&strategies))?);
    if args.train.scaling == Scaling::Strong && args.train.global_batch.is_none() {
        world.agree::<()>(Err(Error::usage("--scaling strong needs --global-batch (the samples per step at every point)")))?;
    }
    // One id for every run of the study: given, or made on rank 0.
    // --study (formerly --study-id here): the id of every run, as training's --study tags one.
    let id = broadcast_string(world, args.train.study_tag.clone().unwrap_or_else(|| {
        format!("{}-{}", match args.train.scaling { Scaling::Weak => "weak", Scaling::Strong => "strong" }, chrono::Utc::now().format("%Y%m%dT%H%M%SZ"))
    }));
    if world.is_root() {
        log::info!("study {id}: {} scaling, ranks {ranks:?}, strategies {:?}", match args.train.scaling { Scaling::Weak => "weak", Scaling::Strong => "strong" }, strategies.iter().map(|s| s.name()).collect::<Vec<_>>());
    }
    let (points, left_out) = world.agree(plan_points(&ranks, &strategies, &stage_counts, &args.train, crate::faults::injected()))?;
    if world.is_root() {
        for (level, note) in &left_out {
            log::log!(*level, "study {id}: {note}");
        }
    }
    let points = repeat_order(&points, args.repeats as usize);
    let core_gflops = measure_core_gflops(world);
    let mut done = 0usize;
    for (i, &Point { ranks: n, strategy, stages }) in points.iter().enumerate() {
        let repeat = (args.repeats > 1).then_some((i / (points.len() / args.repeats as usize)) as u32);
        let context = RunContext { study: Some(id.clone()), core_gflops, repeat };
        let mut point = point_args(&args.train, strategy, stages, &stage_counts);
        // Each point's traces in a folder of their own: the next point's rank-R.json would
        // overwrite them.
        point.profile_dir = args.train.profile_dir.as_ref().map(|dir| {
            let pipeline = if stages > 1 { format!("-{stages}stages") } else { String::new() };
            dir.join(format!("{}-{n}ranks{pipeline}", strategy.name()))
        });
        let profile_dir = point.profile_dir.as_ref().map(|d| toml::Value::String(d.display().to_string()));
        point.run_config.set("profile-dir", profile_dir);
        let inside = (world.rank as usize) < n;
        let sub = world.comm.split_by_color(if inside { Color::with_value(0) } else { Color::undefined() });
        let outcome = match sub {
            Some(comm) => {
                let result = World::new(comm).and_then(|sub_world| train::run(&sub_world, &point, &context).map(|_| ()));
                // An error the point's ranks agreed on was printed by one of them; the
                // whole study stops with it.
                match result {
                    Err(Error::Agreed(e)) => {
                        eprintln!("error: study {id}, {strategy} at {n} rank(s): {e}");
                        Err(Error::Reported(world.rank))
                    }
                    other => other,
                }
            }
            None => Ok(()),
        };
        // The ranks outside the point waited here, asleep rather than spinning in the
        // collective below on the cores of the point's ranks.
        world.sleeping_barrier();
        // A signal stopped the point (its ranks all say so): the study stops with it.
        let stopped = match &outcome {
            Err(Error::Stopped { checkpointed }) => 1.0 + f64::from(u8::from(*checkpointed)),
            _ => 0.0,
        };
        let stopped = world.max_f64(stopped);
        if stopped > 0.0 {
            if world.is_root() {
                println!("study {id}: stopped by a signal during {strategy} at {n} rank(s); {done} run(s) appended to {}", crate::results::runs_path(&args.train.results).display());
            }
            return Err(Error::Stopped { checkpointed: stopped > 1.0 });
        }
        world.agree(outcome)?;
        done += 1;
    }
    if world.is_root() {
        println!("study {id}: {done} run(s) appended to {}; tables and plots: hpc-train report --study {id}", crate::results::runs_path(&args.train.results).display());
    }
    Ok(())
}

/// The points of `repeats` sweeps in the order they run: each repeat keeps the rank counts in
/// order, and starts the points of each rank count (its strategies and stage counts) at offset
/// r of repeat r, so that every strategy runs first at a rank count as often as the others.
fn repeat_order(points: &[Point], repeats: usize) -> Vec<Point> {
    let mut out = Vec::with_capacity(points.len() * repeats);
    for r in 0..repeats {
        for group in points.chunk_by(|a, b| a.ranks == b.ranks) {
            let mut group = group.to_vec();
            let len = group.len();
            group.rotate_left(r % len);
            out.extend(group);
        }
    }
    out
}

/// One CPU core's f32 matmul GFLOP/s (model/flops.rs), measured by rank 0 while the other
/// ranks sleep (so that none competes for its core), where no GPU is present: about 0.2 s,
/// once per launch of a study or of one of its points. None on the other ranks and on GPU
/// nodes (the datasheet table applies there). Collective over `world`.
pub fn measure_core_gflops(world: &World) -> Option<f64> {
    let cpu = !tch::Cuda::is_available();
    let value = (world.is_root() && cpu).then(crate::model::flops::measure_core_gflops);
    world.sleeping_barrier();
    value
}

/// Refuses stage counts (given by `flag`) that divide none of `ranks`: a pipeline of P stages
/// `runs` (or is projected) only at the rank counts that P divides, so such a count would
/// silently give nothing. Shared by `study --stages` and `project --pipeline-stages`.
pub fn check_stages_divide(flag: &str, stage_counts: &[usize], ranks: &[usize], runs: &str) -> Result<()> {
    let dividing_nothing: Vec<String> = stage_counts.iter().filter(|&&p| !ranks.iter().any(|&n| n % p == 0)).map(|p| p.to_string()).collect();
    if dividing_nothing.is_empty() {
        return Ok(());
    }
    let ranks: Vec<String> = ranks.iter().map(|n| n.to_string()).collect();
    Err(Error::usage(format!(
        "{flag} {}: divides none of the rank counts of --ranks {} (a pipeline of P stages {runs} at the rank counts that P divides)",
        dividing_nothing.join(","),
        ranks.join(",")
    )))
}

/// The training options of one point: the study's, with the point's strategy and stages.
fn point_args(train: &TrainArgs, strategy: StrategyKind, stages: usize, stage_counts: &[usize]) -> TrainArgs {
    let mut point = train.clone();
    point.strategy = strategy;
    if strategy != StrategyKind::Horovod {
        // A study's Horovod options are its Horovod points' (README: an option read by one of
        // its strategies is fine); the other points do not read them.
        point.horovod.timeline = None;
        point.horovod.compression = crate::exchange::config::Compression::None;
        point.horovod.hierarchical = None;
        point.given = point.given.without(&["timeline", "compression", "hierarchical"]);
        for long in ["timeline", "hierarchical"] {
            point.run_config.set(long, None);
        }
        point.run_config.set("compression", Some("none".into()));
    }
    // The point's record re-runs as a training run of the point's own options.
    point.run_config.set("strategy", Some(strategy.name().into()));
    if stage_counts != [1] {
        point.pipeline.pipeline_stages = stages as u64;
        point.run_config.set("pipeline-stages", Some(toml::Value::Integer(stages as i64)));
        if stages == 1 {
            // The plain point of a pipeline study: the pipeline's own options do not apply.
            point.pipeline.micro_batches = 1;
            point.pipeline.recompute = false;
            point.pipeline.pipeline_timeline = None;
            point.given = point.given.without(&["schedule", "virtual_stages", "partition", "recompute", "pipeline_timeline", "micro_batches"]);
            point.run_config.set("micro-batches", Some(toml::Value::Integer(1)));
            point.run_config.set("recompute", Some(false.into()));
            point.run_config.set("pipeline-timeline", None);
        }
    }
    point
}

/// One run of the sweep: a rank count, a strategy and a number of pipeline stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Point {
    ranks: usize,
    strategy: StrategyKind,
    stages: usize,
}

/// The sweep as data, in the order it runs: rank counts outermost, then strategies, then stage
/// counts; with the points left out and why (stages that do not divide the ranks, ps without a
/// worker). Strong scaling's global batch is checked against every point here, before any
/// runs: a sweep that would stop at its twentieth point (ps's workers are the ranks less its
/// servers) stops before its first, naming every point it does not divide.
fn plan_points(ranks: &[usize], strategies: &[StrategyKind], stage_counts: &[usize], train: &TrainArgs, faults: bool) -> Result<(Vec<Point>, Vec<(log::Level, String)>)> {
    // A stage count that divides no rank count would run no point at all, and a study of only
    // such counts ran nothing and exited 0.
    check_stages_divide("--stages", stage_counts, ranks, "runs")?;
    let mut points = Vec::new();
    let mut left_out = Vec::new();
    let mut indivisible = Vec::new();
    for &n in ranks {
        for &strategy in strategies {
            for &stages in stage_counts {
                if n % stages != 0 {
                    left_out.push((log::Level::Info, format!("skipping {stages} pipeline stage(s) at {n} rank(s): they do not divide the ranks")));
                    continue;
                }
                if strategy == StrategyKind::Ps && !train.ps.ps_colocate && n <= train.ps.servers {
                    left_out.push((log::Level::Warn, format!("skipping ps at {n} rank(s): {} dedicated server(s) would leave no worker (use --ps-colocate to include it)", train.ps.servers)));
                    continue;
                }
                let point = Point { ranks: n, strategy, stages };
                // What combines is known before the first point runs (plan/compat.rs).
                let (features, kinds) = train::features_and_kinds(&point_args(train, strategy, stages, stage_counts), faults);
                if let Err(why) = crate::plan::compat::check(&features, &kinds) {
                    let layout = if stages > 1 { format!("{strategy} in {stages} stages") } else { strategy.to_string() };
                    return Err(Error::usage(format!("the study's point {layout} at {n} rank(s): {why}; leave that strategy or stage count out")));
                }
                // Strategy options that are themselves wrong are left for training to name.
                if let (Scaling::Strong, Some(global), Ok(workers)) = (train.scaling, train.global_batch, train::training_ranks(train, strategy, n, stages)) {
                    if workers > 0 && !(global as usize).is_multiple_of(workers) {
                        let layout = if stages > 1 { format!("{strategy} in {stages} stages") } else { strategy.to_string() };
                        indivisible.push(format!("{layout} at {n} rank(s) has {workers}"));
                    }
                }
                points.push(point);
            }
        }
    }
    if let (false, Some(global)) = (indivisible.is_empty(), train.global_batch) {
        return Err(Error::usage(format!(
            "--global-batch {global} does not divide evenly among the training ranks of every point of the study (strong scaling splits it evenly): {}; choose a global batch that every point's training ranks divide, or leave those points out",
            indivisible.join(", ")
        )));
    }
    if points.is_empty() {
        let notes: Vec<&str> = left_out.iter().map(|(_, note)| note.as_str()).collect();
        return Err(Error::usage(format!("the study has no point to run: {}", notes.join("; "))));
    }
    Ok((points, left_out))
}

/// Rank 0's string on every rank.
/// `--stages 1,2,4`: pipeline stage counts, each at least 1.
pub fn parse_stages(list: &str) -> Result<Vec<usize>> {
    parse_counts(list, "--stages", "number of pipeline stages")
}

/// A comma-separated list of counts of 1 or more, sorted without repeats; errors name `flag`
/// (study's --stages and project's --ranks and --pipeline-stages share it).
pub fn parse_counts(list: &str, flag: &str, what: &str) -> Result<Vec<usize>> {
    let mut counts = Vec::new();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match item.parse::<usize>() {
            Ok(n) if n >= 1 => {
                if !counts.contains(&n) {
                    counts.push(n);
                }
            }
            _ => return Err(Error::usage(format!("{flag}: {item:?} is not a {what} (1 or more)"))),
        }
    }
    if counts.is_empty() {
        return Err(Error::usage(format!("{flag}: name at least one {what}")));
    }
    counts.sort_unstable();
    Ok(counts)
}

fn broadcast_string(world: &World, value: String) -> String {
    let mut len = value.len() as u64;
    let root = world.comm.process_at_rank(0);
    root.broadcast_into(&mut len);
    let mut bytes = if world.is_root() { value.into_bytes() } else { vec![0u8; len as usize] };
    root.broadcast_into(&mut bytes[..]);
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_lists_are_checked_against_the_launch() {
        assert_eq!(parse_ranks("4,1,2,2", 4).unwrap(), vec![1, 2, 4]);
        assert!(parse_ranks("1,8", 4).unwrap_err().to_string().contains("outside 1..=4"));
        assert!(parse_ranks("0", 4).is_err());
        assert!(parse_ranks("x", 4).is_err());
        assert!(parse_ranks("", 4).is_err());
    }

    use crate::train::options::parse_train_args as train_args;

    #[test]
    fn repeats_rotate_the_strategies_of_each_rank_count() {
        let all = parse_strategies("ring,ps,allreduce").unwrap();
        let (points, _) = plan_points(&[1, 2], &all, &[1], &train_args(&["--ps-colocate"]), false).unwrap();
        let order: Vec<String> = repeat_order(&points, 3).iter().map(|p| format!("{}{}", p.strategy.name(), p.ranks)).collect();
        assert_eq!(
            order,
            [
                "ring1", "ps1", "allreduce1", "ring2", "ps2", "allreduce2", // repeat 0: as planned
                "ps1", "allreduce1", "ring1", "ps2", "allreduce2", "ring2", // repeat 1: offset 1
                "allreduce1", "ring1", "ps1", "allreduce2", "ring2", "ps2", // repeat 2: offset 2
            ]
        );
        assert_eq!(repeat_order(&points, 1), points);
    }

    #[test]
    fn a_strong_study_checks_its_global_batch_at_every_point_before_the_first() {
        let all = parse_strategies("ring,ps").unwrap();
        // ps with one dedicated server trains on n - 1 ranks: 32 splits over 1 (at 2) but not 3 or 7.
        let strong = train_args(&["--scaling", "strong", "--global-batch", "32"]);
        let err = plan_points(&[1, 2, 4, 8], &all, &[1], &strong, false).unwrap_err().to_string();
        assert!(err.contains("--global-batch 32") && err.contains("ps at 4 rank(s) has 3, ps at 8 rank(s) has 7"), "{err}");
        assert!(!err.contains("ring at"), "{err}");
        // Colocated servers: every rank trains, and 32 splits at every point.
        let colocated = train_args(&["--scaling", "strong", "--global-batch", "32", "--ps-colocate"]);
        let (points, _) = plan_points(&[1, 2, 4, 8], &all, &[1], &colocated, false).unwrap();
        assert_eq!(points.len(), 8);
        // 24 splits over ps's 3 workers at 4 ranks, not its 7 at 8.
        let err = plan_points(&[1, 2, 4, 8], &all, &[1], &train_args(&["--scaling", "strong", "--global-batch", "24"]), false).unwrap_err().to_string();
        assert!(err.contains("ps at 8 rank(s) has 7") && !err.contains("ps at 4"), "{err}");
        // Weak scaling has nothing to divide; ps at one rank is left out with a warning.
        let (points, left_out) = plan_points(&[1, 2], &all, &[1], &train_args(&[]), false).unwrap();
        assert_eq!(points, vec![
            Point { ranks: 1, strategy: StrategyKind::Ring, stages: 1 },
            Point { ranks: 2, strategy: StrategyKind::Ring, stages: 1 },
            Point { ranks: 2, strategy: StrategyKind::Ps, stages: 1 },
        ]);
        assert!(matches!(left_out.as_slice(), [(log::Level::Warn, note)] if note.contains("ps at 1 rank(s)")), "{left_out:?}");
        // Pipelines: the replicas share the batch (8 ranks in 4 stages: 2 replicas).
        let piped = train_args(&["--scaling", "strong", "--global-batch", "6"]);
        let err = plan_points(&[2, 8], &parse_strategies("ring").unwrap(), &[1, 4], &piped, false).unwrap_err().to_string();
        assert!(err.contains("ring at 8 rank(s) has 8") && !err.contains("4 stages"), "{err}");
        let piped = train_args(&["--scaling", "strong", "--global-batch", "8"]);
        let (points, left_out) = plan_points(&[2, 8], &parse_strategies("ring").unwrap(), &[1, 4], &piped, false).unwrap();
        assert_eq!(points.len(), 3, "{points:?}");
        assert!(matches!(left_out.as_slice(), [(log::Level::Info, note)] if note.contains("4 pipeline stage(s) at 2 rank(s)")), "{left_out:?}");
        // A stage count that divides no rank count is refused by name, before any runs.
        let ring = parse_strategies("ring").unwrap();
        let err = plan_points(&[1, 2, 4], &ring, &[3], &train_args(&[]), false).unwrap_err().to_string();
        assert_eq!(err, "--stages 3: divides none of the rank counts of --ranks 1,2,4 (a pipeline of P stages runs at the rank counts that P divides)");
        let err = plan_points(&[2, 4], &ring, &[1, 2, 3, 5], &train_args(&[]), false).unwrap_err().to_string();
        assert!(err.starts_with("--stages 3,5: divides none"), "{err}");
        assert_eq!(plan_points(&[2, 3], &ring, &[2, 3], &train_args(&[]), false).unwrap().0.len(), 2);
        // A study whose every point is left out is refused too, saying why.
        let err = plan_points(&[1], &parse_strategies("ps").unwrap(), &[1], &train_args(&[]), false).unwrap_err().to_string();
        assert!(err.starts_with("the study has no point to run: skipping ps at 1 rank(s)"), "{err}");
        let piped = train_args(&["--scaling", "strong", "--global-batch", "4"]);
        let err = plan_points(&[2, 8], &parse_strategies("ring").unwrap(), &[1, 4], &piped, false).unwrap_err().to_string();
        assert!(err.contains("ring at 8 rank(s) has 8") && !err.contains("4 stages at 8 rank(s)"), "{err}");
    }

    #[test]
    fn a_point_that_does_not_combine_is_refused_before_the_first_runs() {
        let err = plan_points(&[2, 4], &parse_strategies("ring,ps").unwrap(), &[1, 2], &train_args(&[]), false).unwrap_err().to_string();
        assert!(err.contains("point ps in 2 stages at 2 rank(s): --strategy ps with --pipeline-stages"), "{err}");
        // The plain point of a pipeline study drops the pipeline's own options.
        let (points, _) = plan_points(&[2], &parse_strategies("ring").unwrap(), &[1, 2], &train_args(&["--recompute"]), false).unwrap();
        assert_eq!(points.len(), 2);
        let err = plan_points(&[2], &parse_strategies("ring,ps").unwrap(), &[1], &train_args(&["--overlap", "on"]), false).unwrap_err().to_string();
        assert!(err.contains("--overlap on with --strategy ps"), "{err}");
        // Horovod's options are its points' only.
        let (points, _) = plan_points(&[2], &parse_strategies("ring,horovod").unwrap(), &[1], &train_args(&["--compression", "fp16", "--timeline", "t.json"]), false).unwrap();
        assert_eq!(points.len(), 2);
    }
}
