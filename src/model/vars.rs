//! A model's variables declared before any of them holds memory, and drawn one at a time.
//!
//! Builders declare each variable (its name, shape, initialisation and whether it trains) and
//! get an empty placeholder, which the store and the layers hold; nothing the size of the model
//! is allocated. A rank then gives memory to the variables it holds, one at a time
//! ([`Variable::set`]): drawn from a generator seeded by the run's seed and the variable's name
//! ([`Variable::draw`]), so that a variable has the same value whichever rank holds it, in
//! whichever layout, and whatever else that rank holds, on any device (PyTorch FSDP2's meta-device
//! initialisation followed by each rank materialising its shard; DeepSpeed's `zero.Init`). A
//! pipeline stage draws its blocks' variables only, a tensor-parallel rank cuts each drawn
//! variable to its part before drawing the next, and `--zero 3` keeps its shard of each.
//!
//! A placeholder keeps its identity when it is given memory (`set_data`, PyTorch's
//! `param.data = ...`), so the layers built around it see the values.

use std::cell::RefCell;
use std::rc::Rc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::nn::init::NormalOrUniform;
use tch::nn::{self, Init};
use tch::{Device, Kind, Tensor};

/// One variable as its builder declared it, and the placeholder that stands for it.
pub struct Variable {
    /// Its name in the whole model (torchvision's).
    pub name: String,
    /// Its shape in the whole model (a tensor-parallel rank holds a part of it).
    pub shape: Vec<i64>,
    pub init: Init,
    /// A parameter (trained) or a buffer (batch norm's running statistics).
    pub trainable: bool,
    /// The tensor the store and the layers hold: empty until [`Variable::set`].
    pub tensor: Tensor,
}

impl Variable {
    /// The variable's initial value, whole, on the CPU, drawn from a ChaCha generator seeded by
    /// `seed` and the variable's name with the distribution its builder declared (tch's
    /// initialisations). Not libtorch's generator: that one is global (any draw on any thread
    /// moves it), and its streams differ between the CPU and CUDA and may differ between
    /// libtorch builds, where this draw is the same on every rank, device and build.
    pub fn draw(&self, seed: u64) -> Result<Tensor, tch::TchError> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed_of(seed, &self.name));
        let n = self.numel();
        let values: Vec<f32> = match self.init {
            Init::Const(value) => vec![value as f32; n],
            Init::Uniform { lo, up } => uniform(&mut rng, n, lo, up),
            Init::Randn { mean, stdev } => normal(&mut rng, n, mean, stdev),
            Init::Kaiming { dist, fan, non_linearity } => {
                let std = non_linearity.gain() / (fan.for_weight_dims(&self.shape) as f64).sqrt();
                match dist {
                    NormalOrUniform::Uniform => uniform(&mut rng, n, -(3f64.sqrt()) * std, 3f64.sqrt() * std),
                    NormalOrUniform::Normal => normal(&mut rng, n, 0.0, std),
                }
            }
            Init::Orthogonal { .. } => return Err(tch::TchError::Kind(format!("{}: no model here declares an orthogonal initialisation", self.name))),
        };
        Tensor::f_from_slice(&values)?.f_view(self.shape.as_slice())
    }

    /// Gives the variable `value` (on its device), keeping its identity. Without a gradient:
    /// this is set-up, not training.
    pub fn set(&self, value: &Tensor) -> Result<(), tch::TchError> {
        tch::no_grad(|| self.tensor.shallow_clone().f_set_data(value))
    }

    /// Lets the variable's memory go (an empty tensor on its device), keeping its identity.
    pub fn release(&self) -> Result<(), tch::TchError> {
        let empty = Tensor::f_empty([0], (Kind::Float, self.tensor.device()))?;
        self.set(&empty)
    }

    /// The same variable (its placeholder shared).
    pub fn shallow_clone(&self) -> Variable {
        Variable { name: self.name.clone(), shape: self.shape.clone(), init: self.init, trainable: self.trainable, tensor: self.tensor.shallow_clone() }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product::<i64>() as usize
    }
}

/// The seed of a variable's generator: FNV-1a of the run's seed and the variable's name. Fixed
/// here, not std's hasher, whose algorithm may change between Rust releases: a run's initial
/// weights must be drawn again alike.
pub fn seed_of(seed: u64, name: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in seed.to_le_bytes().iter().chain(name.as_bytes()) {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// `n` values uniform in [lo, up).
fn uniform(rng: &mut ChaCha8Rng, n: usize, lo: f64, up: f64) -> Vec<f32> {
    (0..n).map(|_| (lo + (up - lo) * rng.gen::<f64>()) as f32).collect()
}

/// `n` values from a normal distribution (Box-Muller: two uniforms give two normals).
fn normal(rng: &mut ChaCha8Rng, n: usize, mean: f64, stdev: f64) -> Vec<f32> {
    let mut values = Vec::with_capacity(n + 1);
    while values.len() < n {
        // 1 - u is in (0, 1]: its logarithm is finite.
        let (u1, u2) = (1.0 - rng.gen::<f64>(), rng.gen::<f64>());
        let r = (-2.0 * u1.ln()).sqrt();
        let angle = std::f64::consts::TAU * u2;
        values.push((mean + stdev * r * angle.cos()) as f32);
        values.push((mean + stdev * r * angle.sin()) as f32);
    }
    values.truncate(n);
    values
}

/// Where a block declares its variables: a path in a store, and the list of what was declared
/// under it (shared by the sub-paths, in declaration order).
#[derive(Clone)]
pub struct Vars<'a> {
    path: nn::Path<'a>,
    declared: Rc<RefCell<Vec<Variable>>>,
}

impl<'a> Vars<'a> {
    /// Variables declared under `path` (a store's root, for a block).
    pub fn new(path: nn::Path<'a>) -> Vars<'a> {
        Vars { path, declared: Rc::new(RefCell::new(Vec::new())) }
    }

    /// A trainable variable, empty until it is given memory.
    pub fn var(&self, name: &str, shape: &[i64], init: Init) -> Tensor {
        self.declare(name, shape, init, true)
    }

    /// A buffer (not trained), empty until it is given memory.
    pub fn buffer(&self, name: &str, shape: &[i64], init: Init) -> Tensor {
        self.declare(name, shape, init, false)
    }

    fn declare(&self, name: &str, shape: &[i64], init: Init, trainable: bool) -> Tensor {
        let placeholder = Tensor::empty([0], (Kind::Float, Device::Cpu));
        let tensor = self.path.add(name, placeholder, trainable);
        let full_name = self.path.path(name);
        self.declared.borrow_mut().push(Variable { name: full_name, shape: shape.to_vec(), init, trainable, tensor: tensor.shallow_clone() });
        tensor
    }

    /// What was declared under this path and every path below it, in declaration order.
    pub fn into_declared(self) -> Vec<Variable> {
        self.declared.take()
    }
}

impl<'a, T: std::string::ToString> std::ops::Div<T> for &Vars<'a> {
    type Output = Vars<'a>;

    fn div(self, name: T) -> Vars<'a> {
        Vars { path: &self.path / name, declared: Rc::clone(&self.declared) }
    }
}

impl<'a, T: std::string::ToString> std::ops::Div<T> for Vars<'a> {
    type Output = Vars<'a>;

    fn div(self, name: T) -> Vars<'a> {
        &self / name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variable_is_drawn_from_its_name_alone() {
        let (a, b) = (nn::VarStore::new(Device::Cpu), nn::VarStore::new(Device::Cpu));
        let first = Vars::new(a.root());
        // Declared in another order, under the same names, with another variable between.
        let w1 = (&first / "layer").var("weight", &[4, 3], nn::init::DEFAULT_KAIMING_UNIFORM);
        let _ = (&first / "layer").var("bias", &[4], Init::Uniform { lo: -1.0, up: 1.0 });
        let second = Vars::new(b.root());
        let _ = (&second / "other").var("weight", &[7], Init::Randn { mean: 0.0, stdev: 1.0 });
        let _ = (&second / "layer").var("bias", &[4], Init::Uniform { lo: -1.0, up: 1.0 });
        let w2 = (&second / "layer").var("weight", &[4, 3], nn::init::DEFAULT_KAIMING_UNIFORM);
        assert_eq!(w1.numel(), 0, "declared, not allocated");
        let (first, second) = (first.into_declared(), second.into_declared());
        assert_eq!(first.iter().map(|v| v.name.as_str()).collect::<Vec<_>>(), ["layer.weight", "layer.bias"]);
        for list in [&first, &second] {
            for v in list.iter() {
                v.set(&v.draw(7).unwrap()).unwrap();
            }
        }
        assert_eq!(w1.size(), [4, 3]);
        assert!(w1.equal(&w2), "the same name and seed draw the same value");
        assert!(first[1].tensor.equal(&second[1].tensor));
        assert!(!w1.equal(&first[0].draw(8).unwrap()), "another seed draws another value");
        assert!(w1.requires_grad() && a.trainable_variables().len() == 2);
        first[0].release().unwrap();
        assert_eq!(w1.numel(), 0);
    }

    #[test]
    fn seeds_differ_by_name_and_seed() {
        assert_ne!(seed_of(0, "a.weight"), seed_of(0, "a.bias"));
        assert_ne!(seed_of(0, "a.weight"), seed_of(1, "a.weight"));
        // FNV-1a of the seed's bytes and the name: fixed, so that a run's weights are drawn again.
        assert_eq!(seed_of(42, "fc.weight"), 0x1313a5caf4bd850a);
    }

    #[test]
    fn draws_have_the_declared_distribution() {
        let vs = nn::VarStore::new(Device::Cpu);
        let v = Vars::new(vs.root());
        let _ = v.var("u", &[20_000], Init::Uniform { lo: -0.5, up: 1.5 });
        let _ = v.var("n", &[20_001], Init::Randn { mean: 3.0, stdev: 2.0 });
        let _ = v.var("k", &[64, 32, 3, 3], nn::init::DEFAULT_KAIMING_UNIFORM);
        let _ = v.var("c", &[5], Init::Const(0.25));
        let declared = v.into_declared();
        let d: Vec<Tensor> = declared.iter().map(|x| x.draw(1).unwrap()).collect();
        let (min, max) = (d[0].min().double_value(&[]), d[0].max().double_value(&[]));
        assert!(min >= -0.5 && max < 1.5 && min < -0.49 && max > 1.49, "{min} {max}");
        assert!((d[1].mean(Kind::Float).double_value(&[]) - 3.0).abs() < 0.06 && (d[1].std(true).double_value(&[]) - 2.0).abs() < 0.06);
        assert_eq!(d[1].size(), [20_001]);
        // Kaiming-uniform with ReLU's gain over a fan-in of 32 x 3 x 3: bound sqrt(6 / 288).
        let bound = (6.0f64 / 288.0).sqrt();
        assert!(d[2].abs().max().double_value(&[]) <= bound && d[2].abs().max().double_value(&[]) > 0.99 * bound);
        assert!(d[3].equal(&Tensor::from_slice(&[0.25f32; 5])));
    }
}
