//! The Vision Transformer (Dosovitskiy et al., ICLR 2021) in torchvision's `VisionTransformer`
//! architecture and parameter names, so that a `--save-weights` file loads into
//! `torchvision.models.vit_b_16` (or a `VisionTransformer` of the same configuration) with
//! strict=True: `conv_proj`, `class_token`, `encoder.pos_embedding`,
//! `encoder.layers.encoder_layer_{i}.{ln_1, self_attention.{in_proj_weight, in_proj_bias,
//! out_proj}, ln_2, mlp.0, mlp.3}`, `encoder.ln`, `heads.head`.
//!
//! As blocks: the embedding (patches, class token, position embedding), each encoder layer,
//! and the head (the final layer norm and the linear layer), so that pipelines and `--zero 3`
//! take a ViT as they take a ResNet.

use tch::nn::{self, Init};
use tch::{Kind, Tensor};

use crate::raw::RegionGroup;

use super::layers::{self, ConvOptions};
use super::parts::{Block, InputSpec};
use super::vars::Vars;

/// A rank's part of a tensor-parallel group (`--tensor-parallel`): it holds 1/`size` of the
/// heads and MLP columns (plan/tensor.rs says which), and sums partial results over `group`.
#[derive(Clone, Copy, Debug)]
pub struct TensorSplit {
    pub size: i64,
    pub group: RegionGroup,
}

/// A ViT's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VitConfig {
    pub patch: i64,
    pub hidden: i64,
    pub layers: i64,
    pub heads: i64,
    pub mlp: i64,
}

/// torchvision's `vit_l_16`: 304,326,632 parameters at 3x224x224 and 1,000 classes.
pub const VIT_L16: VitConfig = VitConfig { patch: 16, hidden: 1024, layers: 24, heads: 16, mlp: 4096 };

/// torchvision's `vit_b_16`: 86,567,656 parameters at 3x224x224 and 1,000 classes.
pub const VIT_B16: VitConfig = VitConfig { patch: 16, hidden: 768, layers: 12, heads: 12, mlp: 3072 };

/// For tests: 4x4 patches (28x28 and 32x32 images make 49 and 64 of them), width 64, 4 layers
/// of 4 heads, an MLP of 128.
pub const VIT_TINY: VitConfig = VitConfig { patch: 4, hidden: 64, layers: 4, heads: 4, mlp: 128 };

impl VitConfig {
    /// Tokens per image: the patches and the class token.
    pub fn tokens(&self, spec: InputSpec) -> i64 {
        (spec.height / self.patch) * (spec.width / self.patch) + 1
    }

    /// (parameters independent of the input, the embedding's, the head's), in closed form.
    pub fn layers_for(&self, spec: InputSpec) -> (u128, u128, u128) {
        let (h, m) = (self.hidden as u128, self.mlp as u128);
        let (c, k, p) = (spec.channels.max(0) as u128, spec.classes.max(0) as u128, self.patch as u128);
        let tokens = ((spec.height / self.patch).max(0) * (spec.width / self.patch).max(0) + 1) as u128;
        // Per layer: two layer norms (2h each), the attention's in-projection (3h x h + 3h) and
        // out-projection (h x h + h), the MLP (h x m + m, m x h + h).
        let layer = 4 * h + 3 * h * h + 3 * h + h * h + h + h * m + m + m * h + h;
        let fixed = self.layers as u128 * layer + 2 * h;
        // The patches' convolution (c p p x h + h), the class token (h), the position embedding.
        let embedding = c * p * p * h + h + h + tokens * h;
        (fixed, embedding, (h + 1) * k)
    }

    /// Why the configuration cannot take `spec` images, if it cannot.
    pub fn check_input(&self, name: &str, spec: InputSpec) -> Result<(), String> {
        if spec.height % self.patch != 0 || spec.width % self.patch != 0 {
            return Err(format!(
                "--model {name} cuts images into {p}x{p} patches, and {}x{} is not a multiple of {p} (torchvision's ViT requires it too); use images whose sides are multiples of {p}",
                spec.height,
                spec.width,
                p = self.patch
            ));
        }
        if self.hidden % self.heads != 0 {
            return Err(format!("--model {name}: width {} is not a multiple of its {} heads", self.hidden, self.heads));
        }
        Ok(())
    }
}

/// The blocks of a ViT of `config` for `spec`: embedding, `config.layers` encoder layers, head;
/// with `split`, the encoder layers hold this rank's part of a tensor-parallel group.
pub fn vit_blocks<'a>(spec: InputSpec, config: VitConfig, path_of: impl Fn(usize) -> nn::Path<'a>, split: Option<TensorSplit>) -> Vec<Block> {
    let VitConfig { patch, hidden, layers, heads, mlp } = config;
    let mut blocks = Vec::with_capacity(layers as usize + 2);

    let v = Vars::new(path_of(0));
    // torchvision: the patches' convolution drawn from a (truncated) normal of std sqrt(1/fan_in),
    // the class token zeros, the position embedding from a normal of std 0.02.
    let fan_in = (spec.channels * patch * patch) as f64;
    let conv_proj = layers::conv2d(
        &(&v / "conv_proj"),
        spec.channels,
        hidden,
        patch,
        ConvOptions { stride: patch, ws_init: Init::Randn { mean: 0.0, stdev: (1.0 / fan_in).sqrt() }, bs_init: Init::Const(0.0), ..Default::default() },
    );
    let class_token = v.var("class_token", &[1, 1, hidden], Init::Const(0.0));
    let pos_embedding = (&v / "encoder").var("pos_embedding", &[1, config.tokens(spec), hidden], Init::Randn { mean: 0.0, stdev: 0.02 });
    let embedding = nn::func_t(move |xs, _train| {
        let n = xs.size()[0];
        // (n, hidden, h/p, w/p) -> (n, patches, hidden), the class token first.
        let patches = xs.apply(&conv_proj).flatten(2, 3).transpose(1, 2);
        Tensor::cat(&[class_token.expand([n, 1, hidden], false), patches], 1) + &pos_embedding
    });
    blocks.push(Block::new("embedding", embedding, v));

    for i in 0..layers {
        let v = Vars::new(path_of(blocks.len()));
        let layer = encoder_layer(&v / "encoder" / "layers" / format!("encoder_layer_{i}"), hidden, heads, mlp, split);
        blocks.push(Block::new(format!("encoder_layer_{i}"), layer, v));
    }

    let v = Vars::new(path_of(blocks.len()));
    let ln = layers::layer_norm(&(&v / "encoder" / "ln"), hidden, LAYER_NORM_EPS);
    // torchvision zeroes the head (without a representation layer).
    let head = layers::linear(&(&v / "heads" / "head"), hidden, spec.classes, Some(Init::Const(0.0)), Some(Init::Const(0.0)));
    blocks.push(Block::new("head", nn::func_t(move |xs, _train| xs.apply(&ln).select(1, 0).apply(&head)), v));
    blocks
}

/// torchvision's layer norms: eps 1e-6.
const LAYER_NORM_EPS: f64 = 1e-6;

/// One encoder layer: x + attention(ln_1(x)), then + mlp(ln_2(.)), torchvision's
/// `EncoderBlock` (dropout 0). With `split`, Megatron's layer: this rank's heads and MLP columns,
/// the attention's output projection and the MLP's second layer summed over the group (their
/// biases added once, after the sum), each sum's gradient the identity; the inputs of the
/// attention and the MLP copied into the group, their gradients summed in backward.
///
/// The variables are declared with their whole shapes (a rank of a group is given its part of
/// each: train/net.rs), so that every layout draws the same whole values and cuts them.
fn encoder_layer(p: Vars, hidden: i64, heads: i64, mlp: i64, split: Option<TensorSplit>) -> nn::FuncT<'static> {
    let parts = split.map_or(1, |s| s.size);
    let local_heads = heads / parts;
    let head_dim = hidden / heads;
    let local_width = local_heads * head_dim;
    let ln_1 = layers::layer_norm(&(&p / "ln_1"), hidden, LAYER_NORM_EPS);
    let attention = &p / "self_attention";
    // nn.MultiheadAttention's initialisation: Xavier-uniform in-projection (of the whole
    // weight's shape), zero biases.
    let bound = (6.0 / (hidden + 3 * hidden) as f64).sqrt();
    let in_proj_weight = attention.var("in_proj_weight", &[3 * hidden, hidden], Init::Uniform { lo: -bound, up: bound });
    let in_proj_bias = attention.var("in_proj_bias", &[3 * hidden], Init::Const(0.0));
    // nn.Linear's default initialisation (Kaiming-uniform of a=sqrt(5), as tch's linear layer).
    let out_proj_weight = (&attention / "out_proj").var("weight", &[hidden, hidden], nn::init::DEFAULT_KAIMING_UNIFORM);
    let out_proj_bias = (&attention / "out_proj").var("bias", &[hidden], Init::Const(0.0));
    let ln_2 = layers::layer_norm(&(&p / "ln_2"), hidden, LAYER_NORM_EPS);
    // MLPBlock: Xavier-uniform weights (of the whole shapes), biases from a normal of std 1e-6.
    let mlp_bound = (6.0 / (hidden + mlp) as f64).sqrt();
    let mlp_var = |layer: &str, name: &str, shape: &[i64], init| (&p / "mlp" / layer).var(name, shape, init);
    let weights = Init::Uniform { lo: -mlp_bound, up: mlp_bound };
    let biases = Init::Randn { mean: 0.0, stdev: 1e-6 };
    let (mlp_0_weight, mlp_0_bias) = (mlp_var("0", "weight", &[mlp, hidden], weights), mlp_var("0", "bias", &[mlp], biases));
    let (mlp_3_weight, mlp_3_bias) = (mlp_var("3", "weight", &[hidden, mlp], weights), mlp_var("3", "bias", &[hidden], biases));
    let failed = |e: crate::error::Error| -> Tensor { panic!("tensor-parallel encoder layer: {e}") };
    // Into the group (identity; the gradient summed in backward), and a row-parallel layer's
    // partial products summed (the bias added after the sum). Without a split: a plain linear.
    let into_group = move |x: Tensor| match split {
        Some(s) => s.group.copy_to(&x).unwrap_or_else(failed),
        None => x,
    };
    let row_parallel = move |x: &Tensor, weight: &Tensor, bias: &Tensor| match split {
        Some(s) => s.group.reduce_from(&x.linear::<&Tensor>(weight, None)).unwrap_or_else(failed) + bias,
        None => x.linear(weight, Some(bias)),
    };
    nn::func_t(move |xs, _train| {
        let (n, tokens) = (xs.size()[0], xs.size()[1]);
        let y = into_group(xs.apply(&ln_1));
        // Queries, keys and values in one projection, split by heads: (n, heads, tokens, head_dim).
        let qkv = y.linear(&in_proj_weight, Some(&in_proj_bias)).view([n, tokens, 3, local_heads, head_dim]).permute([2, 0, 3, 1, 4]);
        let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
        let weights = (q.matmul(&k.transpose(-2, -1)) / (head_dim as f64).sqrt()).softmax(-1, Kind::Float);
        let attended = row_parallel(&weights.matmul(&v).transpose(1, 2).reshape([n, tokens, local_width]), &out_proj_weight, &out_proj_bias);
        let x = xs + attended;
        let hidden_units = into_group(x.apply(&ln_2)).linear(&mlp_0_weight, Some(&mlp_0_bias)).gelu("none");
        x + row_parallel(&hidden_units, &mlp_3_weight, &mlp_3_bias)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::nn::ModuleT;
    use tch::Device;

    fn built(config: VitConfig, spec: InputSpec) -> (usize, Vec<String>) {
        let vs = nn::VarStore::new(Device::Cpu);
        let blocks = vit_blocks(spec, config, |_| vs.root(), None);
        blocks.iter().for_each(|b| b.draw(0, Device::Cpu).unwrap());
        let x = Tensor::zeros([2, spec.channels, spec.height, spec.width], (Kind::Float, Device::Cpu));
        let y = super::super::parts::sequence(blocks.into_iter().map(|b| b.module).collect()).forward_t(&x, true);
        assert_eq!(y.size(), [2, spec.classes]);
        let mut names: Vec<String> = vs.variables().into_keys().collect();
        names.sort();
        (vs.trainable_variables().iter().map(|t| t.numel()).sum(), names)
    }

    #[test]
    fn the_closed_form_counts_what_is_built_and_torchvisions_vit_b_16() {
        for spec in [InputSpec { channels: 1, height: 28, width: 28, classes: 10 }, InputSpec { channels: 3, height: 32, width: 16, classes: 7 }] {
            let (count, _) = built(VIT_TINY, spec);
            let (fixed, embedding, head) = VIT_TINY.layers_for(spec);
            assert_eq!(count as u128, fixed + embedding + head, "{spec:?}");
        }
        let imagenet = InputSpec { channels: 3, height: 224, width: 224, classes: 1000 };
        let (fixed, embedding, head) = VIT_B16.layers_for(imagenet);
        assert_eq!(fixed + embedding + head, 86_567_656, "torchvision's vit_b_16");
        let (fixed, embedding, head) = VIT_L16.layers_for(imagenet);
        assert_eq!(fixed + embedding + head, 304_326_632, "torchvision's vit_l_16");
    }

    #[test]
    fn parameter_names_are_torchvisions() {
        let (_, names) = built(VIT_TINY, InputSpec { channels: 1, height: 28, width: 28, classes: 10 });
        for name in [
            "class_token", "conv_proj.weight", "conv_proj.bias", "encoder.pos_embedding",
            "encoder.layers.encoder_layer_0.ln_1.weight", "encoder.layers.encoder_layer_0.self_attention.in_proj_weight",
            "encoder.layers.encoder_layer_0.self_attention.in_proj_bias", "encoder.layers.encoder_layer_3.self_attention.out_proj.weight",
            "encoder.layers.encoder_layer_3.self_attention.out_proj.bias", "encoder.layers.encoder_layer_3.ln_2.bias",
            "encoder.layers.encoder_layer_2.mlp.0.weight", "encoder.layers.encoder_layer_2.mlp.3.bias", "encoder.ln.weight", "heads.head.weight", "heads.head.bias",
        ] {
            assert!(names.iter().any(|n| n == name), "{name} missing from {names:?}");
        }
        // 4 per-model tensors + 12 per layer + 4 at the end (conv_proj has 2).
        assert_eq!(names.len(), 4 + 12 * 4 + 4);
    }

    #[test]
    fn images_that_patches_do_not_tile_are_refused() {
        let why = VIT_B16.check_input("vit-b16", InputSpec { channels: 1, height: 28, width: 28, classes: 10 }).unwrap_err();
        assert!(why.contains("16x16 patches") && why.contains("28x28"), "{why}");
        assert!(VIT_TINY.check_input("vit-tiny", InputSpec { channels: 1, height: 28, width: 28, classes: 10 }).is_ok());
    }
}
