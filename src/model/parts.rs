//! What every model builder shares (the ResNets here in mod.rs, the ViT in vit.rs): the input a
//! model must fit, the blocks a model is made of, and running blocks in sequence. A file of its
//! own, so that the builders import it without importing each other.

use tch::nn::{self, ModuleT};

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
