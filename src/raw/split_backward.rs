//! Zero-bubble's split backward (src/shim/split_backward.cpp): a chunk's backward of one
//! micro-batch as B, the gradient of its input (what the previous stage waits for), and later W,
//! its weights' gradients from the graph that B kept. tch reaches no autograd node, so the walk
//! of the graph and the two engine passes are in the shim.
//!
//! The invariants its unsafe code relies on: every tensor handed to the shim is a live tch
//! tensor for the call's length (the shim keeps its own references to what it needs); the
//! state B returns is owned by one [`KeptGraph`], which frees it once, and W takes that
//! [`KeptGraph`] by value, so it runs at most once per B.

use std::ffi::{c_char, c_int, c_void};
use std::ptr::NonNull;

use tch::Tensor;

use crate::error::{Error, Result};
use crate::raw::cuda::shim_error;

extern "C" {
    #[allow(clippy::too_many_arguments)]
    fn hpc_backward_input(
        output: *mut c_void,
        gradient: *mut c_void,
        input: *mut c_void,
        parameters: *const *mut c_void,
        count: usize,
        input_gradient: *mut *mut c_void,
        state: *mut *mut c_void,
        error: *mut c_char,
        error_length: usize,
    ) -> c_int;
    fn hpc_backward_weight(state: *mut c_void, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_split_state_bytes(state: *mut c_void) -> usize;
    fn hpc_split_state_free(state: *mut c_void);
}

/// What B keeps for W: the graph's intermediates (the nodes where parameters join the input's
/// path) and the gradients B captured for them. Dropped without W, it lets the graph go.
pub struct KeptGraph(NonNull<c_void>);

impl KeptGraph {
    /// The bytes of the gradients B captured for W (each storage once): what the kept graph
    /// holds until W beyond the graph itself, which an unsplit backward lets go at once.
    pub fn captured_bytes(&self) -> usize {
        // SAFETY: the live state hpc_backward_input made, owned by this value; only read.
        unsafe { hpc_split_state_bytes(self.0.as_ptr()) }
    }
}

impl Drop for KeptGraph {
    fn drop(&mut self) {
        // SAFETY: the state hpc_backward_input made, owned by this value alone, freed once.
        unsafe { hpc_split_state_free(self.0.as_ptr()) }
    }
}

/// B: the gradient of `input` (a leaf that requires a gradient, the chunk's received
/// activation) from `output` with `gradient` (None: `output` is a scalar loss, seeded with 1),
/// no parameter's gradient computed; and the graph kept for [`backward_weight`]. `parameters`:
/// this stage's parameters (those the graph does not reach are ignored).
pub fn backward_input(output: &Tensor, gradient: Option<&Tensor>, input: &Tensor, parameters: &[Tensor]) -> Result<(Tensor, KeptGraph)> {
    let mut err = [0 as c_char; 256];
    let handles: Vec<*mut c_void> = parameters.iter().map(|p| p.as_ptr() as *mut c_void).collect();
    let mut input_gradient: *mut c_void = std::ptr::null_mut();
    let mut state: *mut c_void = std::ptr::null_mut();
    // SAFETY: every pointer is a live tch at::Tensor borrowed for the call (the shim copies the
    // handles it keeps); the outputs are written only on success, each a fresh heap object
    // whose ownership passes to us; the error buffer is writable.
    let rc = unsafe {
        hpc_backward_input(
            output.as_ptr() as *mut c_void,
            gradient.map_or(std::ptr::null_mut(), |g| g.as_ptr() as *mut c_void),
            input.as_ptr() as *mut c_void,
            handles.as_ptr(),
            handles.len(),
            &mut input_gradient,
            &mut state,
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if rc != 0 {
        return Err(failure("B", &shim_error(&err)));
    }
    let kept = KeptGraph(NonNull::new(state).ok_or_else(|| failure("B", "no state returned"))?);
    // SAFETY: a fresh at::Tensor* from the shim, owned by nobody else.
    Ok((unsafe { Tensor::from_ptr(input_gradient as *mut torch_sys::C_tensor) }, kept))
}

/// W: the weights' gradients of the graph `kept`, accumulated into their `.grad` as an unsplit
/// backward accumulates them; the graph is then let go.
pub fn backward_weight(kept: KeptGraph) -> Result<()> {
    let mut err = [0 as c_char; 256];
    // SAFETY: the live state of `kept`, which is dropped (freed) after the call.
    let rc = unsafe { hpc_backward_weight(kept.0.as_ptr(), err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        return Err(failure("W", &shim_error(&err)));
    }
    Ok(())
}

fn failure(pass: &str, message: &str) -> Error {
    Error::Torch(tch::TchError::Torch(format!("the split backward's {pass}: {message}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::nn::{self, Module, ModuleT};
    use tch::{Device, Kind};

    /// B gives the input's gradient of an unsplit backward and touches no parameter's gradient;
    /// W then gives every parameter the gradient of an unsplit backward, bit for bit, and a
    /// second micro-batch's W accumulates onto the first's as an unsplit backward would. The
    /// chunk has a convolution, batch norm, a residual join and linear layers (the kinds of
    /// intermediates the walk meets in the models).
    #[test]
    fn b_then_w_is_an_unsplit_backward() {
        tch::manual_seed(7);
        let vs = nn::VarStore::new(Device::Cpu);
        let root = vs.root();
        let conv = nn::conv2d(&root / "conv", 3, 3, 3, nn::ConvConfig { padding: 1, ..Default::default() });
        let bn = nn::batch_norm2d(&root / "bn", 3, Default::default());
        let fc1 = nn::linear(&root / "fc1", 3 * 4 * 4, 8, Default::default());
        let fc2 = nn::linear(&root / "fc2", 8, 5, Default::default());
        let forward = |x: &Tensor| {
            let h = bn.forward_t(&conv.forward(x), true).relu() + x; // a residual join
            fc2.forward(&fc1.forward(&h.flatten(1, -1)).tanh())
        };
        let params: Vec<Tensor> = vs.trainable_variables();
        let inputs: Vec<Tensor> = (0..2).map(|_| Tensor::randn([2, 3, 4, 4], (Kind::Float, Device::Cpu))).collect();
        let gradients: Vec<Tensor> = (0..2).map(|_| Tensor::randn([2, 5], (Kind::Float, Device::Cpu))).collect();

        // Unsplit: two micro-batches' backwards accumulating.
        let mut unsplit_dx = Vec::new();
        for (x, g) in inputs.iter().zip(&gradients) {
            let x = x.copy().set_requires_grad(true);
            // The executor's unsplit backward: d(sum(out * g))/d(out) is g exactly.
            (forward(&x) * g).sum(Kind::Float).backward();
            unsplit_dx.push(x.grad().copy());
        }
        let unsplit: Vec<Tensor> = params.iter().map(|p| p.grad().copy()).collect();
        for p in &params {
            let _ = p.grad().zero_();
        }

        // Split: both B's first (as a schedule may run them), then the W's in micro-batch order.
        let mut kept = Vec::new();
        for (i, (x, g)) in inputs.iter().zip(&gradients).enumerate() {
            let x = x.copy().set_requires_grad(true);
            let out = forward(&x);
            let (dx, graph) = backward_input(&out, Some(g), &x, &params).unwrap();
            assert!(dx.equal(&unsplit_dx[i]), "micro-batch {i}: B's input gradient");
            // At least the gradient of fc2's output (the seed, 2 x 5 f32), which W starts from.
            assert!(graph.captured_bytes() >= 2 * 5 * 4, "micro-batch {i}: {} bytes captured", graph.captured_bytes());
            assert!(params.iter().all(|p| p.grad().abs().sum(Kind::Float).double_value(&[]) == 0.0), "B left the weights' gradients alone");
            kept.push(graph);
        }
        for graph in kept {
            backward_weight(graph).unwrap();
        }
        for (p, want) in params.iter().zip(&unsplit) {
            assert!(p.grad().equal(want), "W's accumulated gradients against the unsplit backward's");
        }
    }
}
