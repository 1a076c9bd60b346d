//! `allreduce`: the MPI library's own `MPI_Allreduce` on buckets of `--bucket-mb`: the baseline,
//! the blocking call that users of MPI make (`--mpi-allreduce nonblocking` keeps this program's
//! older path through `MPI_Iallreduce`, for comparison).

use half::{bf16, f16};
use mpi::collective::{SystemOperation, UserOperation};
use mpi::datatype::{DynBuffer, DynBufferMut};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use tch::Tensor;

use crate::element::{Dtype, Element};
use crate::error::{Error, Result};
use crate::exchange::buckets::Fusion;
use crate::exchange::config::{ExchangeConfig, MpiAllreduceCall};
use crate::exchange::staging::Staging;
use crate::exchange::strategy::{allreduce_bus_factor, common_dtype, Checkpointed, DataPath, Described, ExchangeReport, Reduce, ReduceOp, Role, Training};
use crate::raw;
use crate::topology::World;

pub struct MpiAllreduce {
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
    path: DataPath,
    fusion: Fusion,
    staging: Staging,
    sums: SumOps,
}

impl MpiAllreduce {
    pub fn new(world: &World, config: &ExchangeConfig) -> Result<MpiAllreduce> {
        Ok(MpiAllreduce {
            // A communicator of its own, so that its traffic never matches anyone else's.
            comm: world.comm.duplicate(),
            rank: world.rank as usize,
            size: world.size as usize,
            path: DataPath::choose(config.device, config.cuda_aware),
            fusion: Fusion::new(config.bucket_bytes, None),
            staging: Staging::new(),
            sums: SumOps::new(config.mpi_allreduce),
        })
    }
}

impl Described for MpiAllreduce {
    fn name(&self) -> &'static str {
        "allreduce"
    }

    fn bus_factor(&self) -> f64 {
        allreduce_bus_factor(self.size)
    }

    fn report(&self) -> ExchangeReport {
        let mut extra = serde_json::Map::new();
        extra.insert("mpi_allreduce".into(), self.sums.call.name().into());
        self.staging.report(self.path, extra)
    }
}

impl Reduce for MpiAllreduce {
    fn all_reduce(&mut self, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        let dtype = common_dtype(tensors)?;
        if self.size == 1 {
            // The sum and the mean over one rank are the tensors themselves: packing them into
            // fusion buffers for MPI to copy cost ResNet-18 12 ms a step (results/).
            return Ok(());
        }
        let (comm, sums) = (&self.comm, &self.sums);
        let path = self.path.for_mpi_reduction(dtype);
        let scale = (op == ReduceOp::Mean && self.size > 1).then(|| 1.0 / self.size as f64);
        self.staging.reduce_fused(&mut self.fusion, path, tensors, |_, bucket| {
            sums.all_reduce_sum(comm, bucket)?;
            if let Some(f) = scale {
                let _ = bucket.f_mul_scalar_(f)?;
            }
            Ok(())
        })
    }
}

impl Training for MpiAllreduce {
    fn role(&self) -> Role {
        Role::Worker { index: self.rank, count: self.size }
    }
}

impl Checkpointed for MpiAllreduce {}

/// The sum operations for every dtype, made once: MPI has no half-precision sum, so user
/// operations add 16-bit words as f16 or bf16, each addition done in f32. `call` says which
/// MPI all-reduce host buffers go to.
pub struct SumOps {
    f16: UserOperation<'static>,
    bf16: UserOperation<'static>,
    pub call: MpiAllreduceCall,
}

impl SumOps {
    pub fn new(call: MpiAllreduceCall) -> SumOps {
        SumOps { f16: half_sum_op::<f16>(), bf16: half_sum_op::<bf16>(), call }
    }

    /// Sums a flat tensor over the ranks of `comm` in place with `MPI_Allreduce`: on the host, or
    /// f32 on the device with a CUDA-aware MPI (the caller's choice of path, see
    /// [`DataPath::for_mpi_reduction`]; 16-bit device buffers are refused).
    pub fn all_reduce_sum(&self, comm: &SimpleCommunicator, bucket: &mut Tensor) -> Result<()> {
        let dtype = common_dtype(std::slice::from_ref(bucket))?;
        refuse_device_user_op(bucket, dtype)?;
        let nonblocking = self.call == MpiAllreduceCall::Nonblocking;
        match dtype {
            Dtype::F32 => sum_typed::<f32, _>(comm, bucket, &SystemOperation::sum(), nonblocking),
            Dtype::F16 => sum_typed::<f16, _>(comm, bucket, &&self.f16, nonblocking),
            Dtype::Bf16 => sum_typed::<bf16, _>(comm, bucket, &&self.bf16, nonblocking),
        }
    }
}

impl SumOps {
    /// Sums a flat tensor over `comm` into the `root` rank's copy (MPI_Reduce, in place there).
    pub fn reduce_sum_to_root(&self, comm: &SimpleCommunicator, bucket: &mut Tensor, root: i32) -> Result<()> {
        let dtype = common_dtype(std::slice::from_ref(bucket))?;
        refuse_device_user_op(bucket, dtype)?;
        // SAFETY: the bucket is a buffer of the exchange (a fusion buffer, a staging buffer or a
        // flat view of a gradient whose backward is done) that nothing else touches during the
        // call; on the device it is f32 (checked above), reduced by MPI's own sum, and the caller
        // chose the direct path because MPI is CUDA-aware and waited for the stream.
        unsafe {
            match dtype {
                Dtype::F32 => raw::reduce_in_place::<f32>(comm, bucket, &SystemOperation::sum(), root),
                Dtype::F16 => raw::reduce_in_place::<f16>(comm, bucket, &&self.f16, root),
                Dtype::Bf16 => raw::reduce_in_place::<bf16>(comm, bucket, &&self.bf16, root),
            }
        }
    }
}

impl Default for SumOps {
    fn default() -> Self {
        SumOps::new(MpiAllreduceCall::Blocking)
    }
}

/// The 16-bit sums are host functions (MPI calls them on host pointers): device memory given to
/// them would be read as host memory. Such buffers take the staged path instead.
fn refuse_device_user_op(bucket: &Tensor, dtype: Dtype) -> Result<()> {
    if bucket.device().is_cuda() && dtype != Dtype::F32 {
        return Err(Error::exchange(
            "MPI reduction",
            format!("{} values on {:?}: MPI sums 16-bit floats with a host function; stage them through host memory", dtype.name(), bucket.device()),
        ));
    }
    Ok(())
}

fn sum_typed<E: Element, O: mpi::collective::Operation>(comm: &SimpleCommunicator, bucket: &mut Tensor, op: &O, nonblocking: bool) -> Result<()> {
    if bucket.device().is_cuda() {
        // SAFETY: as in `reduce_sum_to_root`: an exchange buffer nothing else touches, f32 with
        // MPI's own sum on the device (refuse_device_user_op), on the direct path.
        unsafe { raw::all_reduce_in_place_device::<E>(comm, bucket, op) }
    } else {
        // SAFETY: an exchange buffer (fusion, staging, or a finished gradient's flat view) that
        // no other handle reads or writes while MPI reduces it.
        raw::all_reduce_in_place::<E>(comm, unsafe { raw::host_slice_mut::<E>(bucket)? }, op, nonblocking)
    }
}

/// An MPI operation that sums 16-bit floats of type E, each addition done in f32.
fn half_sum_op<E: Element<Wire = u16>>() -> UserOperation<'static> {
    UserOperation::commutative(|x: DynBuffer, acc: DynBufferMut| {
        let x: &[u16] = x.downcast().expect("the operation is only used on 16-bit words");
        let acc: &mut [u16] = acc.downcast().expect("the operation is only used on 16-bit words");
        crate::element::accumulate::<E>(bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(x));
    })
}
