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
    /// Rank counts of the sweep, comma-separated (each at most the launched ranks).
    #[arg(long, default_value = "1,2,4")]
    pub ranks: String,
    /// Strategies, comma-separated.
    #[arg(long, default_value = "ring,ps,allreduce,horovod")]
    pub strategies: String,
    /// Id tagging the study's runs in runs.jsonl [default: scaling mode and UTC time].
    #[arg(long)]
    pub study_id: Option<String>,
    /// Pipeline stages per point, each run at every rank count it divides (issue 36): 1 is
    /// plain data parallelism, P > 1 pipelines of P stages with --micro-batches and --schedule.
    #[arg(long, default_value = "1")]
    pub stages: String,
    /// Training options for every run (--strategy is set by the sweep).
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
    let id = broadcast_string(world, args.study_id.clone().unwrap_or_else(|| {
        format!("{}-{}", match args.train.scaling { Scaling::Weak => "weak", Scaling::Strong => "strong" }, chrono::Utc::now().format("%Y%m%dT%H%M%SZ"))
    }));
    if world.is_root() {
        log::info!("study {id}: {} scaling, ranks {ranks:?}, strategies {:?}", match args.train.scaling { Scaling::Weak => "weak", Scaling::Strong => "strong" }, strategies.iter().map(|s| s.name()).collect::<Vec<_>>());
    }
    let context = RunContext { study: Some(id.clone()) };
    let mut done = 0usize;
    for &n in &ranks {
        for (&strategy, &stages) in strategies.iter().flat_map(|s| stage_counts.iter().map(move |p| (s, p))) {
            let mut point = args.train.clone();
            point.strategy = strategy;
            if stage_counts != [1] {
                if n % stages != 0 {
                    if world.is_root() {
                        log::info!("study {id}: skipping {stages} pipeline stage(s) at {n} rank(s): they do not divide the ranks");
                    }
                    continue;
                }
                point.pipeline.pipeline_stages = stages as u64;
                if stages == 1 {
                    // The plain point of a pipeline study: the pipeline's own options do not apply.
                    point.pipeline.micro_batches = 1;
                    point.given = point.given.without(&["schedule", "virtual_stages", "partition", "recompute", "pipeline_timeline", "micro_batches"]);
                }
            }
            if strategy == StrategyKind::Ps && !point.ps.ps_colocate && n <= point.ps.servers {
                if world.is_root() {
                    log::warn!("study {id}: skipping ps at {n} rank(s): {} dedicated server(s) would leave no worker (use --ps-colocate to include it)", point.ps.servers);
                }
                continue;
            }
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
    }
    if world.is_root() {
        println!("study {id}: {done} run(s) appended to {}; tables and plots: hpc-train report --study {id}", crate::results::runs_path(&args.train.results).display());
    }
    Ok(())
}

/// Rank 0's string on every rank.
/// `--stages 1,2,4`: pipeline stage counts, each at least 1.
pub fn parse_stages(list: &str) -> Result<Vec<usize>> {
    let mut stages = Vec::new();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match item.parse::<usize>() {
            Ok(p) if p >= 1 => {
                if !stages.contains(&p) {
                    stages.push(p);
                }
            }
            _ => return Err(Error::usage(format!("--stages: {item:?} is not a number of pipeline stages (1 or more)"))),
        }
    }
    if stages.is_empty() {
        return Err(Error::usage("--stages: name at least one stage count"));
    }
    stages.sort_unstable();
    Ok(stages)
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
}
