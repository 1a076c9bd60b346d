//! What every model builder shares (the ResNets here in mod.rs, the ViT in vit.rs): the input a
//! model must fit, the blocks a model is made of, and running blocks in sequence. A file of its
//! own, so that the builders import it without importing each other.

use tch::nn::{self, ModuleT};
use tch::Tensor;

use super::vars::{Variable, Vars};

/// What the model must fit: input channels and size, and the number of classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputSpec {
    pub channels: i64,
    pub height: i64,
    pub width: i64,
    pub classes: i64,
}

/// One piece of a model that a pipeline may put on a stage of its own: the stem, a residual
/// block, the head; a ViT's embedding, an encoder layer, its head. Its variables have the names they have in the whole model.
pub struct Block {
    /// What it is, for messages and logs: "stem", "layer2.1", "head".
    pub name: String,
    pub module: nn::FuncT<'static>,
    /// Its variables, declared (empty) in declaration order.
    pub variables: Vec<Variable>,
}

impl Block {
    /// The block `module`, whose variables were declared under `vars`.
    pub fn new(name: impl Into<String>, module: nn::FuncT<'static>, vars: Vars) -> Block {
        Block { name: name.into(), module, variables: vars.into_declared() }
    }

    /// Its trainable elements.
    pub fn parameters(&self) -> usize {
        self.variables.iter().filter(|v| v.trainable).map(Variable::numel).sum()
    }

    /// Every variable drawn from `seed` (as every layout draws it), on `device`.
    pub fn draw(&self, seed: u64, device: tch::Device) -> Result<(), tch::TchError> {
        self.variables.iter().try_for_each(|v| v.set(&v.draw(seed)?.f_to_device(device)?))
    }

    /// Every variable zeros, on the CPU (for a survey of shapes, where values do not matter).
    pub fn fill_zeros(&self) -> Result<(), tch::TchError> {
        self.variables.iter().try_for_each(|v| v.set(&Tensor::f_zeros(v.shape.as_slice(), (tch::Kind::Float, tch::Device::Cpu))?))
    }

    /// Lets every variable's memory go.
    pub fn release(&self) -> Result<(), tch::TchError> {
        self.variables.iter().try_for_each(Variable::release)
    }
}

/// Runs `modules` one after the other.
pub fn sequence(modules: Vec<nn::FuncT<'static>>) -> nn::FuncT<'static> {
    nn::func_t(move |xs, train| {
        let mut ys = xs.shallow_clone();
        for m in &modules {
            ys = m.forward_t(&ys, train);
        }
        ys
    })
}
