//! Forward FLOPs per image, counted layer by layer from the architecture the builders in this
//! module declare (the same block counts, widths, strides and stem choice), for the input
//! shape of the run: what the report's achieved FLOP/s and MFU rest on.
//!
//! Counted: convolutions (2 x Cin/groups x Cout x k x k x Hout x Wout), linear layers
//! (2 x in x out per token) and, for the ViTs, the attention's two matmuls (QK^T and AV,
//! 2 x T x T x width each per layer). Left out, as the usual counts (fvcore, torchvision's
//! tables) leave them out: batch norm, layer norm, activations, pooling, softmax and residual
//! adds, a few percent at most. A multiply-add is 2 FLOPs here; fvcore and torchvision's
//! tables count it as one ("ResNet-50: 4.1 GFLOPs" are multiply-adds, 8.2 GFLOPs here).
//! Training is taken as 3 x forward (backward computes the inputs' and the weights' gradients,
//! each about one forward).

use super::{ModelKind, InputSpec, SMALL_IMAGE};

fn out_size(size: i64, kernel: i64, stride: i64, padding: i64) -> i64 {
    (size + 2 * padding - kernel) / stride + 1
}

/// A walk over the layers, keeping the feature map's size.
struct Walk {
    flops: f64,
    h: i64,
    w: i64,
}

impl Walk {
    /// A convolution (no groups) applied to the current map; the map takes its output size.
    fn conv(&mut self, c_in: i64, c_out: i64, kernel: i64, stride: i64, padding: i64) {
        let (h, w) = (out_size(self.h, kernel, stride, padding), out_size(self.w, kernel, stride, padding));
        self.flops += 2.0 * (c_in * c_out * kernel * kernel) as f64 * (h * w) as f64;
        self.h = h;
        self.w = w;
    }

    /// A convolution from the map at its current size, without moving on (a shortcut branch).
    fn branch_conv(&mut self, from: (i64, i64), c_in: i64, c_out: i64, kernel: i64, stride: i64, padding: i64) {
        let (h, w) = (out_size(from.0, kernel, stride, padding), out_size(from.1, kernel, stride, padding));
        self.flops += 2.0 * (c_in * c_out * kernel * kernel) as f64 * (h * w) as f64;
    }

    fn pool(&mut self, kernel: i64, stride: i64, padding: i64) {
        self.h = out_size(self.h, kernel, stride, padding);
        self.w = out_size(self.w, kernel, stride, padding);
    }

    fn linear(&mut self, inputs: i64, outputs: i64, tokens: i64) {
        self.flops += 2.0 * (inputs * outputs * tokens) as f64;
    }
}

/// Forward FLOPs of one image through `kind` built for `spec`.
pub fn forward_flops(kind: ModelKind, spec: InputSpec) -> f64 {
    let mut walk = Walk { flops: 0.0, h: spec.height, w: spec.width };
    if let Some(c) = kind.vit_config() {
        let (h, m) = (c.hidden, c.mlp);
        let tokens = c.tokens(spec);
        // The patches' convolution (stride = kernel = patch).
        walk.conv(spec.channels, h, c.patch, c.patch, 0);
        for _ in 0..c.layers {
            walk.linear(h, 3 * h, tokens); // in-projection: q, k, v
            walk.flops += 2.0 * 2.0 * (tokens * tokens * h) as f64; // QK^T and AV over all heads
            walk.linear(h, h, tokens); // out-projection
            walk.linear(h, m, tokens);
            walk.linear(m, h, tokens);
        }
        walk.linear(h, spec.classes, 1); // the head reads the class token only
        return walk.flops;
    }
    match kind {
        ModelKind::Resnet50 | ModelKind::Resnet18 => {
            let (bottleneck, counts) = match kind {
                ModelKind::Resnet50 => (true, [3, 4, 6, 3]),
                _ => (false, [2, 2, 2, 2]),
            };
            if spec.height.min(spec.width) < SMALL_IMAGE {
                walk.conv(spec.channels, 64, 3, 1, 1);
            } else {
                walk.conv(spec.channels, 64, 7, 2, 3);
                walk.pool(3, 2, 1);
            }
            let e = if bottleneck { 4 } else { 1 };
            let mut c_in = 64;
            for (layer, (&count, planes)) in counts.iter().zip([64i64, 128, 256, 512]).enumerate() {
                for i in 0..count {
                    let stride = if i == 0 && layer > 0 { 2 } else { 1 };
                    let out = planes * e;
                    let input = (walk.h, walk.w);
                    if bottleneck {
                        walk.conv(c_in, planes, 1, 1, 0);
                        walk.conv(planes, planes, 3, stride, 1);
                        walk.conv(planes, out, 1, 1, 0);
                    } else {
                        walk.conv(c_in, planes, 3, stride, 1);
                        walk.conv(planes, planes, 3, 1, 1);
                    }
                    if stride != 1 || c_in != out {
                        walk.branch_conv(input, c_in, out, 1, stride, 0);
                    }
                    c_in = out;
                }
            }
            walk.linear(512 * e, spec.classes, 1);
        }
        ModelKind::Tiny | ModelKind::TinyUnused => {
            // The unused layer of tiny-unused never runs.
            walk.conv(spec.channels, 16, 3, 1, 1);
            walk.pool(2, 2, 0);
            walk.conv(16, 32, 3, 1, 1);
            walk.linear(32, spec.classes, 1);
        }
        ModelKind::VitL16 | ModelKind::VitB16 | ModelKind::VitTiny => unreachable!("answered above"),
    }
    walk.flops
}

/// Training FLOPs over forward FLOPs: backward costs about two forwards.
pub const TRAINING_FACTOR: f64 = 3.0;

/// A CPU core's f32 matmul rate (GFLOP/s), measured on the spot: the peak the report's MFU is
/// taken against on CPUs, where no datasheet table applies. One thread, 1024x1024 matmuls
/// for about 0.15 s, the fastest one counting (the others paid for warm caches and clocks).
/// libtorch's thread count is restored afterwards.
pub fn measure_core_gflops() -> f64 {
    const N: i64 = 1024;
    let threads = tch::get_num_threads();
    tch::set_num_threads(1);
    let a = tch::Tensor::randn([N, N], (tch::Kind::Float, tch::Device::Cpu));
    let b = tch::Tensor::randn([N, N], (tch::Kind::Float, tch::Device::Cpu));
    let start = std::time::Instant::now();
    let mut best = f64::INFINITY;
    let mut runs = 0;
    while runs < 2 || (start.elapsed().as_secs_f64() < 0.15 && runs < 50) {
        let t = std::time::Instant::now();
        let c = a.matmul(&b);
        let _ = c.double_value(&[0, 0]);
        best = best.min(t.elapsed().as_secs_f64());
        runs += 1;
    }
    tch::set_num_threads(threads);
    2.0 * (N * N * N) as f64 / best / 1e9
}

/// The node's logical cores (online), what ranks and their threads share.
pub fn node_cores() -> usize {
    // SAFETY: sysconf reads a system value and touches no memory of ours.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 {
        n as usize
    } else {
        std::thread::available_parallelism().map_or(0, |n| n.get())
    }
}

/// The device's model as its driver names it: an NVIDIA GPU's from
/// /proc/driver/nvidia/gpus/*/information ("NVIDIA H100 80GB HBM3"; the first by bus id),
/// a CPU's from /proc/cpuinfo. None where neither says.
pub fn device_model(gpu: bool) -> Option<String> {
    let field = |text: &str, key: &str| {
        text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_string())
        })
    };
    if gpu {
        let mut dirs: Vec<_> = std::fs::read_dir("/proc/driver/nvidia/gpus").ok()?.filter_map(|e| e.ok().map(|e| e.path())).collect();
        dirs.sort();
        return dirs.iter().find_map(|d| field(&std::fs::read_to_string(d.join("information")).ok()?, "Model"));
    }
    field(&std::fs::read_to_string("/proc/cpuinfo").ok()?, "model name")
}

#[cfg(test)]
mod tests {
    use super::*;

    const IMAGENET: InputSpec = InputSpec { channels: 3, height: 224, width: 224, classes: 1000 };

    fn close(value: f64, expected: f64, tolerance: f64) -> bool {
        ((value - expected) / expected).abs() < tolerance
    }

    #[test]
    fn imagenet_models_match_the_published_counts() {
        // torchvision's tables: ResNet-50 4.09 GMACs, ResNet-18 1.81, ViT-B/16 17.56,
        // ViT-L/16 61.55 (multiply-adds, what they call GFLOPS): 2 FLOPs each here.
        for (kind, gmacs) in [(ModelKind::Resnet50, 4.09), (ModelKind::Resnet18, 1.81), (ModelKind::VitB16, 17.56), (ModelKind::VitL16, 61.55)] {
            let flops = forward_flops(kind, IMAGENET);
            assert!(close(flops, 2.0 * gmacs * 1e9, 0.03), "{kind:?}: {:.3} GFLOPs, expected about {:.2}", flops / 1e9, 2.0 * gmacs);
        }
    }

    #[test]
    fn the_count_follows_the_input_shape() {
        // The tiny CNN on 1x28x28: conv1 2x1x16x9x784, conv2 (14x14) 2x16x32x9x196, fc 2x32x10.
        let spec = InputSpec { channels: 1, height: 28, width: 28, classes: 10 };
        assert_eq!(forward_flops(ModelKind::Tiny, spec), (2 * 16 * 9 * 784 + 2 * 16 * 32 * 9 * 196 + 2 * 32 * 10) as f64);
        // A small image takes the CIFAR stem: no downsampling before layer1, so more FLOPs per
        // pixel than at 224.
        let cifar = InputSpec { channels: 3, height: 32, width: 32, classes: 10 };
        let per_pixel = |s: InputSpec| forward_flops(ModelKind::Resnet18, s) / (s.height * s.width) as f64;
        assert!(per_pixel(cifar) > 10.0 * per_pixel(IMAGENET));
    }
}
