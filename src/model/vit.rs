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

use super::parts::{Block, InputSpec};

/// A ViT's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VitConfig {
    pub patch: i64,
    pub hidden: i64,
    pub layers: i64,
    pub heads: i64,
    pub mlp: i64,
}

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

/// The blocks of a ViT of `config` for `spec`: embedding, `config.layers` encoder layers, head.
pub fn vit_blocks<'a>(spec: InputSpec, config: VitConfig, path_of: impl Fn(usize) -> nn::Path<'a>) -> Vec<Block> {
    let VitConfig { patch, hidden, layers, heads, mlp } = config;
    let mut blocks = Vec::with_capacity(layers as usize + 2);

    let p = path_of(0);
    // torchvision: the patches' convolution drawn from a (truncated) normal of std sqrt(1/fan_in),
    // the class token zeros, the position embedding from a normal of std 0.02.
    let fan_in = (spec.channels * patch * patch) as f64;
    let conv_proj = nn::conv2d(
        &p / "conv_proj",
        spec.channels,
        hidden,
        patch,
        nn::ConvConfig { stride: patch, ws_init: Init::Randn { mean: 0.0, stdev: (1.0 / fan_in).sqrt() }, bs_init: Init::Const(0.0), ..Default::default() },
    );
    let class_token = p.var("class_token", &[1, 1, hidden], Init::Const(0.0));
    let pos_embedding = (&p / "encoder").var("pos_embedding", &[1, config.tokens(spec), hidden], Init::Randn { mean: 0.0, stdev: 0.02 });
    blocks.push(Block {
        name: "embedding".into(),
        module: nn::func_t(move |xs, _train| {
            let n = xs.size()[0];
            // (n, hidden, h/p, w/p) -> (n, patches, hidden), the class token first.
            let patches = xs.apply(&conv_proj).flatten(2, 3).transpose(1, 2);
            Tensor::cat(&[class_token.expand([n, 1, hidden], false), patches], 1) + &pos_embedding
        }),
    });

    for i in 0..layers {
        let p = path_of(blocks.len()) / "encoder" / "layers" / format!("encoder_layer_{i}");
        blocks.push(Block { name: format!("encoder_layer_{i}"), module: encoder_layer(&p, hidden, heads, mlp) });
    }

    let p = path_of(blocks.len());
    let ln = nn::layer_norm(&p / "encoder" / "ln", vec![hidden], layer_norm_config());
    // torchvision zeroes the head (without a representation layer).
    let head = nn::linear(&p / "heads" / "head", hidden, spec.classes, nn::LinearConfig { ws_init: Init::Const(0.0), bs_init: Some(Init::Const(0.0)), bias: true });
    blocks.push(Block { name: "head".into(), module: nn::func_t(move |xs, _train| xs.apply(&ln).select(1, 0).apply(&head)) });
    blocks
}

/// torchvision's layer norms: eps 1e-6.
fn layer_norm_config() -> nn::LayerNormConfig {
    nn::LayerNormConfig { eps: 1e-6, ..Default::default() }
}

/// One encoder layer: x + attention(ln_1(x)), then + mlp(ln_2(.)), torchvision's
/// `EncoderBlock` (dropout 0).
fn encoder_layer(p: &nn::Path, hidden: i64, heads: i64, mlp: i64) -> nn::FuncT<'static> {
    let ln_1 = nn::layer_norm(p / "ln_1", vec![hidden], layer_norm_config());
    let attention = p / "self_attention";
    // nn.MultiheadAttention's initialisation: Xavier-uniform in-projection, zero biases.
    let bound = (6.0 / (hidden + 3 * hidden) as f64).sqrt();
    let in_proj_weight = attention.var("in_proj_weight", &[3 * hidden, hidden], Init::Uniform { lo: -bound, up: bound });
    let in_proj_bias = attention.var("in_proj_bias", &[3 * hidden], Init::Const(0.0));
    let out_proj = nn::linear(&attention / "out_proj", hidden, hidden, nn::LinearConfig { bs_init: Some(Init::Const(0.0)), ..Default::default() });
    let ln_2 = nn::layer_norm(p / "ln_2", vec![hidden], layer_norm_config());
    // MLPBlock: Xavier-uniform weights, biases from a normal of std 1e-6.
    let linear = |name: &str, i: i64, o: i64| {
        let bound = (6.0 / (i + o) as f64).sqrt();
        nn::linear(p / "mlp" / name, i, o, nn::LinearConfig { ws_init: Init::Uniform { lo: -bound, up: bound }, bs_init: Some(Init::Randn { mean: 0.0, stdev: 1e-6 }), bias: true })
    };
    let (mlp_0, mlp_3) = (linear("0", hidden, mlp), linear("3", mlp, hidden));
    let head_dim = hidden / heads;
    nn::func_t(move |xs, _train| {
        let (n, tokens) = (xs.size()[0], xs.size()[1]);
        let y = xs.apply(&ln_1);
        // Queries, keys and values in one projection, split by heads: (n, heads, tokens, head_dim).
        let qkv = y.linear(&in_proj_weight, Some(&in_proj_bias)).view([n, tokens, 3, heads, head_dim]).permute([2, 0, 3, 1, 4]);
        let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
        let weights = (q.matmul(&k.transpose(-2, -1)) / (head_dim as f64).sqrt()).softmax(-1, Kind::Float);
        let attended = weights.matmul(&v).transpose(1, 2).reshape([n, tokens, hidden]).apply(&out_proj);
        let x = xs + attended;
        let z = x.apply(&ln_2).apply(&mlp_0).gelu("none").apply(&mlp_3);
        x + z
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::nn::ModuleT;
    use tch::Device;

    fn built(config: VitConfig, spec: InputSpec) -> (usize, Vec<String>) {
        let vs = nn::VarStore::new(Device::Cpu);
        let blocks = vit_blocks(spec, config, |_| vs.root());
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
