//! The collectives a run makes besides the exchange: rank 0's steps to every rank,
//! buffers averaged over the workers, the loss summed, strings gathered. Each is collective over
//! the communicator it is given.

use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use tch::{Device, Kind, Tensor};

use crate::error::Result;
use crate::raw;

/// Averages `tensors` over the ranks of `comm` that pass `contribute` (others send zeros).
pub(super) fn average_over(comm: &SimpleCommunicator, tensors: &[Tensor], contribute: bool, contributors: usize) -> Result<()> {
    if tensors.is_empty() {
        return Ok(());
    }
    let flat: Vec<Tensor> = tensors.iter().map(|t| t.f_to_kind(Kind::Float)?.f_reshape([-1])?.f_to_device(Device::Cpu)).collect::<std::result::Result<_, _>>()?;
    let mut flat = Tensor::f_cat(&flat, 0)?;
    if !contribute {
        let _ = flat.f_zero_()?;
    }
    // SAFETY: `flat` was just made by f_cat and has no other handle.
    let send = unsafe { raw::host_slice::<f32>(&flat)? }.to_vec();
    // SAFETY: as above.
    let sums = unsafe { raw::host_slice_mut::<f32>(&mut flat)? };
    crate::watchdog::collective("averaging buffers", comm, || comm.all_reduce_into(&send[..], sums, mpi::collective::SystemOperation::sum()));
    let _ = flat.f_div_scalar_(contributors as f64)?;
    unflatten_into(&flat, tensors)
}

pub(super) fn unflatten_into(flat: &Tensor, tensors: &[Tensor]) -> Result<()> {
    let mut offset = 0;
    tch::no_grad(|| -> Result<()> {
        for t in tensors {
            let n = t.numel() as i64;
            let mut dst = t.shallow_clone();
            dst.f_copy_(&flat.f_narrow(0, offset, n)?.f_view(t.size().as_slice())?)?;
            offset += n;
        }
        Ok(())
    })
}

/// Rank 0's value of a step, on every rank (None travels as u64::MAX).
pub(super) fn broadcast_step(comm: &SimpleCommunicator, step: Option<u64>) -> Option<u64> {
    let mut value = step.unwrap_or(u64::MAX);
    comm.process_at_rank(0).broadcast_into(&mut value);
    (value != u64::MAX).then_some(value)
}

pub(super) fn sum_pair(comm: &SimpleCommunicator, a: f64, b: f64) -> (f64, f64) {
    let send = [a, b];
    let mut out = [0.0; 2];
    crate::watchdog::collective("summing the loss", comm, || comm.all_reduce_into(&send[..], &mut out[..], mpi::collective::SystemOperation::sum()));
    (out[0], out[1])
}

/// Every rank's `text` on every rank of `comm`, in rank order. Collective.
pub(super) fn gather_strings(comm: &SimpleCommunicator, text: &str) -> Vec<String> {
    let bytes = text.as_bytes();
    let count = bytes.len() as i32;
    let mut counts = vec![0i32; comm.size() as usize];
    comm.all_gather_into(&count, &mut counts[..]);
    let displs: Vec<i32> = counts.iter().scan(0, |acc, &c| { let d = *acc; *acc += c; Some(d) }).collect();
    let mut all = vec![0u8; counts.iter().sum::<i32>() as usize];
    {
        let mut partition = mpi::datatype::PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
        comm.all_gather_varcount_into(bytes, &mut partition);
    }
    counts
        .iter()
        .zip(&displs)
        .map(|(&c, &d)| String::from_utf8_lossy(&all[d as usize..(d + c) as usize]).into_owned())
        .collect()
}
