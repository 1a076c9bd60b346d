//! The layers the models use, declared through [`Vars`] so that they hold no memory until a
//! rank gives their variables values. Each computes what tch's layer of the same name
//! computes, with the same libtorch call, and declares its variables in tch's order and with
//! tch's default initialisations (a conv's or linear layer's bias before its weight; batch
//! norm's weight, bias, running mean, running variance): the order of the parameters is the
//! order of their gradients' buckets.

use tch::nn::{self, Init};
use tch::Tensor;

use super::vars::Vars;

/// A 2-D convolution: square kernel, equal stride and padding on both sides, no groups.
#[derive(Debug)]
pub struct Conv2d {
    ws: Tensor,
    bs: Option<Tensor>,
    stride: i64,
    padding: i64,
}

pub struct ConvOptions {
    pub stride: i64,
    pub padding: i64,
    pub bias: bool,
    pub ws_init: Init,
    pub bs_init: Init,
}

impl Default for ConvOptions {
    /// tch's: Kaiming-uniform weights, zero bias.
    fn default() -> Self {
        ConvOptions { stride: 1, padding: 0, bias: true, ws_init: nn::init::DEFAULT_KAIMING_UNIFORM, bs_init: Init::Const(0.0) }
    }
}

pub fn conv2d(v: &Vars, c_in: i64, c_out: i64, kernel: i64, options: ConvOptions) -> Conv2d {
    let bs = options.bias.then(|| v.var("bias", &[c_out], options.bs_init));
    let ws = v.var("weight", &[c_out, c_in, kernel, kernel], options.ws_init);
    Conv2d { ws, bs, stride: options.stride, padding: options.padding }
}

impl nn::Module for Conv2d {
    fn forward(&self, xs: &Tensor) -> Tensor {
        xs.conv2d(&self.ws, self.bs.as_ref(), [self.stride], [self.padding], [1], 1)
    }
}

/// A fully connected layer.
#[derive(Debug)]
pub struct Linear {
    ws: Tensor,
    bs: Tensor,
}

/// tch's defaults: Kaiming-uniform weights, a bias uniform in +-1/sqrt(inputs) unless `bs_init`.
pub fn linear(v: &Vars, inputs: i64, outputs: i64, ws_init: Option<Init>, bs_init: Option<Init>) -> Linear {
    let bound = 1.0 / (inputs as f64).sqrt();
    let bs = v.var("bias", &[outputs], bs_init.unwrap_or(Init::Uniform { lo: -bound, up: bound }));
    let ws = v.var("weight", &[outputs, inputs], ws_init.unwrap_or(nn::init::DEFAULT_KAIMING_UNIFORM));
    Linear { ws, bs }
}

impl nn::Module for Linear {
    fn forward(&self, xs: &Tensor) -> Tensor {
        xs.linear(&self.ws, Some(&self.bs))
    }
}

/// 2-D batch normalisation (tch's defaults: momentum 0.1, eps 1e-5, weights uniform in [0, 1)).
#[derive(Debug)]
pub struct BatchNorm2d {
    ws: Tensor,
    bs: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
}

pub fn batch_norm2d(v: &Vars, channels: i64) -> BatchNorm2d {
    let ws = v.var("weight", &[channels], Init::Uniform { lo: 0.0, up: 1.0 });
    let bs = v.var("bias", &[channels], Init::Const(0.0));
    let running_mean = v.buffer("running_mean", &[channels], Init::Const(0.0));
    let running_var = v.buffer("running_var", &[channels], Init::Const(1.0));
    BatchNorm2d { ws, bs, running_mean, running_var }
}

impl nn::ModuleT for BatchNorm2d {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        Tensor::batch_norm(xs, Some(&self.ws), Some(&self.bs), Some(&self.running_mean), Some(&self.running_var), train, 0.1, 1e-5, true)
    }
}

/// Layer normalisation over the last dimension (weights one, biases zero).
#[derive(Debug)]
pub struct LayerNorm {
    ws: Tensor,
    bs: Tensor,
    width: i64,
    eps: f64,
}

pub fn layer_norm(v: &Vars, width: i64, eps: f64) -> LayerNorm {
    let ws = v.var("weight", &[width], Init::Const(1.0));
    let bs = v.var("bias", &[width], Init::Const(0.0));
    LayerNorm { ws, bs, width, eps }
}

impl nn::Module for LayerNorm {
    fn forward(&self, xs: &Tensor) -> Tensor {
        Tensor::layer_norm(xs, [self.width], Some(&self.ws), Some(&self.bs), self.eps, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::nn::Module;
    use tch::{Device, Kind};

    /// Each layer computes what tch's computes from the same values, bit for bit.
    #[test]
    fn the_layers_compute_what_tchs_do() {
        let ours = nn::VarStore::new(Device::Cpu);
        let v = Vars::new(ours.root());
        let conv = conv2d(&(&v / "conv"), 3, 5, 3, ConvOptions { stride: 2, padding: 1, ..Default::default() });
        let bn = batch_norm2d(&(&v / "bn"), 5);
        let fc = linear(&(&v / "fc"), 5, 4, None, None);
        let ln = layer_norm(&(&v / "ln"), 4, 1e-6);
        for var in v.into_declared() {
            var.set(&var.draw(3).unwrap()).unwrap();
        }
        let theirs = nn::VarStore::new(Device::Cpu);
        let t = theirs.root();
        let tconv = nn::conv2d(&t / "conv", 3, 5, 3, nn::ConvConfig { stride: 2, padding: 1, ..Default::default() });
        let tbn = nn::batch_norm2d(&t / "bn", 5, Default::default());
        let tfc = nn::linear(&t / "fc", 5, 4, Default::default());
        let tln = nn::layer_norm(&t / "ln", vec![4], nn::LayerNormConfig { eps: 1e-6, ..Default::default() });
        let mut theirs_named: Vec<_> = theirs.variables().into_iter().collect();
        theirs_named.sort_by(|a, b| a.0.cmp(&b.0));
        let mut ours_named: Vec<_> = ours.variables().into_iter().collect();
        ours_named.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(ours_named.iter().map(|v| &v.0).collect::<Vec<_>>(), theirs_named.iter().map(|v| &v.0).collect::<Vec<_>>());
        tch::no_grad(|| ours_named.iter().zip(&theirs_named).for_each(|(o, t)| t.1.shallow_clone().copy_(&o.1)));
        let x = Tensor::randn([2, 3, 8, 8], (Kind::Float, Device::Cpu));
        for train in [true, false] {
            let ours_y = conv.forward(&x).apply_t(&bn, train).mean_dim([2, 3].as_slice(), false, Kind::Float).apply(&fc).apply(&ln);
            let theirs_y = tconv.forward(&x).apply_t(&tbn, train).mean_dim([2, 3].as_slice(), false, Kind::Float).apply(&tfc).apply(&tln);
            assert!(ours_y.equal(&theirs_y));
        }
        // The parameters in tch's order (the gradients' bucket order).
        let order = |vs: &nn::VarStore| vs.trainable_variables().iter().map(|t| t.size()).collect::<Vec<_>>();
        assert_eq!(order(&ours), order(&theirs));
    }
}
