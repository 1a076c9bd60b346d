//! Model builders: ResNet-50 and ResNet-18 (torchvision's architecture and parameter names,
//! adapted to the data's channels, image size and class count), the Vision Transformer
//! ([`vit`]: torchvision's ViT-B/16 and a small one for tests) and a tiny CNN for tests.

pub mod flops;
pub mod layers;
mod parts;
pub mod vars;
pub mod vit;

use layers::ConvOptions;
pub use parts::{sequence, Block, InputSpec};
pub use vars::{Variable, Vars};

use tch::nn::{self, ModuleT};
use tch::{Kind, Tensor};

/// The models a user can train.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// ResNet-50 (bottleneck blocks, 25.6 M parameters at 1000 classes).
    Resnet50,
    /// ResNet-18 (basic blocks, 11.7 M parameters at 1000 classes).
    Resnet18,
    /// torchvision's ViT-L/16 (304.3 M parameters at 224x224 and 1000 classes; with AdamW
    /// about 4.9 GB of training state); the image sides must be multiples of 16.
    #[value(name = "vit-l16")]
    #[serde(rename = "vit-l16")]
    VitL16,
    /// torchvision's ViT-B/16 (86.6 M parameters at 224x224 and 1000 classes); the image
    /// sides must be multiples of 16.
    #[value(name = "vit-b16")]
    #[serde(rename = "vit-b16")]
    VitB16,
    /// A small ViT of the same code for tests: 4x4 patches, width 64, 4 layers of 4 heads.
    #[value(name = "vit-tiny")]
    #[serde(rename = "vit-tiny")]
    VitTiny,
    /// Two convolutions and a linear layer, no batch norm: for tests and quick checks.
    Tiny,
    /// The tiny CNN plus a layer that forward never uses (tests unused parameters).
    #[value(hide = true)]
    TinyUnused,
}

impl ModelKind {
    /// Trainable parameters at torchvision's ImageNet shape (3x224x224, 1,000 classes), for
    /// projections: what every step's exchange carries.
    pub fn parameter_count(self) -> usize {
        // Declared, not drawn: a count needs the shapes only.
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let (_model, variables) = declare(self, &vs.root(), InputSpec { channels: 3, height: 224, width: 224, classes: 1000 });
        variables.iter().filter(|v| v.trainable).map(Variable::numel).sum()
    }

    /// Trainable parameters of the model built for `spec`, from the architecture's closed form
    /// (without building it: a huge class count must be refused, not allocated). The first
    /// convolution grows with the channels, the last layer with the classes; the rest is fixed.
    pub fn parameters_for(self, spec: InputSpec) -> u128 {
        let (fixed, first, last) = self.layers_for(spec);
        fixed + first + last
    }

    /// The ViT configuration, for the ViTs.
    pub fn vit_config(self) -> Option<vit::VitConfig> {
        match self {
            ModelKind::VitL16 => Some(vit::VIT_L16),
            ModelKind::VitB16 => Some(vit::VIT_B16),
            ModelKind::VitTiny => Some(vit::VIT_TINY),
            _ => None,
        }
    }

    /// (parameters that do not depend on the input, the first layer's, the last layer's).
    fn layers_for(self, spec: InputSpec) -> (u128, u128, u128) {
        if let Some(config) = self.vit_config() {
            return config.layers_for(spec);
        }
        let (c, k) = (spec.channels.max(0) as u128, spec.classes.max(0) as u128);
        let stem = if spec.height.min(spec.width) < SMALL_IMAGE { 3 * 3 } else { 7 * 7 };
        match self {
            // torchvision's counts at 3 channels and 1,000 classes (25,557,032 and 11,689,512),
            // less their 7x7 stem (64 x 3 x 49) and fc layer (2049 x 1000, 513 x 1000).
            ModelKind::Resnet50 => (23_498_624, 64 * c * stem, (2048 + 1) * k),
            ModelKind::Resnet18 => (11_167_104, 64 * c * stem, (512 + 1) * k),
            // conv2 (32 x 16 x 9 + 32); conv1 16 x C x 9 + 16; fc 33 x K.
            ModelKind::Tiny => (4640, 16 * c * 9 + 16, 33 * k),
            ModelKind::TinyUnused => (4640 + 72, 16 * c * 9 + 16, 33 * k),
            ModelKind::VitL16 | ModelKind::VitB16 | ModelKind::VitTiny => unreachable!("answered above"),
        }
    }

    /// Where most of the parameters sit, for messages.
    pub fn largest_layer(self, spec: InputSpec) -> String {
        let (fixed, first, last) = self.layers_for(spec);
        if last >= first && last >= fixed {
            format!("{last} in the last layer, for {} classes", spec.classes)
        } else if first >= fixed && self.vit_config().is_some() {
            format!("{first} in the embedding, for {} channels and {}x{} images", spec.channels, spec.height, spec.width)
        } else if first >= fixed {
            format!("{first} in the first convolution, for {} channels", spec.channels)
        } else {
            format!("{fixed} in the layers between the first and the last")
        }
    }

    /// Why the model cannot train on `spec` images in batches of `batch` per rank, if it cannot.
    pub fn check_input(self, spec: InputSpec, batch: usize) -> Result<(), String> {
        if let Some(config) = self.vit_config() {
            return config.check_input(self.name(), spec);
        }
        match self {
            // Its 2x2 max-pool needs an image of at least 2x2.
            ModelKind::Tiny | ModelKind::TinyUnused if spec.height < 2 || spec.width < 2 => {
                Err(format!("the tiny CNN max-pools 2x2, which needs images of at least 2x2 pixels, not {}x{}", spec.height, spec.width))
            }
            ModelKind::Resnet50 | ModelKind::Resnet18 => {
                // Batch norm in training needs more than one value per channel; the smallest
                // feature map is layer4's, 1/8 of the image (small stem) or 1/32 of it.
                let factor = if spec.height.min(spec.width) < SMALL_IMAGE { 8 } else { 32 };
                let last_map = ((spec.height + factor - 1) / factor) * ((spec.width + factor - 1) / factor);
                if batch as i64 * last_map < 2 {
                    return Err(format!(
                        "batch norm needs more than one value per channel, and {}x{} images leave a 1x1 map by the last stage: use a batch of at least 2 per rank",
                        spec.height, spec.width
                    ));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Resnet50 => "resnet50",
            ModelKind::Resnet18 => "resnet18",
            ModelKind::VitL16 => "vit-l16",
            ModelKind::VitB16 => "vit-b16",
            ModelKind::VitTiny => "vit-tiny",
            ModelKind::Tiny => "tiny",
            ModelKind::TinyUnused => "tiny-unused",
        }
    }
}

/// Images below this size get the CIFAR-style stem (3x3 convolution, stride 1, no max-pool):
/// the ImageNet stem divides the image by 4 before the first block, which leaves a 28x28 image
/// with 1x1 feature maps by the last stage.
const SMALL_IMAGE: i64 = 64;

/// Declares `kind` under `vs` (no variable holds memory yet: see [`vars`]), and gives back
/// the model and its variables in declaration order. Parameters are declared in forward order,
/// so that reverse declaration order is the order in which backward produces their gradients.
pub fn declare(kind: ModelKind, vs: &nn::Path, spec: InputSpec) -> (nn::FuncT<'static>, Vec<Variable>) {
    let blocks = build_blocks(kind, spec, |_| vs.clone());
    let variables = blocks.iter().flat_map(|b| b.variables.iter().map(Variable::shallow_clone)).collect();
    (sequence(blocks.into_iter().map(|b| b.module).collect()), variables)
}

/// Builds `kind` under `vs` whole, every variable drawn from `seed` (as every layout draws it):
/// one process's model, for tests.
#[cfg(test)]
pub fn build(kind: ModelKind, vs: &nn::Path, spec: InputSpec, seed: u64) -> Result<nn::FuncT<'static>, tch::TchError> {
    let (model, variables) = declare(kind, vs, spec);
    for v in &variables {
        v.set(&v.draw(seed)?.f_to_device(vs.device())?)?;
    }
    Ok(model)
}

/// The blocks of `kind` (a transformer) as a rank of a tensor-parallel group builds them, as
/// [`build_blocks`] does: its part of every encoder layer (plan/tensor.rs), the rest whole.
/// The variables are declared with their whole shapes; the rank gives each its part.
/// None for a model without attention heads.
pub fn build_blocks_tensor_parallel<'a>(kind: ModelKind, spec: InputSpec, path_of: impl Fn(usize) -> nn::Path<'a>, split: vit::TensorSplit) -> Option<Vec<Block>> {
    Some(vit::vit_blocks(spec, kind.vit_config()?, path_of, Some(split)))
}

/// The blocks of `kind` in forward order; block `i` declares its variables under `path_of(i)`
/// (the root of a VarStore), so that a pipeline stage keeps its blocks' variables in a store of
/// its own and the others in a scratch store it drops. Nothing is allocated: each variable is
/// drawn from its own name ([`vars`]), so a stage's weights are the whole model's.
pub fn build_blocks<'a>(kind: ModelKind, spec: InputSpec, path_of: impl Fn(usize) -> nn::Path<'a>) -> Vec<Block> {
    match kind {
        ModelKind::Resnet50 => resnet_blocks(spec, Residual::Bottleneck, [3, 4, 6, 3], path_of),
        ModelKind::Resnet18 => resnet_blocks(spec, Residual::Basic, [2, 2, 2, 2], path_of),
        ModelKind::VitL16 => vit::vit_blocks(spec, vit::VIT_L16, path_of, None),
        ModelKind::VitB16 => vit::vit_blocks(spec, vit::VIT_B16, path_of, None),
        ModelKind::VitTiny => vit::vit_blocks(spec, vit::VIT_TINY, path_of, None),
        ModelKind::Tiny => tiny_blocks(spec, path_of, false),
        ModelKind::TinyUnused => tiny_blocks(spec, path_of, true),
    }
}

/// How many blocks [`build_blocks`] makes.
#[cfg(test)]
pub fn block_count(kind: ModelKind) -> usize {
    match kind {
        ModelKind::Resnet50 => 1 + (3 + 4 + 6 + 3) + 1,
        ModelKind::Resnet18 => 1 + (2 + 2 + 2 + 2) + 1,
        ModelKind::VitL16 | ModelKind::VitB16 | ModelKind::VitTiny => kind.vit_config().expect("a ViT").layers as usize + 2,
        ModelKind::Tiny | ModelKind::TinyUnused => 4,
    }
}

/// The shape of one sample after each block, from a forward of one zero image in evaluation
/// mode: what a pipeline's activation messages carry per sample (agreed without a message).
/// One block at a time holds values (zeros: the shapes do not depend on them), and lets them
/// go before the next: the survey never holds the model.
pub fn block_output_shapes(blocks: &[Block], spec: InputSpec) -> Result<Vec<Vec<i64>>, tch::TchError> {
    let mut x = Tensor::f_zeros([1, spec.channels, spec.height, spec.width], (Kind::Float, tch::Device::Cpu))?;
    let mut shapes = Vec::with_capacity(blocks.len());
    for b in blocks {
        b.fill_zeros()?;
        x = tch::no_grad(|| b.module.forward_t(&x, false));
        b.release()?;
        shapes.push(x.size()[1..].to_vec());
    }
    Ok(shapes)
}

fn conv2d(v: Vars, c_in: i64, c_out: i64, kernel: i64, padding: i64, stride: i64) -> layers::Conv2d {
    layers::conv2d(&v, c_in, c_out, kernel, ConvOptions { stride, padding, bias: false, ..Default::default() })
}

#[derive(Clone, Copy)]
enum Residual {
    Basic,
    Bottleneck,
}

impl Residual {
    fn expansion(self) -> i64 {
        match self {
            Residual::Basic => 1,
            Residual::Bottleneck => 4,
        }
    }
}

/// The shortcut's 1x1 convolution and batch norm, where the block changes width or size.
fn downsample(v: Vars, c_in: i64, c_out: i64, stride: i64) -> Option<(layers::Conv2d, layers::BatchNorm2d)> {
    (stride != 1 || c_in != c_out).then(|| (conv2d(&v / "0", c_in, c_out, 1, 0, stride), layers::batch_norm2d(&(&v / "1"), c_out)))
}

fn shortcut(xs: &Tensor, down: &Option<(layers::Conv2d, layers::BatchNorm2d)>, train: bool) -> Tensor {
    match down {
        Some((conv, bn)) => xs.apply(conv).apply_t(bn, train),
        None => xs.shallow_clone(),
    }
}

fn basic_block(v: Vars, c_in: i64, planes: i64, stride: i64) -> nn::FuncT<'static> {
    let conv1 = conv2d(&v / "conv1", c_in, planes, 3, 1, stride);
    let bn1 = layers::batch_norm2d(&(&v / "bn1"), planes);
    let conv2 = conv2d(&v / "conv2", planes, planes, 3, 1, 1);
    let bn2 = layers::batch_norm2d(&(&v / "bn2"), planes);
    let down = downsample(&v / "downsample", c_in, planes, stride);
    nn::func_t(move |xs, train| {
        let ys = xs.apply(&conv1).apply_t(&bn1, train).relu().apply(&conv2).apply_t(&bn2, train);
        (shortcut(xs, &down, train) + ys).relu()
    })
}

fn bottleneck_block(v: Vars, c_in: i64, planes: i64, stride: i64) -> nn::FuncT<'static> {
    let out = planes * Residual::Bottleneck.expansion();
    let conv1 = conv2d(&v / "conv1", c_in, planes, 1, 0, 1);
    let bn1 = layers::batch_norm2d(&(&v / "bn1"), planes);
    // torchvision's ResNet v1.5: the stride sits on the 3x3 convolution.
    let conv2 = conv2d(&v / "conv2", planes, planes, 3, 1, stride);
    let bn2 = layers::batch_norm2d(&(&v / "bn2"), planes);
    let conv3 = conv2d(&v / "conv3", planes, out, 1, 0, 1);
    let bn3 = layers::batch_norm2d(&(&v / "bn3"), out);
    let down = downsample(&v / "downsample", c_in, out, stride);
    nn::func_t(move |xs, train| {
        let ys = xs
            .apply(&conv1)
            .apply_t(&bn1, train)
            .relu()
            .apply(&conv2)
            .apply_t(&bn2, train)
            .relu()
            .apply(&conv3)
            .apply_t(&bn3, train);
        (shortcut(xs, &down, train) + ys).relu()
    })
}

fn resnet_blocks<'a>(spec: InputSpec, residual: Residual, counts: [i64; 4], path_of: impl Fn(usize) -> nn::Path<'a>) -> Vec<Block> {
    let small = spec.height.min(spec.width) < SMALL_IMAGE;
    let mut blocks = Vec::new();
    let v = Vars::new(path_of(0));
    let conv1 = if small { conv2d(&v / "conv1", spec.channels, 64, 3, 1, 1) } else { conv2d(&v / "conv1", spec.channels, 64, 7, 3, 2) };
    let bn1 = layers::batch_norm2d(&(&v / "bn1"), 64);
    let stem = nn::func_t(move |xs, train| {
        let ys = xs.apply(&conv1).apply_t(&bn1, train).relu();
        if small { ys } else { ys.max_pool2d([3, 3], [2, 2], [1, 1], [1, 1], false) }
    });
    blocks.push(Block::new("stem", stem, v));
    let e = residual.expansion();
    let mut c_in = 64;
    for (layer, (&count, planes)) in counts.iter().zip([64, 128, 256, 512]).enumerate() {
        for i in 0..count {
            let v = Vars::new(path_of(blocks.len()));
            let stride = if i == 0 && layer > 0 { 2 } else { 1 };
            let at = &v / format!("layer{}", layer + 1) / i;
            let module = match residual {
                Residual::Basic => basic_block(at, c_in, planes, stride),
                Residual::Bottleneck => bottleneck_block(at, c_in, planes, stride),
            };
            blocks.push(Block::new(format!("layer{}.{i}", layer + 1), module, v));
            c_in = planes * e;
        }
    }
    let v = Vars::new(path_of(blocks.len()));
    let fc = layers::linear(&(&v / "fc"), 512 * e, spec.classes, None, None);
    blocks.push(Block::new("head", nn::func_t(move |xs, _train| xs.adaptive_avg_pool2d([1, 1]).flat_view().apply(&fc)), v));
    blocks
}

/// The tiny CNN in four blocks, so that it makes pipelines of up to four stages for tests (the
/// pooling block has no parameters: a stage may hold none). `unused`: the last block also
/// declares a layer that forward never uses, after the used ones, so that backward never
/// produces its gradient (tests of unused parameters).
fn tiny_blocks<'a>(spec: InputSpec, path_of: impl Fn(usize) -> nn::Path<'a>, unused: bool) -> Vec<Block> {
    let conv = |v: &Vars, name: &str, c_in, c_out| layers::conv2d(&(v / name), c_in, c_out, 3, ConvOptions { padding: 1, ..Default::default() });
    let (v0, v1, v2, v3) = (Vars::new(path_of(0)), Vars::new(path_of(1)), Vars::new(path_of(2)), Vars::new(path_of(3)));
    let conv1 = conv(&v0, "conv1", spec.channels, 16);
    let conv2 = conv(&v1, "conv2", 16, 32);
    let fc = layers::linear(&(&v3 / "fc"), 32, spec.classes, None, None);
    if unused {
        let _unused = layers::linear(&(&v3 / "unused"), 8, 8, None, None);
    }
    vec![
        Block::new("conv1", nn::func_t(move |xs, _| xs.apply(&conv1).relu().max_pool2d_default(2)), v0),
        Block::new("conv2", nn::func_t(move |xs, _| xs.apply(&conv2).relu()), v1),
        Block::new("pool", nn::func_t(|xs, _| xs.adaptive_avg_pool2d([1, 1]).flat_view()), v2),
        Block::new("fc", nn::func_t(move |xs, _| xs.apply(&fc)), v3),
    ]
}

/// Number of elements in a set of tensors.
#[cfg(test)]
pub fn numel(tensors: &[Tensor]) -> usize {
    tensors.iter().map(|t| t.numel()).sum()
}

/// Runs the model once on a zero batch in evaluation mode, to check that the input fits.
pub fn check_forward(model: &impl ModuleT, spec: InputSpec, device: tch::Device) -> Result<(), tch::TchError> {
    let x = Tensor::f_zeros([1, spec.channels, spec.height, spec.width], (Kind::Float, device))?;
    let y = tch::no_grad(|| model.forward_t(&x, false));
    if y.size() != [1, spec.classes] {
        return Err(tch::TchError::Shape(format!("model output {:?}, expected [1, {}]", y.size(), spec.classes)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn param_count(kind: ModelKind, spec: InputSpec) -> (usize, usize) {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = build(kind, &vs.root(), spec, 0).unwrap();
        check_forward(&model, spec, Device::Cpu).unwrap();
        let params = vs.trainable_variables();
        (params.len(), numel(&params))
    }

    #[test]
    fn resnets_have_torchvisions_parameter_counts() {
        let imagenet = InputSpec { channels: 3, height: 224, width: 224, classes: 1000 };
        // torchvision: resnet50 25,557,032 parameters in 161 tensors; resnet18 11,689,512 in 62.
        assert_eq!(param_count(ModelKind::Resnet50, imagenet), (161, 25_557_032));
        assert_eq!(param_count(ModelKind::Resnet18, imagenet), (62, 11_689_512));
    }

    #[test]
    fn the_closed_form_counts_the_parameters_that_are_built() {
        for kind in [ModelKind::Resnet50, ModelKind::Resnet18, ModelKind::Tiny, ModelKind::TinyUnused] {
            for spec in [
                InputSpec { channels: 1, height: 28, width: 28, classes: 10 },
                InputSpec { channels: 5, height: 64, width: 80, classes: 7 },
                InputSpec { channels: 3, height: 224, width: 224, classes: 1000 },
            ] {
                let (_, built) = param_count(kind, spec);
                assert_eq!(kind.parameters_for(spec), built as u128, "{kind:?} {spec:?}");
            }
        }
        let huge = InputSpec { channels: 1, height: 8, width: 8, classes: 1_000_000_000_000 };
        assert_eq!(ModelKind::Resnet50.parameters_for(huge), 23_498_624 + 64 * 9 + 2049 * 1_000_000_000_000);
        assert!(ModelKind::Resnet50.largest_layer(huge).contains("last layer"));
    }

    #[test]
    fn inputs_the_models_cannot_take_are_named() {
        let one_pixel = InputSpec { channels: 1, height: 1, width: 1, classes: 3 };
        assert!(ModelKind::Tiny.check_input(one_pixel, 8).unwrap_err().contains("at least 2x2"));
        assert!(ModelKind::Tiny.check_input(InputSpec { height: 2, width: 2, ..one_pixel }, 1).is_ok());
        assert!(ModelKind::Resnet18.check_input(one_pixel, 1).unwrap_err().contains("batch of at least 2"));
        assert!(ModelKind::Resnet18.check_input(one_pixel, 2).is_ok());
        assert!(ModelKind::Resnet18.check_input(InputSpec { height: 9, width: 9, ..one_pixel }, 1).is_ok());
    }

    /// A pipeline's stages together hold the whole model: the same variables under the same
    /// names and with the same values (each drawn from its name), and the blocks in turn
    /// compute what it computes.
    #[test]
    fn blocks_split_over_stores_are_the_whole_model() {
        let spec = InputSpec { channels: 1, height: 28, width: 28, classes: 10 };
        for kind in [ModelKind::Tiny, ModelKind::Resnet18, ModelKind::VitTiny] {
            let whole_vs = nn::VarStore::new(Device::Cpu);
            let whole = build(kind, &whole_vs.root(), spec, 5).unwrap();
            let (even, odd) = (nn::VarStore::new(Device::Cpu), nn::VarStore::new(Device::Cpu));
            let blocks = build_blocks(kind, spec, |i| if i % 2 == 0 { even.root() } else { odd.root() });
            assert_eq!(blocks.len(), block_count(kind));
            // Drawn last block first: the order does not matter.
            blocks.iter().rev().for_each(|b| b.draw(5, Device::Cpu).unwrap());
            let mut split: Vec<(String, Tensor)> = even.variables().into_iter().chain(odd.variables()).collect();
            split.sort_by(|a, b| a.0.cmp(&b.0));
            let mut all: Vec<(String, Tensor)> = whole_vs.variables().into_iter().collect();
            all.sort_by(|a, b| a.0.cmp(&b.0));
            assert_eq!(split.iter().map(|v| &v.0).collect::<Vec<_>>(), all.iter().map(|v| &v.0).collect::<Vec<_>>());
            for (a, b) in split.iter().zip(&all) {
                assert!(a.1.equal(&b.1), "{} drawn alike", a.0);
            }
            let x = Tensor::randn([2, 1, 28, 28], (Kind::Float, Device::Cpu));
            let y = sequence(blocks.into_iter().map(|b| b.module).collect()).forward_t(&x, false);
            assert!(y.equal(&whole.forward_t(&x, false)));
        }
        let scratch = nn::VarStore::new(Device::Cpu);
        let blocks = build_blocks(ModelKind::Resnet50, spec, |_| scratch.root());
        assert_eq!(blocks.len(), 18);
        assert_eq!(block_count(ModelKind::Resnet50), 18);
        assert_eq!(block_output_shapes(&blocks, spec).unwrap().last().unwrap(), &vec![10]);
        assert!(blocks.iter().all(|b| b.variables.iter().all(|v| v.tensor.numel() == 0)), "the survey lets every block go");
    }

    /// Declaring a model allocates nothing: ViT-L/16 (304 M parameters) is declared whole here.
    #[test]
    fn declaring_holds_no_memory() {
        let vs = nn::VarStore::new(Device::Cpu);
        let (_model, variables) = declare(ModelKind::VitL16, &vs.root(), InputSpec { channels: 3, height: 224, width: 224, classes: 1000 });
        assert_eq!(variables.iter().filter(|v| v.trainable).map(Variable::numel).sum::<usize>(), 304_326_632);
        assert_eq!(vs.variables().values().map(Tensor::numel).sum::<usize>(), 0);
        assert_eq!(ModelKind::VitL16.parameter_count(), 304_326_632);
    }

    #[test]
    fn small_grey_images_fit() {
        let fashion = InputSpec { channels: 1, height: 28, width: 28, classes: 10 };
        let (tensors, _) = param_count(ModelKind::Resnet18, fashion);
        assert_eq!(tensors, 62);
        let (tensors, count) = param_count(ModelKind::Tiny, fashion);
        assert_eq!(tensors, 6);
        assert_eq!(count, 16 * 9 + 16 + 32 * 16 * 9 + 32 + 32 * 10 + 10);
    }
}
