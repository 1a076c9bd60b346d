//! The end of a run: the last checkpoint and weights, the figures over all ranks, and the
//! record rank 0 appends to runs.jsonl, with the summary rank 0 prints.

use std::path::Path;

use crate::error::{Error, Result};
use crate::exchange::Role;
use crate::model::InputSpec;
use crate::raw;
use crate::results::{self, RunRecord};

use super::checkpoints::CheckpointLog;
use super::collective::broadcast_step;
use super::memory;
use super::options::Scaling;
use super::plan::device_name;
use super::run::{Outcome, Run, RunContext};

impl Run<'_> {
    /// Writes what training ended with; rank 0 returns the record (None elsewhere). A run that a
    /// signal stopped ends in `Error::Stopped` (no record), one whose checkpoints failed in an
    /// error after its record.
    pub(super) fn record(mut self, out: Outcome, context: &RunContext) -> Result<Option<RunRecord>> {
        let (world, args) = (self.world, self.args);
        let rss_end = raw::current_rss_mb();
        let is_worker = matches!(self.exchange.role(), Role::Worker { .. });
        // A last checkpoint where training ended (at the end, or where a signal stopped it).
        if is_worker && out.saved_at != Some(out.last_step) {
            self.save_checkpoint(out.last_step)?;
        }
        if let Some(path) = &args.save_weights {
            self.save_weights(path, out.last_step)?;
        }
        if let (Some(pipeline), Some(path)) = (self.layout.pipeline(), &args.pipeline.pipeline_timeline) {
            // With tensor parallelism, the timeline of the groups' first ranks (the others run
            // the same schedule).
            let first_place = self.layout.tensor.as_ref().is_none_or(|tp| tp.rank == 0);
            world.agree(if first_place { pipeline.write_timeline(self.pipeline_world(), path) } else { Ok(()) })?;
        }
        let last_step = broadcast_step(&world.comm, Some(out.last_step)).unwrap_or(out.last_step);
        let checkpointed = broadcast_step(&world.comm, self.checkpoints.newest_good) == Some(last_step);
        let failed_checkpoints = world.sum_f64(self.checkpoints.failed.len() as f64) > 0.0;
        // Rank 0 knows how the checkpoints went; the others exit with its verdict.
        let verdict = |log: &CheckpointLog| match (world.is_root(), &args.checkpoint_dir) {
            (true, Some(dir)) => log.verdict(dir).map_err(|e| Error::Agreed(Box::new(e))),
            _ => Err(Error::Reported(0)),
        };
        if world.sum_f64(if out.stopped { 1.0 } else { 0.0 }) > 0.0 {
            if world.is_root() {
                let state = match (&args.checkpoint_dir, checkpointed) {
                    (Some(dir), true) => format!("checkpoint at step {last_step} in {}: continue with --resume", dir.display()),
                    (Some(_), false) => format!("the checkpoint at step {last_step} could not be written"),
                    (None, _) => "nothing was saved (no --checkpoint-dir) and no record written".to_string(),
                };
                println!("hpc-train: stopped by a signal after step {last_step} of {}; {state}", self.total_steps);
            }
            if failed_checkpoints {
                return verdict(&self.checkpoints).map(|()| None);
            }
            return Err(Error::Stopped { checkpointed });
        }
        let record = self.figures(&out, rss_end, is_worker, context);
        if let Some(record) = &record {
            let runs = results::runs_path(&args.results);
            results::append_json_line(&runs, record)?;
            print_summary(record, self.spec, &runs);
        }
        if failed_checkpoints {
            // The record stands (training finished); the job still fails, so that nobody takes
            // the missing checkpoints for written ones.
            return verdict(&self.checkpoints).map(|()| None);
        }
        // Likewise for an output the strategy could not write in full (Horovod's timeline on
        // a full disk): said by the rank that writes it, every rank exits non-zero.
        let incomplete = self.exchange.output_failure().map_or(Ok(()), |why| Err(Error::Results(why)));
        world.agree(incomplete)?;
        Ok(record)
    }

    /// The run's figures over all ranks (every rank takes part); the record on rank 0.
    fn figures(&self, out: &Outcome, rss_end: f64, is_worker: bool, context: &RunContext) -> Option<RunRecord> {
        let (world, args, plan, m) = (self.world, self.args, &self.plan, &out.measured);
        // Throughput counts the measured steps' own time (evaluation excluded), on the slowest worker.
        let wall = world.max_f64(m.step.as_secs_f64());
        // Every rank of a pipeline is a worker; parameter servers are not.
        let worker_ranks = world.sum_f64(if is_worker { 1.0 } else { 0.0 }).max(1.0);
        let mean_over_workers = |v: f64| world.sum_f64(if is_worker { v } else { 0.0 }) / worker_ranks;
        let images_per_sec = if wall > 0.0 { m.samples as f64 / wall } else { 0.0 };
        let [step_ms, compute_ms, comm_ms, data_wait_ms, optimizer_ms] =
            [m.step, m.compute, m.comm, m.data_wait, m.optimizer].map(|d| mean_over_workers(m.mean_ms(d)));
        let (peak_rss_mb, rss_warmup_mb, rss_end_mb) = (world.max_f64(raw::peak_rss_mb()), world.max_f64(out.rss_warmup), world.max_f64(rss_end));
        // With overlap: exchange time per step, and the share of it that ran while backward was
        // still going (the rest is exposed after backward).
        let overlap_figures = self.layout.overlap().map(|o| {
            let total = mean_over_workers(m.mean_ms(m.exchange_total));
            let exposed = mean_over_workers(m.mean_ms(m.exchange_exposed));
            let hidden = if total > 0.0 { ((total - exposed.min(total)) / total).max(0.0) } else { 0.0 };
            (o.buckets(), total, hidden)
        });
        let report = self.exchange.report();
        // Memory held between steps (after the last one), the largest over the ranks.
        let held = self.exchange.held_bytes(&self.net.params, &self.optimizer);
        let (optimizer_state_bytes, gradient_bytes) = (world.max_f64(held.optimizer_state as f64), world.max_f64(held.gradients as f64));
        let cached_image_bytes = if self.cache_data { (self.info.train.len * self.info.sample_bytes()) as u64 } else { 0 };
        let pipeline = self.layout.pipeline().map(|p| crate::results::PipelineRecord { ranks: p.ranks_record(world, cached_image_bytes), ..p.record(self.pipeline_world(), args) });
        let parameters = match (&self.layout.tensor, self.layout.pipeline(), self.layout.fsdp()) {
            // A rank holds its part of each cut parameter: the whole model's count.
            (Some(_), _, _) => self.args.model.parameters_for(self.spec) as usize,
            // Each stage's parameters once (from the first pipeline; as declared, since under
            // --zero 3 they are empty between steps).
            (None, Some(p), _) => world.sum_f64(if p.replica == 0 { self.net.held_elements() as f64 } else { 0.0 }) as usize,
            // Stage 3's parameters are empty between steps; the units know their sizes.
            (None, None, Some(f)) => f.units.iter().map(|u| u.layout.len).sum::<usize>(),
            (None, None, None) => self.net.params.iter().map(|p| p.numel()).sum::<usize>(),
        };
        // Stage 3 (units, or a pipeline stage's one): the largest over the ranks of what each
        // holds and gathers.
        let fsdp_bytes = report.extra.contains_key("parameter_bytes_held").then(|| {
            let max_of = |key: &str| world.max_f64(report.extra.get(key).and_then(|v| v.as_f64()).unwrap_or(0.0)) as u64;
            (max_of("parameter_bytes_held"), max_of("peak_gathered_parameter_bytes"))
        });
        // --tensor-parallel: the parameters this rank holds (its part), the largest over the
        // ranks, and the group's all-reduces per measured step.
        let tensor_parallel = self.layout.tensor.as_ref().map(|tp| {
            let held = world.max_f64((self.net.held_elements() * 4) as f64) as u64;
            let steps = tp.measured_steps.max(1) as f64;
            let ms = mean_over_workers(tp.measured.time.as_secs_f64() * 1e3 / steps);
            (tp, held, ms)
        });
        let memory_by_phase = memory_by_phase(world);
        // What the resume read (every rank its own slices: bytes in all, the slowest rank's
        // seconds), and what the checkpoints' writes cost (the same figures on every rank).
        let resume_read = self.checkpoints.resume_read.as_ref().map(|stats| {
            let read = stats.get();
            (world.sum_f64(read.bytes as f64) as u64, world.max_f64(read.seconds))
        });
        if !world.is_root() {
            return None;
        }
        let mut extra = report.extra.clone();
        let log = &self.checkpoints;
        if log.written > 0 {
            extra.insert("checkpoint_writes".into(), log.written.into());
            extra.insert("checkpoint_write_bytes".into(), log.written_bytes.into());
            extra.insert("checkpoint_write_s".into(), log.written_seconds.into());
        }
        if !memory_by_phase.is_empty() {
            extra.insert("peak_rss_mb_by_phase".into(), memory_by_phase.into());
        }
        if let Some((bytes, seconds)) = resume_read {
            extra.insert("resume_read_bytes".into(), bytes.into());
            extra.insert("resume_read_s".into(), seconds.into());
        }
        if let Some((tp, held, ms)) = tensor_parallel {
            let last = tp.last_step;
            extra.insert("tensor_parallel".into(), tp.layout.tensor.into());
            extra.insert("layout".into(), serde_json::json!({ "data": tp.layout.data, "pipeline": tp.layout.pipeline, "tensor": tp.layout.tensor }));
            extra.insert("tp_allreduce".into(), tp.strategy.into());
            extra.insert("parameter_bytes_held".into(), held.into());
            extra.insert("tp_allreduce_ms".into(), ms.into());
            // The last training step's (the figures of a full batch, unless the epoch's last).
            extra.insert("tp_allreduce_calls".into(), last.calls.into());
            extra.insert("tp_allreduce_elements".into(), last.elements.into());
            extra.insert("tp_bytes_sent".into(), (last.bytes as f64 * tp.bus_factor).round().into());
        }
        extra.entry("zero").or_insert(0.into());
        extra.insert("optimizer_state_bytes".into(), (optimizer_state_bytes as u64).into());
        extra.insert("gradient_bytes".into(), (gradient_bytes as u64).into());
        extra.insert("overlap".into(), (self.layout.overlap().is_some() || self.layout.fsdp().is_some_and(|f| f.prefetch)).into());
        extra.insert("overlap_reason".into(), self.overlap_choice.reason.clone().into());
        if let Some(trial) = self.overlap_choice.measured {
            extra.insert("overlap_trial_with_ms".into(), trial.with_overlap_ms.into());
            extra.insert("overlap_trial_without_ms".into(), trial.without_ms.into());
        }
        if let Some((held, gathered)) = fsdp_bytes {
            // (A pipeline stage is its own one unit: the record's pipeline says which.)
            if let Some(f) = self.layout.fsdp() {
                extra.insert("fsdp_unit".into(), f.size.name().into());
            }
            extra.insert("parameter_bytes_held".into(), held.into());
            extra.insert("peak_gathered_parameter_bytes".into(), gathered.into());
        }
        // The steps the throughput counts, and those before them (warm-up, `--overlap auto`'s
        // trial): a reader of the record sees how many steps its figures rest on.
        extra.insert("measured_steps".into(), m.steps.into());
        // fp16: the steps the loss scaler skipped count in the time but moved no weight.
        if let Some((skipped, scale)) = out.loss_scaler {
            extra.insert("fp16_skipped_steps".into(), skipped.into());
            extra.insert("loss_scale_final".into(), scale.into());
        }
        extra.insert("warmup_steps".into(), out.totals.steps.saturating_sub(m.steps).into());
        if let Some(preset) = args.preset {
            extra.insert("preset".into(), preset.name().into());
        }
        extra.insert("precision".into(), serde_json::to_value(args.precision).unwrap_or_default());
        extra.insert("channels_last".into(), args.channels_last.into());
        if args.recipe.scale_lr != crate::optim::ScaleLr::None {
            extra.insert("scale_lr".into(), serde_json::to_value(args.recipe.scale_lr).unwrap_or_default());
            extra.insert("base_lr".into(), args.recipe.lr.into());
            extra.insert("base_batch".into(), args.recipe.base_batch.into());
        }
        if args.recipe.label_smoothing > 0.0 {
            extra.insert("label_smoothing".into(), args.recipe.label_smoothing.into());
        }
        extra.insert("data_cached".into(), self.cache_data.into());
        if out.last_eval.is_some() {
            extra.insert("evaluation_s".into(), out.evaluation.as_secs_f64().into());
        }
        // What every step's exchange carries (the cost model's projections and validation read it).
        extra.insert("parameters".into(), parameters.into());
        if let Some((buckets, total, hidden)) = overlap_figures {
            extra.insert("overlap_buckets".into(), buckets.into());
            extra.insert("exchange_total_ms".into(), total.into());
            extra.insert("exchange_hidden_share".into(), hidden.into());
        }
        if self.first_step > 0 {
            extra.insert("resumed_from_step".into(), self.first_step.into());
        }
        let steps_run = self.total_steps.saturating_sub(self.first_step);
        let info = &self.info;
        Some(RunRecord {
            strategy: self.exchange.name().into(),
            ranks: world.size as usize,
            workers: self.workers,
            nodes: world.nodes() as usize,
            model: args.model.name().into(),
            dataset: info.meta.name.clone(),
            image_shape: vec![info.meta.channels, info.meta.height, info.meta.width],
            batch_per_rank: plan.batch,
            global_batch: self.global_batch,
            scaling: match args.scaling { Scaling::Weak => "weak".into(), Scaling::Strong => "strong".into() },
            steps: steps_run,
            epochs: steps_run as f64 / self.steps_per_epoch as f64,
            images_per_sec,
            step_ms,
            compute_ms,
            comm_ms,
            data_wait_ms,
            optimizer_ms,
            final_loss: out.final_loss,
            test_accuracy: out.last_eval.map(|e| e.1),
            test_loss: out.last_eval.map(|e| e.0),
            device: device_name(plan.device),
            mpi_library: mpi_library(),
            cuda_aware: plan.cuda_aware,
            data_path: report.data_path.map(|p| format!("{p:?}").to_lowercase()),
            threads: plan.threads,
            bucket_mb: args.exchange.bucket_mb,
            peak_rss_mb,
            rss_warmup_mb,
            rss_end_mb,
            host: raw::hostname(),
            git_commit: results::GIT_COMMIT.into(),
            timestamp: results::timestamp(),
            study: context.study.clone(),
            optimizer: Some(args.recipe.optimizer.name().into()),
            lr_schedule: Some(self.optimizer.schedule().describe(self.steps_per_epoch)),
            final_lr: Some(self.optimizer.lr()),
            accuracy_by_epoch: out.accuracy_by_epoch.clone(),
            target_accuracy: args.recipe.target_accuracy,
            time_to_target_s: out.reached_target.map(|r| r.0),
            epoch_to_target: out.reached_target.map(|r| r.1),
            pipeline,
            extra,
            rerun: results::Rerun { config: Some(args.run_config.to_json()), argv: std::env::args().collect() },
            hardware: crate::results::HardwareRecord {
                cores_per_node: crate::model::flops::node_cores(),
                gpus_per_node: tch::Cuda::device_count().max(0) as usize,
                device_model: crate::model::flops::device_model(plan.device.is_cuda()),
                forward_flops_per_image: crate::model::flops::forward_flops(args.model, self.spec),
                core_gflops: context.core_gflops,
                repeat: context.repeat,
            },
        })
    }
}

/// Every rank's peak resident memory in each phase of the run (memory.rs), as
/// `{"set-up": [rank 0's MiB, rank 1's, ...], "training": [...], ...}` on rank 0; a rank that
/// never entered a phase has null there. Collective over `world`. Empty where the kernel could
/// not tell the phases apart.
fn memory_by_phase(world: &crate::topology::World) -> serde_json::Map<String, serde_json::Value> {
    use mpi::traits::*;
    let peaks = memory::peaks();
    let mine: Vec<f64> = memory::Phase::ALL.iter().map(|&phase| peaks.iter().find(|(p, _)| *p == phase).map_or(-1.0, |(_, mb)| *mb)).collect();
    let mut all = vec![0.0; mine.len() * world.size as usize];
    crate::watchdog::collective("gathering the memory peaks", &world.comm, || world.comm.all_gather_into(&mine[..], &mut all[..]));
    let mut by_phase = serde_json::Map::new();
    for (i, phase) in memory::Phase::ALL.iter().enumerate() {
        let ranks: Vec<Option<f64>> = all.chunks(mine.len()).map(|r: &[f64]| (r[i] >= 0.0).then(|| (r[i] * 10.0).round() / 10.0)).collect();
        if ranks.iter().any(Option::is_some) {
            by_phase.insert(phase.name().into(), serde_json::json!(ranks));
        }
    }
    by_phase
}

pub fn mpi_library() -> String {
    crate::mpi_library::runtime_library()
}

pub(super) fn print_summary(r: &RunRecord, spec: InputSpec, runs: &Path) {
    println!(
        "hpc-train: {} on {} rank(s) ({} worker(s), {} node(s)), {} on {} [{}x{}x{}], batch {}/rank = {} global, {} scaling",
        r.strategy, r.ranks, r.workers, r.nodes, r.model, r.dataset, spec.channels, spec.height, spec.width,
        r.batch_per_rank, r.global_batch, r.scaling
    );
    println!(
        "  {} steps ({:.2} epochs): {:.1} images/s; per step {:.1} ms = compute {:.1} + exchange {:.1} + optimizer {:.1} + data wait {:.2}",
        r.steps, r.epochs, r.images_per_sec, r.step_ms, r.compute_ms, r.comm_ms, r.optimizer_ms, r.data_wait_ms
    );
    let accuracy = match (r.test_accuracy, r.test_loss) {
        (Some(a), Some(l)) => format!("test accuracy {:.2}% (loss {l:.4})", a * 100.0),
        _ => "no test evaluation".into(),
    };
    println!("  final training loss {:.4}, {accuracy}", r.final_loss);
    println!(
        "  device {} ({} thread(s)/rank), {}, data path {}, peak RSS {:.0} MiB",
        r.device, r.threads, r.mpi_library, r.data_path.as_deref().unwrap_or("-"), r.peak_rss_mb
    );
    println!("  appended to {}", runs.display());
}