//! The options of a training run (`hpc-train [OPTIONS]`, and every point of a `study`), with
//! the settings types they are made of; the run's `Plan` resolves them against the world.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use crate::data::loader::CacheData;
use crate::error::{Error, Result};
use crate::exchange::config::StrategyKind;
use crate::exchange::options::{check_strategy_options, ExchangeArgs, Given, HorovodArgs, PsArgs, WatchdogArgs};
use crate::model::ModelKind;

use super::recipe::RecipeArgs;
use super::stages::PipelineArgs;
use crate::plan::fsdp::UnitSize;

/// Options of a training run.
#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    /// Read the training options from this run file (TOML; sections as --print-config writes
    /// them, a key being an option's long name with _ for -). Options on the command line win
    /// over the file's, the file's over --preset's.
    #[arg(long, value_name = "FILE.toml", help_heading = "Run")]
    pub config: Option<PathBuf>,

    /// Print the resolved training options as a run file that --config reads, and exit.
    #[arg(long, help_heading = "Run")]
    pub print_config: bool,

    /// Defaults for a purpose; any option given on the command line wins over the preset's:
    /// resnet50-throughput (ResNet-50 on generated 3x224x224 images, 1000 classes, batch 64 per
    /// rank, 10 warm-up and 100 measured steps, no evaluation), cpu-trial (the tiny CNN on
    /// generated 3x32x32 images, 10 classes, batch 32, 5 warm-up and 20 measured steps: a
    /// `study` of 1, 2 and 4 ranks in minutes on a laptop).
    #[arg(long, value_enum, help_heading = "Run")]
    pub preset: Option<Preset>,

    /// Seed for weights and data order (the same on every rank).
    #[arg(long, default_value_t = 42, help_heading = "Run")]
    pub seed: u64,

    /// Intra-op threads per rank; 0 = the cores this rank may use divided by the ranks on its node.
    #[arg(long, default_value_t = 0, help_heading = "Run")]
    pub threads: usize,

    /// Where to train.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto, help_heading = "Run")]
    pub device: DeviceChoice,

    /// Let several ranks of a node share one GPU (for testing on a machine with fewer GPUs).
    #[arg(long, help_heading = "Run")]
    pub allow_gpu_sharing: bool,

    /// Dataset file in the project's HDF5 layout (see `hpc-train data`).
    #[arg(long, default_value = "datasets/fashion-mnist.h5", help_heading = "Data")]
    pub data: PathBuf,

    /// Samples per rank per step (weak scaling).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Data")]
    pub batch_size: u64,

    /// Weak scaling keeps --batch-size per rank; strong scaling splits --global-batch over the ranks.
    #[arg(long, value_enum, default_value_t = Scaling::Weak, help_heading = "Data")]
    pub scaling: Scaling,

    /// Samples per step over all ranks (strong scaling).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Data")]
    pub global_batch: Option<u64>,

    /// Epochs to train.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Data")]
    pub epochs: u64,

    /// Stop after this many steps in all (overrides --epochs).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Data")]
    pub steps: Option<u64>,

    /// Train --skip-steps steps, then this many measured ones (tf_cnn_benchmarks'
    /// --num_batches): a length that is the same at every rank count.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), conflicts_with_all = ["steps", "epochs"], help_heading = "Data")]
    pub measured_steps: Option<u64>,

    /// Steps at the start left out of the throughput figures (the learning-rate warm-up is
    /// --warmup-epochs); formerly --warmup-steps.
    #[arg(long = "skip-steps", value_name = "STEPS", aliases = ["warmup-steps"], default_value_t = 5, help_heading = "Data")]
    pub warmup_steps: u64,

    /// Batches the loader thread reads ahead.
    #[arg(long, default_value_t = 4, help_heading = "Data")]
    pub prefetch: usize,

    /// Hold the training split in memory, read once, instead of reading each batch's samples
    /// from the file.
    #[arg(long, value_enum, default_value_t = CacheData::Auto, help_heading = "Data")]
    pub cache_data: CacheData,

    /// Skip the test-set evaluation at the end of each epoch.
    #[arg(long, help_heading = "Data")]
    pub no_eval: bool,

    /// Record the sample indices each rank trains on, one file per rank in this folder (checks).
    #[arg(long, hide = true, help_heading = "Data")]
    pub trace_samples: Option<PathBuf>,

    /// Model to train.
    #[arg(long, value_enum, default_value_t = ModelKind::Resnet50, help_heading = "Model and optimizer")]
    pub model: ModelKind,

    #[command(flatten, next_help_heading = "Model and optimizer")]
    pub recipe: RecipeArgs,

    /// Arithmetic: fp32, tf32 (TF32 matrix units, CUDA only), bf16 or fp16 (training forwards
    /// under autocast, on CUDA or the CPU; fp16 with a dynamic loss scaler). Evaluation is fp32.
    #[arg(long, value_enum, default_value_t = Precision::Fp32, help_heading = "Model and optimizer")]
    pub precision: Precision,

    /// With --precision fp16: the loss scaler's first scale (torch.amp.GradScaler's
    /// init_scale); it halves on every overflow and doubles after 2000 steps without one.
    #[arg(long, default_value_t = 65536.0, help_heading = "Model and optimizer")]
    pub loss_scale: f64,

    /// Keep activations and convolution weights in channels-last (NHWC) memory order.
    #[arg(long, help_heading = "Model and optimizer")]
    pub channels_last: bool,

    /// Start from these weights instead of the seeded ones: a safetensors file of the model's
    /// variables by their torchvision names, as --save-weights and checkpoints write them.
    #[arg(long, help_heading = "Model and optimizer")]
    pub init_weights: Option<PathBuf>,

    /// Gradient-exchange strategy.
    #[arg(long, value_enum, default_value_t = StrategyKind::Ring, help_heading = "Exchange")]
    pub strategy: StrategyKind,

    #[command(flatten, next_help_heading = "Exchange")]
    pub exchange: ExchangeArgs,

    /// Exchange gradient buckets while backward is still running (gradient-ready hooks).
    #[arg(long, value_enum, default_value_t = OnOff::Auto, help_heading = "Exchange")]
    pub overlap: OnOff,

    #[command(flatten, next_help_heading = "Horovod")]
    pub horovod: HorovodArgs,

    #[command(flatten, next_help_heading = "Parameter server")]
    pub ps: PsArgs,

    #[command(flatten, next_help_heading = "Pipeline")]
    pub pipeline: PipelineArgs,

    /// ZeRO stage (ring, rhd on a power of two of ranks, auto): 1 shards the optimizer state
    /// (momentum) over the ranks, 2 also the gradients held between steps, 3 also the
    /// parameters (fully sharded data parallelism: each unit gathered while it computes); 0
    /// keeps everything on every rank.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3), help_heading = "Sharding and tensor parallelism")]
    pub zero: u8,

    /// With --zero 3: what a unit of sharding is (gathered whole while it computes): each
    /// block (ResNet's stem, residual blocks and head), each stage (layer1..layer4), or the model.
    #[arg(long, value_enum, default_value_t = UnitSize::Block, help_heading = "Sharding and tensor parallelism")]
    pub fsdp_unit: UnitSize,

    /// With --zero 3: shard over each node's ranks and keep one copy of the shards per node
    /// (FSDP's HYBRID_SHARD): gathers stay inside the node, only reduced shards cross nodes.
    #[arg(long, help_heading = "Sharding and tensor parallelism")]
    pub fsdp_hybrid: bool,

    /// Tensor parallelism (Megatron-LM) over groups of this many consecutive ranks: each
    /// encoder layer of a transformer (--model vit-b16, vit-tiny) cut by attention heads and
    /// MLP columns, the ranks of a group computing one replica together; --strategy averages
    /// the gradients over the groups. 1: off.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Sharding and tensor parallelism")]
    pub tensor_parallel: u32,

    /// With --tensor-parallel: the all-reduce of the groups' partial sums and gradients.
    #[arg(long, value_enum, default_value_t = TpAllreduce::Auto, help_heading = "Sharding and tensor parallelism")]
    pub tp_allreduce: TpAllreduce,

    #[command(flatten, next_help_heading = "Checkpoints and faults")]
    pub watchdog: WatchdogArgs,

    /// Folder for checkpoints (weights and optimizer state; every rank writes its part, so every
    /// rank must see it; with --strategy ps rank 0 writes them whole).
    #[arg(long, help_heading = "Checkpoints and faults")]
    pub checkpoint_dir: Option<PathBuf>,

    /// Steps between checkpoints (a checkpoint is also written at the end, or when a signal stops training).
    #[arg(long, default_value_t = 500, help_heading = "Checkpoints and faults")]
    pub checkpoint_every: u64,

    /// Good checkpoints kept, the newest written counted (older ones are removed once a newer one
    /// is complete; the one resumed from stays).
    #[arg(long, default_value_t = 3, help_heading = "Checkpoints and faults")]
    pub keep_checkpoints: usize,

    /// Continue from the newest complete checkpoint in --checkpoint-dir (from the start when there
    /// is none; refused when every one there is damaged). Without it, a --checkpoint-dir that
    /// holds checkpoints is refused.
    #[arg(long, help_heading = "Checkpoints and faults")]
    pub resume: bool,

    /// Folder for runs.jsonl and other results.
    #[arg(long, default_value = "results", help_heading = "Output")]
    pub results: PathBuf,

    /// Log a progress line every this many steps (when no progress bar is shown).
    #[arg(long, default_value_t = 50, help_heading = "Output")]
    pub log_every: u64,

    /// Write the final weights (safetensors, loadable from PyTorch) to this file.
    #[arg(long, help_heading = "Output")]
    pub save_weights: Option<PathBuf>,

    /// The study id that tags this run's record in runs.jsonl, as `study` and `report --study`
    /// name it (job scripts group their runs so) [default: none; a study makes one].
    #[arg(long = "study", value_name = "ID", aliases = ["study-tag", "study-id"], help_heading = "Output")]
    pub study_tag: Option<String>,

    /// Which run of its point this is, with --study (job scripts' REPEATS): the report
    /// takes a point's runs of distinct repeat indices as repeats (median with range), and a
    /// later run of the same index as a replacement.
    #[arg(long, value_name = "N", requires = "study_tag", help_heading = "Output")]
    pub repeat_index: Option<u32>,

    /// Profile --profile-steps steps from the first measured one (after --skip-steps) with
    /// libtorch's profiler, as torch.profiler does: host ops and, on a GPU, CUDA kernels and
    /// copies; one Chrome trace per rank in this folder (rank-R.json: Perfetto, TensorBoard,
    /// scripts/trace_summary.py).
    #[arg(long, help_heading = "Output")]
    pub profile_dir: Option<PathBuf>,

    /// Steps profiled with --profile-dir.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Output")]
    pub profile_steps: u64,

    /// The options given on the command line or in the run file.
    #[arg(skip)]
    pub given: Given,

    /// The resolved options as a run file, and the file read (see crate::config).
    #[arg(skip)]
    pub run_config: RunConfig,

}

impl TrainArgs {
    /// Steps in all for a training split of `steps_per_epoch` steps: --steps, or --skip-steps
    /// and --measured-steps, or --epochs.
    pub fn total_steps(&self, steps_per_epoch: u64) -> u64 {
        match (self.steps, self.measured_steps) {
            (Some(steps), _) => steps,
            (None, Some(measured)) => self.warmup_steps + measured,
            (None, None) => self.epochs * steps_per_epoch,
        }
    }

    /// The step counts of a run from its first step on a training split of `samples` with
    /// `workers` x `batch` samples per step: all, warm-up, measured. The warm-up is
    /// --skip-steps, leaving at least one step measured, as the step loop counts it
    /// (src/train/step.rs; `--overlap auto`'s trial on CPU ranks may lengthen it).
    pub fn step_counts(&self, samples: usize, workers: usize, batch: usize) -> StepCounts {
        let steps_per_epoch = samples.div_ceil(workers * batch) as u64;
        let total = self.total_steps(steps_per_epoch);
        let warmup = self.warmup_steps.min(total.saturating_sub(1));
        StepCounts { total, warmup, measured: total - warmup }
    }

    /// [`check_strategy_options`] for a run of `strategies` (one, or a study's), and the
    /// checkpoint options that mean nothing without --checkpoint-dir.
    pub fn check_unused_options(&self, strategies: &[StrategyKind]) -> Result<Vec<String>> {
        if self.checkpoint_dir.is_none() {
            for (id, flag) in [("checkpoint_every", "--checkpoint-every"), ("keep_checkpoints", "--keep-checkpoints")] {
                if self.given.has(id) {
                    return Err(Error::usage(format!("{flag} without --checkpoint-dir: no checkpoint is written; add --checkpoint-dir DIR")));
                }
            }
        }
        self.recipe.check(&self.given)?;
        check_strategy_options(&self.given, strategies, &self.ps)
    }
}

/// A run's step counts ([`TrainArgs::step_counts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepCounts {
    pub total: u64,
    pub warmup: u64,
    pub measured: u64,
}

/// `--preset`: defaults for a purpose, as a table of options and values (command-line flags
/// without their dashes, and their text) that [`TrainArgs::apply_preset`] sets where the
/// command line does not.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// ResNet-50 throughput as tf_cnn_benchmarks measures it: generated ImageNet-sized images.
    #[value(name = "resnet50-throughput")]
    Resnet50Throughput,
    /// A whole path tried on a laptop's CPU cores in minutes.
    #[value(name = "cpu-trial")]
    CpuTrial,
}

impl Preset {
    pub fn name(self) -> &'static str {
        match self {
            Preset::Resnet50Throughput => "resnet50-throughput",
            Preset::CpuTrial => "cpu-trial",
        }
    }

    /// The options the preset sets. resnet50-throughput takes tf_cnn_benchmarks' defaults
    /// (--num_warmup_batches 10, --num_batches 100, --batch_size 64 per GPU for ResNet-50 in
    /// fp32): 10 steps cover cuDNN's algorithm search, the allocator's growth and the first
    /// exchanges' connections, and 100 measured steps make the mean steady at every rank count
    /// (an epoch-based length shrinks as ranks are added: one epoch of a small dataset left a
    /// single measured step at 64 ranks). Images are generated (no file, no reading cost), and
    /// nothing is evaluated. cpu-trial is sized for two cores: the tiny CNN at batch 32 takes a
    /// few milliseconds per step, so a 1-2-4 rank study of every strategy takes minutes.
    pub fn options(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Preset::Resnet50Throughput => &[
                ("model", "resnet50"),
                ("data", "synthetic:3x224x224:1000"),
                ("batch-size", "64"),
                ("skip-steps", "10"),
                ("measured-steps", "100"),
                ("no-eval", "true"),
            ],
            Preset::CpuTrial => &[
                ("model", "tiny"),
                ("data", "synthetic:3x32x32:10:50000"),
                ("batch-size", "32"),
                ("skip-steps", "5"),
                ("measured-steps", "20"),
                ("no-eval", "true"),
            ],
        }
    }
}

/// `--scaling`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scaling {
    /// Every rank keeps --batch-size: the global batch grows with the ranks.
    Weak,
    /// --global-batch is split over the ranks.
    Strong,
}

/// `--precision`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    Tf32,
    Bf16,
    Fp16,
}

impl Precision {
    /// Runs a training forward (and its loss) as the precision says: under autocast to bf16 or
    /// fp16 on `device`'s type, or as it is (fp32 and tf32 make no autocast call at all). Every
    /// layout's training forwards go through here (the plain step, the pipeline's forwards and
    /// recomputed forwards, --zero 3's units, tensor-parallel parts), so that none computes in
    /// another precision than its record says; evaluation does not (it is fp32 everywhere).
    pub(crate) fn training_forward<T>(self, device: tch::Device, forward: impl FnOnce() -> Result<T>) -> Result<T> {
        match self {
            Precision::Bf16 => crate::raw::with_autocast(device, crate::raw::HalfType::Bf16, forward),
            Precision::Fp16 => crate::raw::with_autocast(device, crate::raw::HalfType::Fp16, forward),
            Precision::Fp32 | Precision::Tf32 => forward(),
        }
    }
}

/// `--tp-allreduce`: hpc-train's own all-reduces, as `--strategy` names them.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpAllreduce {
    /// The cost model's choice by size (ring, recursive halving-doubling or doubling).
    Auto,
    Ring,
    /// Recursive halving-doubling.
    Rhd,
}

impl TpAllreduce {
    pub fn strategy(self) -> StrategyKind {
        match self {
            TpAllreduce::Auto => StrategyKind::Auto,
            TpAllreduce::Ring => StrategyKind::Ring,
            TpAllreduce::Rhd => StrategyKind::Rhd,
        }
    }
}

/// `--overlap`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnOff {
    /// On for a GPU rank (the GPU computes backward while the CPU exchanges); on CPU ranks both
    /// modes are timed over the first steps, every rank alike, and the faster kept (the exchange's
    /// copies and additions compete with backward for the cores). The log and the record's
    /// `overlap_reason` say which and why.
    Auto,
    On,
    Off,
}

/// `--device`: where to train.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The rank's GPU when CUDA is available, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

/// The training options of a command line, parsed as `hpc-train` parses them (for unit tests).
#[cfg(test)]
pub(crate) fn parse_train_args(extra: &[&str]) -> TrainArgs {
    use clap::Parser;
    #[derive(Parser)]
    struct Command {
        #[command(flatten)]
        train: TrainArgs,
    }
    let mut argv = vec!["hpc-train"];
    argv.extend(extra);
    Command::try_parse_from(argv).unwrap().train
}

/// Where the run's options came from, beside the parsed [`TrainArgs`]: the resolved table (what
/// `--print-config` prints and a record holds) and the options that a run file set. Made by
/// crate::config, which reads and writes run files.
#[derive(Clone, Debug, Default)]
pub struct RunConfig {
    /// The resolved options by section, as a run file holds them.
    pub table: toml::Table,
    /// The run file read, if any, and the long names of the options it set (an error about one
    /// of them names the file).
    pub file: Option<(PathBuf, std::collections::BTreeSet<String>)>,
    /// Deprecated names the file used (one warning each).
    pub warnings: Vec<String>,
}

impl RunConfig {
    /// The table as TOML text that `--config` reads back.
    pub fn to_toml(&self) -> String {
        toml::to_string(&self.table).expect("a table of strings, numbers, booleans and arrays serializes")
    }

    /// The table as JSON, for runs.jsonl.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(&self.table).expect("a TOML table of plain values is JSON")
    }

    /// `message` (an error about the run's options) with the run file named where it is about
    /// an option that the file set and the command line did not: "the key that a layout cannot
    /// use is refused, naming the key and the file".
    pub fn attribute(&self, message: &str) -> String {
        let Some((path, longs)) = &self.file else { return message.to_string() };
        // The flag the message is about: the first one it names.
        let named = message.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-')).find(|w| w.starts_with("--") && w.len() > 2);
        match named.map(|flag| &flag[2..]) {
            Some(long) if longs.contains(long) => format!("{message} (key `{}` of {})", run_file_key(long), path.display()),
            _ => message.to_string(),
        }
    }
}

/// An option's key in a run file: its long name with `_` for `-`.
pub fn run_file_key(long: &str) -> String {
    long.replace('-', "_")
}
