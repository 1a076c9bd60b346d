//! The options of a training run (`hpc-train [OPTIONS]`, and every point of a `study`), with
//! the settings types they are made of; the run's `Plan` resolves them against the world.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use crate::data::loader::CacheData;
use crate::error::{Error, Result};
use crate::exchange::config::{CudaAware, MpiAllreduceCall, RingTransport, StrategyKind};
use crate::exchange::options::{check_strategy_options, Given, HorovodArgs, PsArgs};
use crate::model::ModelKind;

use super::recipe::RecipeArgs;
use super::stages::PipelineArgs;
use crate::plan::fsdp::UnitSize;

/// The exchange watchdog's default: far beyond any one exchange on a working cluster (a 100 MB
/// bucket over a 1 Gbit/s link takes about a second; the first exchange may also set up
/// connections), and far below a batch job's time limit.
pub const DEFAULT_EXCHANGE_TIMEOUT_S: f64 = 300.0;

/// Options of a training run.
#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    /// Gradient-exchange strategy.
    #[arg(long, value_enum, default_value_t = StrategyKind::Ring)]
    pub strategy: StrategyKind,

    /// Model to train.
    #[arg(long, value_enum, default_value_t = ModelKind::Resnet50)]
    pub model: ModelKind,

    /// Dataset file in the project's HDF5 layout (see `hpc-train data`).
    #[arg(long, default_value = "datasets/fashion-mnist.h5")]
    pub data: PathBuf,

    /// Samples per rank per step (weak scaling).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_size: u64,

    /// Weak scaling keeps --batch-size per rank; strong scaling splits --global-batch over the ranks.
    #[arg(long, value_enum, default_value_t = Scaling::Weak)]
    pub scaling: Scaling,

    /// Samples per step over all ranks (strong scaling).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub global_batch: Option<u64>,

    /// Epochs to train.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub epochs: u64,

    /// Stop after this many steps in all (overrides --epochs).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub steps: Option<u64>,

    #[command(flatten)]
    pub recipe: RecipeArgs,

    /// Seed for weights and data order (the same on every rank).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,

    /// Gradient bucket size in MiB; 0 = one exchange per parameter tensor (the naive variant).
    #[arg(long, default_value_t = 25.0)]
    pub bucket_mb: f64,

    /// Exchange gradient buckets while backward is still running (gradient-ready hooks).
    #[arg(long, value_enum, default_value_t = OnOff::Auto)]
    pub overlap: OnOff,

    /// Ring all-reduce segment size in KiB (the pipelining grain of the ring; the default is the
    /// best measured in results/strategies/README.md).
    #[arg(long, default_value_t = 4096)]
    pub segment_kb: u64,

    /// How the ring's ranks reach each other: `auto` reads and adds a neighbour's chunk straight
    /// from node-shared memory when every rank is on one node, and sends MPI messages otherwise.
    #[arg(long, value_enum, default_value_t = RingTransport::Auto)]
    pub ring_transport: RingTransport,

    /// The MPI call of `allreduce` and `horovod` on host buffers: `blocking` (MPI_Allreduce, as
    /// users and Horovod call it) or `nonblocking` (MPI_Iallreduce and a polling wait, this
    /// program's path before issue 32, for comparison). Device buffers always take the blocking
    /// call.
    #[arg(long, value_enum, default_value_t = MpiAllreduceCall::Blocking)]
    pub mpi_allreduce: MpiAllreduceCall,

    /// Folder for runs.jsonl and other results.
    #[arg(long, default_value = "results")]
    pub results: PathBuf,

    /// Intra-op threads per rank; 0 = the cores this rank may use divided by the ranks on its node.
    #[arg(long, default_value_t = 0)]
    pub threads: usize,

    /// Where to train.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,

    /// Whether the MPI library can read GPU memory; auto asks it (MPIX_GPU_query_support,
    /// MPIX_Query_cuda_support or MVAPICH2's MV2_USE_CUDA; none answering: no).
    #[arg(long, value_enum, default_value_t = CudaAware::Auto)]
    pub cuda_aware: CudaAware,

    /// Arithmetic: fp32, tf32 (TF32 matrix units, CUDA only), bf16 or fp16 (training forwards
    /// under autocast, on CUDA or the CPU; fp16 with a dynamic loss scaler). Evaluation is fp32.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,

    /// With --precision fp16: the loss scaler's first scale (torch.amp.GradScaler's
    /// init_scale); it halves on every overflow and doubles after 2000 steps without one.
    #[arg(long, default_value_t = 65536.0)]
    pub loss_scale: f64,

    /// Keep activations and convolution weights in channels-last (NHWC) memory order.
    #[arg(long)]
    pub channels_last: bool,

    /// ZeRO stage (ring, rhd on a power of two of ranks, auto): 1 shards the optimizer state
    /// (momentum) over the ranks, 2 also the gradients held between steps, 3 also the
    /// parameters (fully sharded data parallelism: each unit gathered while it computes); 0
    /// keeps everything on every rank.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: u8,

    /// With --zero 3: what a unit of sharding is (gathered whole while it computes): each
    /// block (ResNet's stem, residual blocks and head), each stage (layer1..layer4), or the model.
    #[arg(long, value_enum, default_value_t = UnitSize::Block)]
    pub fsdp_unit: UnitSize,

    /// With --zero 3: shard over each node's ranks and keep one copy of the shards per node
    /// (FSDP's HYBRID_SHARD): gathers stay inside the node, only reduced shards cross nodes.
    #[arg(long)]
    pub fsdp_hybrid: bool,

    /// Tensor parallelism (Megatron-LM) over groups of this many consecutive ranks: each
    /// encoder layer of a transformer (--model vit-b16, vit-tiny) cut by attention heads and
    /// MLP columns, the ranks of a group computing one replica together; --strategy averages
    /// the gradients over the groups. 1: off.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub tensor_parallel: u32,

    /// With --tensor-parallel: the all-reduce of the groups' partial sums and gradients.
    #[arg(long, value_enum, default_value_t = TpAllreduce::Auto)]
    pub tp_allreduce: TpAllreduce,

    /// Let several ranks of a node share one GPU (for testing on a machine with fewer GPUs).
    #[arg(long)]
    pub allow_gpu_sharing: bool,

    /// Steps at the start excluded from throughput figures.
    #[arg(long, default_value_t = 5)]
    pub warmup_steps: u64,

    /// Abort the job when an exchange, or a collective between exchanges, makes no progress for
    /// this many seconds (a cut link or a dead node), after every rank logs what it waits for;
    /// a checkpoint write longer than this (the slowest rank's part of a sharded one, rank 0's
    /// whole one) aborts the job too, the previous checkpoint kept: keep it above the longest
    /// write; 0: off.
    #[arg(long, default_value_t = DEFAULT_EXCHANGE_TIMEOUT_S)]
    pub exchange_timeout_s: f64,

    /// Cost model (JSON, from `hpc-train model fit`) with which `--strategy auto` picks ring,
    /// rhd or recursive doubling per bucket [default: built-in link costs].
    #[arg(long)]
    pub cost_model: Option<PathBuf>,

    /// Log a progress line every this many steps (when no progress bar is shown).
    #[arg(long, default_value_t = 50)]
    pub log_every: u64,

    /// Batches the loader thread reads ahead.
    #[arg(long, default_value_t = 4)]
    pub prefetch: usize,

    /// Hold the training split in memory, read once, instead of reading each batch's samples
    /// from the file.
    #[arg(long, value_enum, default_value_t = CacheData::Auto)]
    pub cache_data: CacheData,

    /// Skip the test-set evaluation at the end of each epoch.
    #[arg(long)]
    pub no_eval: bool,

    /// Start from these weights instead of the seeded ones: a safetensors file of the model's
    /// variables by their torchvision names, as --save-weights and checkpoints write them.
    #[arg(long)]
    pub init_weights: Option<PathBuf>,

    /// Write the final weights (safetensors, loadable from PyTorch) to this file.
    #[arg(long)]
    pub save_weights: Option<PathBuf>,

    /// Folder for checkpoints (weights and optimizer state; every rank writes its part, so every
    /// rank must see it; with --strategy ps rank 0 writes them whole).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,

    /// Steps between checkpoints (a checkpoint is also written at the end, or when a signal stops training).
    #[arg(long, default_value_t = 500)]
    pub checkpoint_every: u64,

    /// Good checkpoints kept, the newest written counted (older ones are removed once a newer one
    /// is complete; the one resumed from stays).
    #[arg(long, default_value_t = 3)]
    pub keep_checkpoints: usize,

    /// Continue from the newest complete checkpoint in --checkpoint-dir (from the start when there
    /// is none; refused when every one there is damaged). Without it, a --checkpoint-dir that
    /// holds checkpoints is refused.
    #[arg(long)]
    pub resume: bool,

    /// Tag this run's record in runs.jsonl with a study id (job scripts group their runs so).
    #[arg(long)]
    pub study_tag: Option<String>,

    /// Profile --profile-steps steps from the first measured one (after --warmup-steps) with
    /// libtorch's profiler, as torch.profiler does: host ops and, on a GPU, CUDA kernels and
    /// copies; one Chrome trace per rank in this folder (rank-R.json: Perfetto, TensorBoard,
    /// scripts/trace_summary.py).
    #[arg(long)]
    pub profile_dir: Option<PathBuf>,

    /// Steps profiled with --profile-dir.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub profile_steps: u64,

    /// Record the sample indices each rank trains on, one file per rank in this folder (checks).
    #[arg(long, hide = true)]
    pub trace_samples: Option<PathBuf>,

    #[command(flatten)]
    pub pipeline: PipelineArgs,

    #[command(flatten)]
    pub ps: PsArgs,

    #[command(flatten)]
    pub horovod: HorovodArgs,

    /// The options given on the command line.
    #[arg(skip)]
    pub given: Given,
}

impl TrainArgs {
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
    /// On where something is free to run the exchange while backward computes: a GPU rank (the
    /// GPU computes, the CPU exchanges) or a CPU rank with cores beyond its intra-op threads;
    /// off where backward already uses every core the rank has (the exchange's copies and
    /// additions would take them from backward: measured slower on such CPU runs, results/).
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
